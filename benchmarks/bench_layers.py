"""Layer-level cost of every CEM and NRGPT row against its peer layer, next to its FLOP bound.

CEM rows (``CEMBlock``: T = 1, 2, 4; tied, diag_shared, diag_per_head; preconditioner, folded into
the output weights and, as the plain path beside it, applied to each step's gradient) are timed
against ``transformers``' ``LlamaDecoderLayer`` (SDPA) at the same shape; NRGPT block rows (FF1,
FF2W, full and factored J, and the reference preset's block) against our GPT_Rec_parallel block
and against the same energy differentiated with ``torch.func.grad`` inside the forward (what the
released NRGPT code does; the table's ``max |Δ|`` is the largest output difference of the pair).

For each row the table shows the measured time ratio to the peer (forward + backward, median of
interleaved repeats, so every row sees the same machine load), the FLOP ratio to the peer
(``energyformer.models.flops.flop_counter``: causal attention charged for the ``N(N+1)/2`` pairs
of its mask; the ``torch.func.grad`` twin materializes its scores and is charged the full product), and their quotient
``cost / bound``: 1.00 means the row costs exactly what its FLOPs say relative to the peer.

Goals (issue 10; ``--check`` exits 1 naming each miss with its numbers):

* every CEM row: cost / bound ≤ 1.10 against the Llama layer;
* CEM T=1 tied: ≥ 1.05× faster than the Llama layer;
* every NRGPT row: time ratio ≤ 1.10 × FLOP ratio against the GPT_Rec_parallel block;
* the NRGPT reference block: ≥ 1.5× faster than its ``torch.func.grad`` twin.

    python benchmarks/bench_layers.py                      # the three CPU shapes
    python benchmarks/bench_layers.py --shapes gpu --device cuda
    python benchmarks/bench_layers.py --quick              # 3 repeats at the tiny shape (smoke)
    python benchmarks/bench_layers.py --check              # exit 1 when a goal is missed (for the record)
    python benchmarks/bench_layers.py --rows "cem T=2,reference"   # some rows (and their peers) only
    python benchmarks/bench_layers.py --rows cem --shape 128,4,128,32 --shape 256,8,256,4   # some shapes only
    python benchmarks/bench_layers.py --profile "cem diag_shared" --profile-shape 256,8,256,4
    python benchmarks/bench_layers.py --rows cem --processes 5   # each row's median over 5 fresh processes

``--processes K`` measures in K fresh processes, one after another, and reports each row's
median (and the range of ``cost / bound``): on a shared VM a whole row can move by ±5–10% from one
process to the next (memory layout, neighbours), more than the interleaved repeats inside one
process show.

Writes benchmarks/results/bench_layers[-<shapes>]-<device>.json (environment, settings, every row).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from common import LAYER_SHAPES, find_name, finish, goal, interleaved_median_ms, parse_args, profile_table, run_main

from energyformer.energies.heads import causal_blocks
from energyformer.layers import CEMBlock, GPTBlock, NRGPTBlock
from energyformer.models.config import default_d_ff
from energyformer.models.flops import flop_counter

LLAMA = "transformers LlamaDecoderLayer"
GPT_REC = "gpt_rec_parallel block"
GRAD = " (torch.func.grad)"
CEM_ROWS = [
    ("cem T=1 tied", dict(attn_n_steps=1, mlp_n_steps=1)),
    ("cem T=2 tied", dict(attn_n_steps=2, mlp_n_steps=2)),
    ("cem T=4 tied", dict(attn_n_steps=4, mlp_n_steps=4)),
    ("cem diag_shared", dict(interaction="diag_shared")),
    ("cem diag_per_head", dict(interaction="diag_per_head")),
    ("cem preconditioner", dict(preconditioner="diag_lowrank")),
    ("cem full (T=2, diag_shared, P)", dict(attn_n_steps=2, mlp_n_steps=2, interaction="diag_shared",
                                            preconditioner="diag_lowrank")),
    # the plain path beside the fast one: P applied to each step's gradient, not folded into the weights
    ("cem preconditioner, P per step", dict(preconditioner="diag_lowrank", fold_preconditioner=False)),
    ("cem full, P per step", dict(attn_n_steps=2, mlp_n_steps=2, interaction="diag_shared",
                                  preconditioner="diag_lowrank", fold_preconditioner=False)),
]
NRGPT_REFERENCE = "nrgpt reference (ff2w full J)"
NRGPT_ROWS = [
    ("nrgpt ff2w full J", dict(ff="ff2w", attention="full")),
    ("nrgpt ff1 full J", dict(ff="ff1", attention="full")),
    ("nrgpt ff2w factored", dict(ff="ff2w", attention="factored")),
    # the block of NRGPTConfig.reference(): fixed α, inclusive mask, frozen-γ LayerNorm, full η
    (NRGPT_REFERENCE, dict(ff="ff2w", attention="full", learn_alpha=False, mask="inclusive",
                           norm="layernorm_frozen", eta_param="full")),
]
COST_GOAL = 1.10  # cost / bound, CEM and NRGPT rows
CEM_T1_SPEEDUP_GOAL = 1.05  # CEM T=1 vs the Llama layer
REFERENCE_SPEEDUP_GOAL = 1.5  # NRGPT reference block vs its torch.func.grad twin


def hf_llama_layer(d: int, h: int, d_ff: int):
    """``transformers``' LlamaDecoderLayer (SDPA) and a callable ``x -> y``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=d, num_attention_heads=h, num_key_value_heads=h, intermediate_size=d_ff,
                      num_hidden_layers=1, attn_implementation="sdpa")
    layer, rotary = LlamaDecoderLayer(cfg, layer_idx=0), LlamaRotaryEmbedding(cfg)
    layer.rotary = rotary  # moved with the layer by .to(device)

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


def peer_of(name: str) -> str:
    """The layer a row is compared with."""
    if name.startswith("cem"):
        return LLAMA
    if name.endswith(GRAD):
        return name[: -len(GRAD)]
    if name.startswith("nrgpt"):
        return GPT_REC
    return name


def row_names() -> list[str]:
    """Every row of a shape, peers included, in table order."""
    return ([LLAMA] + [name for name, _ in CEM_ROWS] + [GPT_REC]
            + [k for name, _ in NRGPT_ROWS for k in (name, name + GRAD)])


def select_rows(patterns: list[str] | None) -> list[str]:
    """The rows whose names contain one of ``patterns`` (case-insensitive), with their peers
    (all rows for ``None``).

    Raises:
        ValueError: a pattern matches no row (the message lists the rows).
    """
    names = row_names()
    if not patterns:
        return names
    chosen = set()
    for pat in patterns:
        hits = [k for k in names if pat.lower() in k.lower()]
        if not hits:
            raise ValueError(f"--rows {pat!r} matches no row; expected part of one of: " + "; ".join(names))
        chosen.update(hits)
    for k in list(chosen):
        while peer_of(k) != k:
            k = peer_of(k)
            chosen.add(k)
    return [k for k in names if k in chosen]


def build_layers(d: int, h: int, device: str, names: list[str] | None = None) -> dict[str, Callable]:
    """The rows ``names`` (default all) of one shape as callables ``x (B, N, d) -> (B, N, d)``;
    a ``torch.func.grad`` row needs its block among ``names``."""
    names = row_names() if names is None else names
    torch.manual_seed(0)
    d_ff = default_d_ff(d)
    layers: dict[str, Callable] = {}
    if LLAMA in names:
        peer_layer, layers[LLAMA] = hf_llama_layer(d, h, d_ff)
        peer_layer.to(device)
    for name, kw in CEM_ROWS:
        if name in names:
            kw = dict(kw)
            fold = kw.pop("fold_preconditioner", True)
            layers[name] = CEMBlock(d, h, d_ff, rope="llama", **kw).to(device)
            layers[name].attn.fold_preconditioner = layers[name].mlp.fold_preconditioner = fold
    if GPT_REC in names:
        layers[GPT_REC] = GPTBlock(d, h, 4 * d, activation="relu", parallel=True).to(device)
    for name, kw in NRGPT_ROWS:
        if name in names:
            layers[name] = NRGPTBlock(d, h, **kw).to(device)
            if name + GRAD in names:
                layers[name + GRAD] = AutogradNRGPT(layers[name])
    return layers


def flops(fn, x) -> float:
    """FLOPs of a forward + backward of ``fn`` at ``x``, counted as ``energyformer.models.flops``
    counts them: causal attention charged for the ``N(N+1)/2`` pairs of its mask, a causal SDPA
    call and a materialized-scores path alike (the latter counted with one query row per causal
    block, ``energies.heads.causal_blocks``, so it is bound by the pairs it must compute, not by the
    rectangle it may compute)."""
    counter = flop_counter()
    with counter, causal_blocks(x.shape[1]):
        fn(x).sum().backward()
    return float(counter.get_total_flops())


def train_step(fn, x: torch.Tensor) -> Callable[[], None]:
    """Forward + backward of ``fn`` at a fresh leaf copy of ``x``."""
    def step():
        xx = x.detach().requires_grad_(True)
        fn(xx).sum().backward()
    return step


def row_goals(name: str, time_ratio: float, cost: float) -> list[dict]:
    """The issue's goals for one row (see the module docstring)."""
    goals = []
    if name.startswith(("cem", "nrgpt")) and not name.endswith(GRAD):
        goals.append(goal("cost / bound", cost, "<=", COST_GOAL))
    if name == "cem T=1 tied":
        goals.append(goal("speed-up vs Llama layer", 1 / time_ratio, ">=", CEM_T1_SPEEDUP_GOAL))
    if name == NRGPT_REFERENCE + GRAD:
        goals.append(goal("reference speed-up vs torch.func.grad", time_ratio, ">=", REFERENCE_SPEEDUP_GOAL))
    return goals


def bench_shape(d: int, h: int, n: int, b: int, repeats: int, device: str,
                names: list[str] | None = None) -> list[dict]:
    """Every row ``names`` (default all) at one shape, with its ratios and goals."""
    layers = build_layers(d, h, device, names)
    x = torch.randn(b, n, d, device=device)
    fl = {k: flops(fn, x) for k, fn in layers.items()}
    with torch.no_grad():
        diff = {k: float((fn(x) - layers[peer_of(k)](x)).abs().max()) for k, fn in layers.items() if k.endswith(GRAD)}
    ms = interleaved_median_ms({k: train_step(fn, x) for k, fn in layers.items()}, repeats, device)
    rows = []
    for k in layers:
        peer_name = peer_of(k)
        t_ratio, f_ratio = ms[k] / ms[peer_name], fl[k] / fl[peer_name]
        row = {"shape": [d, h, n, b], "row": k, "peer": peer_name, "ms": ms[k], "gflop": fl[k] / 1e9,
               "time_ratio": t_ratio, "flop_ratio": f_ratio, "cost_over_bound": t_ratio / f_ratio,
               "goals": row_goals(k, t_ratio, t_ratio / f_ratio)}
        if k in diff:
            row["max_abs_diff"] = diff[k]
        rows.append(row)
    return rows


def aggregate_runs(runs: list[list[dict]]) -> list[dict]:
    """One row per (shape, row) from the rows of several processes' runs: the median of ``ms``,
    ``time_ratio`` and ``cost_over_bound`` (FLOPs do not vary), every process's ``cost_over_bound``
    in ``cost_over_bound_runs``, and the goals judged on the medians.

    Raises:
        ValueError: no runs, or runs that do not hold the same rows.
    """
    if not runs:
        raise ValueError("aggregate_runs needs at least one run")
    keys = [(tuple(r["shape"]), r["row"]) for r in runs[0]]
    by_run = [{(tuple(r["shape"]), r["row"]): r for r in run} for run in runs]
    if any(set(b) != set(keys) for b in by_run):
        raise ValueError("the processes' runs hold different rows")
    out = []
    for key in keys:
        rs = [b[key] for b in by_run]
        row = dict(rs[0])
        for field in ("ms", "time_ratio", "cost_over_bound"):
            row[field] = statistics.median(r[field] for r in rs)
        row["cost_over_bound_runs"] = [r["cost_over_bound"] for r in rs]
        row["goals"] = row_goals(row["row"], row["time_ratio"], row["cost_over_bound"])
        out.append(row)
    return out


def format_table(rows: list[dict]) -> str:
    runs = "cost_over_bound_runs" in rows[0] if rows else False
    lines = ["| shape (d, H, N, B) | row | peer | ms | GFLOP | time / peer | FLOPs / peer | cost / bound |"
             + (" range (processes) |" if runs else ""),
             "|---|---|---|---:|---:|---:|---:|---:|" + ("---:|" if runs else "")]
    for r in rows:
        line = (f"| {tuple(r['shape'])} | {r['row']} | {r['peer']} | {r['ms']:.1f} | {r['gflop']:.2f} | "
                f"{r['time_ratio']:.2f} | {r['flop_ratio']:.2f} | {r['cost_over_bound']:.2f} |")
        if runs:
            line += f" {min(r['cost_over_bound_runs']):.2f}–{max(r['cost_over_bound_runs']):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def run_in_processes(args: argparse.Namespace, shapes: list[tuple[int, int, int, int]], repeats: int,
                     k: int) -> list[dict]:
    """The measurement of ``args`` in ``k`` fresh processes, one after another, aggregated
    (:func:`aggregate_runs`)."""
    child = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--repeats", str(repeats)]
    for shape in shapes:
        child += ["--shape", ",".join(map(str, shape))]
    if args.rows:
        child += ["--rows", args.rows]
    if args.threads:
        child += ["--threads", str(args.threads)]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(k):
            out = Path(tmp) / f"run{i}.json"
            done = subprocess.run(child + ["--out", str(out)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"process {i + 1} of {k} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            runs.append(json.loads(out.read_text())["rows"])
            print(f"process {i + 1} of {k} done", file=sys.stderr)
    return aggregate_runs(runs)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"d,H,N,B"`` → ``(d, H, N, B)``.

    Raises:
        ValueError: not four positive integers.
    """
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"shape {text!r} must be four positive integers d,H,N,B (e.g. 256,8,256,4)")
    return shape  # type: ignore[return-value]


def profile_row(name: str, shape: tuple[int, int, int, int], device: str, steps: int = 3, row_limit: int = 25) -> str:
    """torch.profiler table of one row's forward + backward at one shape: the top ops by self CPU
    time (and by self CUDA time on a GPU), over ``steps`` steps after two warm-up steps."""
    d, h, n, b = shape
    key = find_name(name, row_names())
    layers = build_layers(d, h, device, select_rows([key]))
    step = train_step(layers[key], torch.randn(b, n, d, device=device))
    head = f"profile of {key!r} at (d, H, N, B) = {shape}, forward + backward, {steps} steps, device {device}"
    return profile_table(step, device, head, steps, row_limit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="cpu", choices=sorted(LAYER_SHAPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="3 repeats at the tiny shape")
    p.add_argument("--check", action="store_true", help="exit 1 when a goal is missed (each miss is printed)")
    p.add_argument("--rows", default=None, metavar="A,B",
                   help="only the rows whose names contain one of these comma-separated parts (and their peers)")
    p.add_argument("--profile", metavar="ROW", default=None,
                   help="print the torch.profiler table of this row (name or unique part of it) and exit")
    p.add_argument("--profile-shape", default=None, metavar="d,H,N,B",
                   help="shape of --profile (default: the first shape of --shapes)")
    p.add_argument("--shape", action="append", default=None, metavar="d,H,N,B",
                   help="this shape instead of --shapes' (repeatable), e.g. --shape 128,4,128,32")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/bench_layers[-<shapes>]-<device>.json)")
    p.add_argument("--processes", type=int, default=1, metavar="K",
                   help="measure in K fresh processes one after another; report each row's median and range")
    args = parse_args(p, argv)
    if args.processes < 1:
        raise ValueError(f"--processes {args.processes} must be at least 1")
    shapes_name = "tiny" if args.quick else args.shapes
    if args.profile_shape and not args.profile:
        raise ValueError(f"--profile-shape {args.profile_shape!r} needs --profile ROW (it is the shape of the profile)")
    if args.profile:
        shape = parse_shape(args.profile_shape) if args.profile_shape else LAYER_SHAPES[shapes_name][0]
        print(profile_row(args.profile, shape, args.device))
        return 0
    repeats = 3 if args.quick else args.repeats
    names = select_rows(args.rows.split(",") if args.rows else None)
    shapes = [parse_shape(s) for s in args.shape] if args.shape else LAYER_SHAPES[shapes_name]
    if args.processes > 1:
        rows = run_in_processes(args, shapes, repeats, args.processes)
    else:
        rows = [r for shape in shapes for r in bench_shape(*shape, repeats, args.device, names)]
    print(format_table(rows))
    tag = "" if shapes_name == "cpu" and not args.shape else (
        "-".join("x".join(map(str, s)) for s in shapes) if args.shape else shapes_name)
    return finish("bench_layers", args, {**vars(args), "shapes": shapes_name, "repeats": repeats}, rows, tag)


if __name__ == "__main__":
    sys.exit(run_main(main))
