"""Activation memory of randomized-depth training: truncated back-propagation against full, in one run.

Every recurrent family (NRGPT FF2W, GPT_Rec_parallel, CEM with its steps inside each layer) at
depths 2, 4, 8 and 16 (``n_steps`` at call time, what ``train.depth_sampler`` draws), one
training step's forward with back-propagation through the last ``k = 2`` steps
(``train.backprop_steps``) against through every step. The measure is the bytes of the tensors
autograd saves for the backward (each storage once, parameters excluded:
``common.saved_tensor_bytes``, as ``bench_models.py``), the activation memory that truncation
trades away; on CUDA also the peak allocated during the step above what was held before it.
Bytes, not time: nothing here is timed. The count goes by storage address, so a tensor freed
during the forward (NRGPT's and GPT_Rec's embedding ids once the truncation cuts the embeddings
off) can share its address with a later one: rows may differ by such a few hundred bytes.

Goal (issue 29): with ``k`` fixed the activation memory is flat in the depth: at the deepest
depth it is at most 1.01 × that at depth 4 (where truncation starts to apply).

    python benchmarks/bench_depth.py                 # the d 128 shape (batch 32 x 128), CPU
    python benchmarks/bench_depth.py --quick         # tiny shape, depths 2 and 4 (smoke)

Writes benchmarks/results/bench_depth-<shape>-<device>.json (environment, settings, every row).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from common import MODEL_SHAPES, ModelShape, finish, goal, parse_args, run_main, saved_tensor_bytes, sync

from energyformer import build_model

FLAT_GOAL = 1.01  # saved bytes at the deepest depth / at depth 4, with k fixed
DEPTHS = (2, 4, 8, 16)
K = 2


def family_configs(s: ModelShape) -> dict[str, dict[str, Any]]:
    """The recurrent families at shape ``s`` (CEM: ``s.depth`` layers, the recursion in each)."""
    return {
        "nrgpt ff2w": {"arch": "nrgpt", "d_model": s.d_model, "n_heads": s.n_heads, "ff": "ff2w"},
        "gpt_rec_parallel": {"arch": "gpt_rec", "d_model": s.d_model, "n_heads": s.n_heads, "parallel": True},
        "cem": {"arch": "cem", "d_model": s.d_model, "n_heads": s.n_heads, "n_layers": s.depth, "d_ff": s.d_ff},
    }


def activation_bytes(model, idx: torch.Tensor, device: str, **kw: Any) -> dict[str, float]:
    """``saved_mb`` of one training step's forward with ``kw`` (``n_steps``, ``backprop_steps``);
    on CUDA also ``peak_mb``, the peak allocated by the forward and backward above the memory held before."""
    out: dict[str, Any] = {}

    def forward():
        out["loss"] = model(idx, targets=idx, **kw)[1]

    mem = {"saved_mb": saved_tensor_bytes(forward, exclude=list(model.parameters())) / 2**20}
    del out["loss"]
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        model(idx, targets=idx, **kw)[1].backward()
        sync(device)
        mem["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        model.zero_grad(set_to_none=True)
    return mem


def measure(s: ModelShape, *, vocab: int, device: str, depths: tuple[int, ...], k: int) -> list[dict[str, Any]]:
    """One row per family and depth: full and truncated activation memory, their ratio, the goal."""
    idx = torch.randint(0, vocab, (s.batch_size, s.block_size), generator=torch.Generator().manual_seed(0))
    idx = idx.to(device)
    rows = []
    for name, cfg in family_configs(s).items():
        torch.manual_seed(0)
        model = build_model({"vocab_size": vocab, "block_size": s.block_size, **cfg}).to(device).train()
        family = []
        for depth in depths:
            full = activation_bytes(model, idx, device, n_steps=depth)
            cut = activation_bytes(model, idx, device, n_steps=depth, backprop_steps=k)
            row = {"family": name, "depth": depth, "k": k, "full_saved_mb": full["saved_mb"],
                   "truncated_saved_mb": cut["saved_mb"], "truncated_over_full": cut["saved_mb"] / full["saved_mb"],
                   "goals": []}
            if "peak_mb" in full:
                row.update(full_peak_mb=full["peak_mb"], truncated_peak_mb=cut["peak_mb"])
            family.append(row)
        rows += family
        at4 = [r for r in family if r["depth"] == 4]
        deepest = family[-1]
        if at4 and deepest["depth"] > 4:
            growth = deepest["truncated_saved_mb"] / at4[0]["truncated_saved_mb"]
            deepest["goals"].append(goal(f"k={k}: memory at depth {deepest['depth']} / depth 4", growth, "<=",
                                         FLAT_GOAL))
        del model
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    peak = any("full_peak_mb" in r for r in rows)
    head = ["family", "depth", "full MiB", f"k={rows[0]['k']} MiB" if rows else "k MiB", "truncated / full"]
    head += ["full peak MiB", "truncated peak MiB"] if peak else []
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [r["family"], str(r["depth"]), f"{r['full_saved_mb']:.1f}", f"{r['truncated_saved_mb']:.1f}",
                 f"{r['truncated_over_full']:.2f}"]
        if peak:
            cells += [f"{r['full_peak_mb']:.1f}", f"{r['truncated_peak_mb']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="d128", choices=sorted(MODEL_SHAPES), help="a registry shape")
    ap.add_argument("--vocab-size", type=int, default=74)
    ap.add_argument("--depths", default=None, metavar="A,B", help=f"depths (default {','.join(map(str, DEPTHS))})")
    ap.add_argument("--k", type=int, default=K, help=f"train.backprop_steps (default {K})")
    ap.add_argument("--quick", action="store_true", help="tiny shape, depths 2 and 4 (and 8 for the goal)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed (each miss is printed)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/bench_depth-<shape>-<device>.json)")
    args = parse_args(ap, argv)
    tag = "tiny" if args.quick else args.shape
    shape = MODEL_SHAPES[tag]
    depths = tuple(int(d) for d in args.depths.split(",")) if args.depths else ((2, 4, 8) if args.quick else DEPTHS)
    if min(depths) < 1 or args.k < 1:
        raise ValueError(f"--depths {depths} and --k {args.k} must be positive integers")
    rows = measure(shape, vocab=args.vocab_size, device=args.device, depths=depths, k=args.k)
    print(f"shape {shape.as_dict()}, device {args.device}, fp32; activation memory = bytes autograd saves in one "
          f"training step's forward (parameters excluded); k = train.backprop_steps = {args.k}")
    print(format_table(rows))
    settings = {**vars(args), "shape": tag, "model_shape": shape.as_dict(), "depths": list(depths)}
    return finish("bench_depth", args, settings, rows, tag)


if __name__ == "__main__":
    sys.exit(run_main(main))
