"""Layer-level cost of every CEM and NRGPT row against its peer layer, next to its FLOP bound.

CEM rows (``CEMBlock``: T = 1, 2, 4; tied, diag_shared, diag_per_head; preconditioner) are timed
against ``transformers``' ``LlamaDecoderLayer`` (SDPA) at the same shape; NRGPT block rows (FF1,
FF2W, full and factored J) against our GPT_Rec_parallel block and against the same energy
differentiated with ``torch.func.grad`` inside the forward (what the released NRGPT code does).

For each row the table shows the measured time ratio to the peer (forward + backward, median of
interleaved repeats, so every row sees the same machine load), the FLOP ratio to the peer
(``torch.utils.flop_counter``, see ``energyformer.models.flops``), and their quotient
``cost / bound``: 1.00 means the row costs exactly what its FLOPs say relative to the peer; the
issue's goal is ≤ 1.10 for the CEM rows and ≤ 1.10 × FLOP ratio for the NRGPT rows.

    python benchmarks/bench_layers.py                      # the three CPU shapes
    python benchmarks/bench_layers.py --shapes gpu --device cuda
    python benchmarks/bench_layers.py --quick              # 3 repeats at the smallest shape (smoke)
    python benchmarks/bench_layers.py --check              # exit 1 when a goal is missed (for the record)

Writes benchmarks/results/bench_layers-<machine>.json (environment, settings, every row).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import flop_counter

from common import write_results

import energyformer.models.flops  # noqa: F401  (registers the CPU SDPA FLOP formulas)
from energyformer.layers import CEMBlock, GPTBlock, NRGPTBlock
from energyformer.models.base import default_d_ff

# (d_model, n_heads, N, B)
SHAPES = {
    "cpu": [(256, 8, 256, 4), (512, 8, 256, 4), (768, 12, 512, 2)],
    "gpu": [(768, 12, 1024, 16)],
    "tiny": [(128, 4, 128, 4)],
}
CEM_ROWS = [
    ("cem T=1 tied", dict(attn_n_steps=1, mlp_n_steps=1)),
    ("cem T=2 tied", dict(attn_n_steps=2, mlp_n_steps=2)),
    ("cem T=4 tied", dict(attn_n_steps=4, mlp_n_steps=4)),
    ("cem diag_shared", dict(interaction="diag_shared")),
    ("cem diag_per_head", dict(interaction="diag_per_head")),
    ("cem preconditioner", dict(preconditioner="diag_lowrank")),
    ("cem full (T=2, diag_shared, P)", dict(attn_n_steps=2, mlp_n_steps=2, interaction="diag_shared",
                                            preconditioner="diag_lowrank")),
]
NRGPT_ROWS = [
    ("nrgpt ff2w full J", dict(ff="ff2w", attention="full")),
    ("nrgpt ff1 full J", dict(ff="ff1", attention="full")),
    ("nrgpt ff2w factored", dict(ff="ff2w", attention="factored")),
]
GOAL = 1.10


def hf_llama_layer(d: int, h: int, d_ff: int):
    """``transformers``' LlamaDecoderLayer (SDPA) and a callable ``x -> y``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=d, num_attention_heads=h, num_key_value_heads=h, intermediate_size=d_ff,
                      num_hidden_layers=1, attn_implementation="sdpa")
    layer, rotary = LlamaDecoderLayer(cfg, layer_idx=0), LlamaRotaryEmbedding(cfg)

    def run(x):
        pos = torch.arange(x.shape[1], device=x.device)[None]
        out = layer(x, position_embeddings=rotary(x, pos), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    return layer, run


class AutogradNRGPT(torch.nn.Module):
    """The NRGPT block with its force from ``torch.func.grad`` of the energy inside the forward
    (the released code's approach): the same math as ``NRGPTBlock``, differentiated twice in training."""

    def __init__(self, block: NRGPTBlock):
        super().__init__()
        self.block = block

    def forward(self, x):
        b = self.block
        g = b.normalize(x)

        def energy(gq):
            return (b.attention.energy(gq, context=g) + b.ff_scale * b.ff.energy(gq)).sum()

        force = torch.func.grad(energy)(g)
        return x - b.eta(force)


def flops(fn, x) -> float:
    counter = flop_counter.FlopCounterMode(display=False)
    with counter:
        fn(x).sum().backward()
    return float(counter.get_total_flops())


def interleaved_ms(fns: dict, x: torch.Tensor, repeats: int, device: str) -> dict:
    """Median forward+backward ms of every callable, timed in turn so that load hits all alike."""
    def step(fn):
        xx = x.detach().requires_grad_(True)
        fn(xx).sum().backward()

    for fn in fns.values():  # warm-up
        step(fn), step(fn)
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(fn)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_shape(d: int, h: int, n: int, b: int, repeats: int, device: str) -> list[dict]:
    torch.manual_seed(0)
    d_ff = default_d_ff(d)
    x = torch.randn(b, n, d, device=device)
    peer_layer, peer = hf_llama_layer(d, h, d_ff)
    peer_layer.to(device)
    layers = {"transformers LlamaDecoderLayer": peer}
    for name, kw in CEM_ROWS:
        layers[name] = CEMBlock(d, h, d_ff, rope="llama", **kw).to(device)
    gpt_rec = GPTBlock(d, h, 4 * d, activation="relu", parallel=True).to(device)
    layers["gpt_rec_parallel block"] = gpt_rec
    for name, kw in NRGPT_ROWS:
        blk = NRGPTBlock(d, h, **kw).to(device)
        layers[name] = blk
        layers[name + " (torch.func.grad)"] = AutogradNRGPT(blk)
    fl = {k: flops(fn, x) for k, fn in layers.items()}
    ms = interleaved_ms(layers, x, repeats, device)
    rows = []
    for k in layers:
        if k.startswith("cem"):
            peer_name = "transformers LlamaDecoderLayer"
        elif k.endswith("(torch.func.grad)"):
            peer_name = k[: -len(" (torch.func.grad)")]
        elif k.startswith("nrgpt"):
            peer_name = "gpt_rec_parallel block"
        else:
            peer_name = k
        t_ratio, f_ratio = ms[k] / ms[peer_name], fl[k] / fl[peer_name]
        rows.append({"shape": [d, h, n, b], "row": k, "peer": peer_name, "ms": ms[k], "gflop": fl[k] / 1e9,
                     "time_ratio": t_ratio, "flop_ratio": f_ratio, "cost_over_bound": t_ratio / f_ratio})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| shape (d, H, N, B) | row | peer | ms | GFLOP | time / peer | FLOPs / peer | cost / bound |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {tuple(r['shape'])} | {r['row']} | {r['peer']} | {r['ms']:.1f} | {r['gflop']:.2f} | "
                     f"{r['time_ratio']:.2f} | {r['flop_ratio']:.2f} | {r['cost_over_bound']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="cpu", choices=sorted(SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="3 repeats at the tiny shape")
    p.add_argument("--check", action="store_true", help="exit 1 when a CEM row's cost/bound exceeds 1.10")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_layers-<machine>.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes, repeats = (SHAPES["tiny"], 3) if args.quick else (SHAPES[args.shapes], args.repeats)
    rows = [r for shape in shapes for r in bench_shape(*shape, repeats, args.device)]
    print(format_table(rows))
    machine = f"{platform.machine()}-{torch.get_num_threads()}threads-{args.device}"
    write_results(args.out or Path(__file__).parent / "results" / f"bench_layers-{machine}.json", args.device,
                  {**vars(args), "repeats": repeats}, rows)
    missed = [r for r in rows if r["row"].startswith(("cem", "nrgpt")) and not r["row"].endswith("grad)")
              and r["cost_over_bound"] > GOAL]
    if args.check and missed:
        print(f"{len(missed)} row(s) above cost/bound {GOAL}: " + ", ".join(r["row"] for r in missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
