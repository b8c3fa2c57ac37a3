"""Training speed, MFU and activation memory of every model family against its baseline, in one run.

Each row times a training step (forward + backward of the loss, gradients zeroed, no optimizer)
and a forward-only inference step, all rows in turn (median of interleaved repeats, so machine
load hits every row alike), and reports:

* train tokens/s and the time ratio to the row's baseline (Llama for CEM, GPT_Rec_parallel for
  NRGPT), next to the FLOP ratio and their quotient ``cost / bound``;
* FLOPs per token of a training step counting every recurrent step
  (``energyformer.models.flops.training_flops_per_token``) and the MFU against a matmul peak
  measured in the same loop (a square ``torch.mm``, ``--peak-n``³, in the precision the models
  run in: fp32 on CPU, bf16 autocast on CUDA);
* activation memory of one training step: the bytes of the tensors autograd saves for the
  backward (each storage once, parameters excluded) and, on CUDA, the peak allocated above the
  memory held before the step (``torch.cuda.max_memory_allocated``);
* with ``--compile``: the same train step of ``torch.compile(model, fullgraph=True)``, timed after
  its compilation (the compile time is reported, not timed), and the eager / compiled ratio;
* per-step activation checkpointing at T = 4 against T = 1 (CEM, NRGPT, GPT_Rec_parallel):
  activation memory ratio and the recompute cost (time of T = 4 with / without checkpointing).

Goals (issue 10; ``--check`` exits 1 naming each miss with its numbers): MFU ≥ 0.40 at
d_model ≥ 256 (the better of eager and compiled); compiled train step faster than eager at
d_model ≥ 256; T = 4 with checkpointing ≤ 1.3 × the activation memory of T = 1.

    python benchmarks/bench_models.py                           # d 128 (the Shakespeare recipe width)
    python benchmarks/bench_models.py --d-model 256 --compile   # the MFU and compile goals
    python benchmarks/bench_models.py --shape gpu --device cuda --compile
    python benchmarks/bench_models.py --quick                   # tiny shape, 3 repeats (smoke)
    python benchmarks/bench_models.py --rows "nrgpt" --no-checkpointing   # some families (and baselines)

Writes benchmarks/results/bench_models-<shape>-<device>.json (environment, settings, every row).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from common import (
    MODEL_SHAPES,
    ModelShape,
    autocast,
    find_name,
    finish,
    flops_per_s,
    goal,
    interleaved_median_ms,
    matmul_flops,
    matmul_step,
    mfu,
    model_shape,
    parse_args,
    profile_table,
    run_main,
    saved_tensor_bytes,
    sync,
)

from energyformer import build_model
from energyformer.models.flops import training_flops_per_token
from energyformer.train.parallelize import apply_activation_checkpointing

MFU_GOAL = 0.40
COMPILE_GOAL = 1.0  # eager ms / compiled ms
CHECKPOINT_GOAL = 1.3  # activation memory, T = 4 with checkpointing / T = 1
GOAL_MIN_D = 256  # the MFU and compile goals apply from this width
PEAK = "matmul peak"


def family_rows(s: ModelShape) -> list[tuple[str, str, dict[str, Any]]]:
    """``(name, baseline name, model config)`` of every family at shape ``s``."""
    llama = dict(d_model=s.d_model, n_layers=s.depth, n_heads=s.n_heads, d_ff=s.d_ff)
    rec = dict(d_model=s.d_model, n_steps=s.depth, n_heads=s.n_heads)
    return [
        ("llama", "llama", dict(arch="llama", **llama)),
        ("cem T=1", "llama", dict(arch="cem", n_steps=1, interaction="lowrank", rope="llama", **llama)),
        ("cem T=2", "llama", dict(arch="cem", n_steps=2, interaction="lowrank", **llama)),
        ("cem diag_shared", "llama", dict(arch="cem", interaction="diag_shared", **llama)),
        ("cem diag_per_head", "llama", dict(arch="cem", interaction="diag_per_head", **llama)),
        ("cem full (T=2+diag+P)", "llama", dict(arch="cem", n_steps=2, interaction="diag_shared",
                                                preconditioner="diag_lowrank", **llama)),
        ("gpt", "gpt", dict(arch="gpt", d_model=s.d_model, n_layers=s.depth, n_heads=s.n_heads)),
        ("gpt_rec_parallel", "gpt_rec_parallel", dict(arch="gpt_rec", parallel=True, **rec)),
        ("nrgpt ff2w", "gpt_rec_parallel", dict(arch="nrgpt", ff="ff2w", **rec)),
        ("nrgpt ff1", "gpt_rec_parallel", dict(arch="nrgpt", ff="ff1", **rec)),
        ("nrgpt factored", "gpt_rec_parallel", dict(arch="nrgpt", attention="factored", **rec)),
    ]


def select_families(fams: list[tuple[str, str, dict]], only: list[str] | None) -> list[tuple[str, str, dict]]:
    """The families whose names contain one of the parts ``only`` (all for ``None``), with their
    baselines.

    Raises:
        ValueError: a part matches no family (the message lists them).
    """
    if not only:
        return fams
    chosen = set()
    for part in only:
        hits = [f for f in fams if part.lower() in f[0].lower()]
        if not hits:
            raise ValueError(f"--rows {part!r} matches no family; expected part of one of: "
                             + "; ".join(f[0] for f in fams))
        chosen.update(n for f in hits for n in (f[0], f[1]))
    return [f for f in fams if f[0] in chosen]


def checkpoint_families(s: ModelShape) -> list[tuple[str, dict[str, Any]]]:
    """``(name, model config without n_steps)`` of the families whose steps are checkpointed:
    CEM keeps its ``depth`` layers and varies the descent steps per layer; NRGPT and
    GPT_Rec_parallel vary their recurrent steps (their depth)."""
    return [
        ("cem", dict(arch="cem", d_model=s.d_model, n_layers=s.depth, n_heads=s.n_heads, d_ff=s.d_ff)),
        ("nrgpt", dict(arch="nrgpt", d_model=s.d_model, n_heads=s.n_heads)),
        ("gpt_rec_parallel", dict(arch="gpt_rec", parallel=True, d_model=s.d_model, n_heads=s.n_heads)),
    ]


def build(cfg: dict[str, Any], s: ModelShape, vocab: int, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model({**cfg, "vocab_size": vocab, "block_size": s.block_size}).to(device)


def train_step(model, idx: torch.Tensor, device: str, precision: str) -> Callable[[], None]:
    """One training step without the optimizer: zero the gradients, loss, backward."""
    def step():
        model.zero_grad(set_to_none=True)
        with autocast(device, precision):
            _, loss = model(idx, targets=idx)
        loss.backward()
    return step


def infer_step(model, idx: torch.Tensor, device: str, precision: str) -> Callable[[], None]:
    def step():
        with torch.no_grad(), autocast(device, precision):
            model(idx)
    return step


def activation_memory(model, idx: torch.Tensor, device: str, precision: str) -> dict[str, float]:
    """``saved_mb``: MiB autograd saves for the backward in one training step (each storage once,
    parameters excluded); on CUDA also ``peak_mb``: the peak allocated during the step above the
    memory held before it."""
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {}

    def forward():
        with autocast(device, precision):
            out["loss"] = model(idx, targets=idx)[1]

    mem = {"saved_mb": saved_tensor_bytes(forward, exclude=list(model.parameters())) / 2**20}
    out["loss"].backward()
    del out["loss"]
    model.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        train_step(model, idx, device, precision)()
        sync(device)
        mem["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        model.zero_grad(set_to_none=True)
    return mem


def compile_model(model, idx, device: str, precision: str) -> tuple[Any, float | None, str | None]:
    """``torch.compile(model, fullgraph=True)``, its compile time (the first training step, s) and
    the error that stopped it (``None`` when it compiled)."""
    # every family compiles its own graphs; keep all of them (no reset, no recompile limit hit)
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 256))
    compiled = torch.compile(model, fullgraph=True)
    try:
        sync(device)
        t0 = time.perf_counter()
        train_step(compiled, idx, device, precision)()
        sync(device)
        return compiled, time.perf_counter() - t0, None
    except Exception as e:  # record the failure in the row, keep benchmarking the others
        return None, None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def profile_model(name: str, s: ModelShape, vocab: int, device: str, precision: str, compiled: bool) -> str:
    """torch.profiler table of one family's training step at shape ``s`` (3 steps after 2 warm-up
    steps; with ``compiled`` the ``torch.compile(fullgraph=True)`` model, compiled before the warm-up).

    Raises:
        ValueError: ``name`` matches no family or several.
    """
    rows = {n: cfg for n, _, cfg in family_rows(s)}
    key = find_name(name, list(rows))
    model = build(rows[key], s, vocab, device)
    idx = torch.randint(0, vocab, (s.batch_size, s.block_size), device=device)
    if compiled:
        model, _, error = compile_model(model, idx, device, precision)
        if error:
            raise RuntimeError(f"{key} did not compile: {error}")
    head = (f"profile of {key!r}{' (compiled)' if compiled else ''} at {s.as_dict()}, training step "
            f"(forward + backward), 3 steps, device {device}, {precision}")
    return profile_table(train_step(model, idx, device, precision), device, head)


def measure(s: ModelShape, *, vocab: int, repeats: int, device: str, precision: str, compile: bool,
            peak_n: int, checkpoint: bool = True, only: list[str] | None = None) -> dict[str, Any]:
    """Every row at shape ``s`` (only the families whose names contain a part in ``only``, and
    their baselines, when given): ``{"peak_flops", "peak_ms", "rows"}``."""
    idx = torch.randint(0, vocab, (s.batch_size, s.block_size), generator=torch.Generator().manual_seed(0))
    idx = idx.to(device)
    fams = select_families(family_rows(s), only)
    fns: dict[str, Callable] = {PEAK: matmul_step(peak_n, device, precision)}
    rows: list[dict[str, Any]] = []
    for name, baseline, cfg in fams:
        model = build(cfg, s, vocab, device)
        row: dict[str, Any] = {"name": name, "baseline": baseline, "config": cfg, "params": model.num_params(),
                               "flops_per_token": training_flops_per_token(model, s.block_size)}
        row.update(activation_memory(model, idx, device, precision))
        fns[name + "/train"] = train_step(model, idx, device, precision)
        fns[name + "/infer"] = infer_step(model, idx, device, precision)
        if compile:
            compiled, row["compile_s"], err = compile_model(model, idx, device, precision)
            if err:
                row["compile_error"] = err
            else:
                fns[name + "/compiled"] = train_step(compiled, idx, device, precision)
        rows.append(row)
    ck_rows = []
    if checkpoint:
        for fam, cfg in checkpoint_families(s):
            row = {"name": f"{fam} T=4 checkpointed vs T=1", "family": fam}
            for key, t, ck in (("t1", 1, False), ("t4", 4, False), ("t4_ckpt", 4, True)):
                model = build({**cfg, "n_steps": t}, s, vocab, device)
                if ck:
                    apply_activation_checkpointing(model)
                mem = activation_memory(model, idx, device, precision)
                row.update({f"{key}_{k}": v for k, v in mem.items()})
                if t == 4:
                    fns[f"{row['name']}/{key}"] = train_step(model, idx, device, precision)
            ck_rows.append(row)
    ms = interleaved_median_ms(fns, repeats, device, warmup=3 if compile else 2)
    peak = flops_per_s(matmul_flops(peak_n), ms[PEAK])
    tokens = s.batch_size * s.block_size
    by_name = {}
    for row in rows:
        name = row["name"]
        row["train_ms"], row["infer_ms"] = ms[name + "/train"], ms[name + "/infer"]
        row["train_tok_s"] = tokens / (row["train_ms"] / 1e3)
        row["mfu"] = mfu(row["flops_per_token"], row["train_tok_s"], peak)
        if name + "/compiled" in ms:
            row["compiled_ms"] = ms[name + "/compiled"]
            row["compiled_tok_s"] = tokens / (row["compiled_ms"] / 1e3)
            row["compiled_mfu"] = mfu(row["flops_per_token"], row["compiled_tok_s"], peak)
            row["compile_speedup"] = row["train_ms"] / row["compiled_ms"]
        by_name[name] = row
    for row in rows:
        base = by_name[row["baseline"]]
        row["train_ratio"] = row["train_ms"] / base["train_ms"]
        row["infer_ratio"] = row["infer_ms"] / base["infer_ms"]
        row["params_ratio"] = row["params"] / base["params"]
        row["flop_ratio"] = row["flops_per_token"] / base["flops_per_token"]
        row["cost_over_bound"] = row["train_ratio"] / row["flop_ratio"]
        row["goals"] = model_goals(row, s.d_model)
    for row in ck_rows:
        measure_key = "peak_mb" if "t1_peak_mb" in row else "saved_mb"
        row["memory"] = measure_key
        row["t4_over_t1"] = row[f"t4_{measure_key}"] / row[f"t1_{measure_key}"]
        row["t4_ckpt_over_t1"] = row[f"t4_ckpt_{measure_key}"] / row[f"t1_{measure_key}"]
        row["t4_ckpt_ms"], row["t4_ms"] = ms[f"{row['name']}/t4_ckpt"], ms[f"{row['name']}/t4"]
        row["recompute_time_ratio"] = row["t4_ckpt_ms"] / row["t4_ms"]
        row["goals"] = [goal("T=4 checkpointed / T=1 memory", row["t4_ckpt_over_t1"], "<=", CHECKPOINT_GOAL)]
    return {"peak_flops": peak, "peak_ms": ms[PEAK], "rows": rows + ck_rows}


def model_goals(row: dict[str, Any], d_model: int) -> list[dict[str, Any]]:
    """The MFU and compile goals of a family row (they apply at ``d_model >= 256``)."""
    if d_model < GOAL_MIN_D:
        return []
    best = max(row["mfu"], row.get("compiled_mfu", 0.0))
    goals = [goal("MFU" + (" (best of eager, compiled)" if "compiled_mfu" in row else ""), best, ">=", MFU_GOAL)]
    if "compile_speedup" in row:
        goals.append(goal("compiled speed-up", row["compile_speedup"], ">=", COMPILE_GOAL))
    elif "compile_error" in row:
        goals.append(goal("compiled speed-up (compile failed)", 0.0, ">=", COMPILE_GOAL))
    return goals


def format_tables(result: dict[str, Any]) -> str:
    fam = [r for r in result["rows"] if "baseline" in r]
    ck = [r for r in result["rows"] if "family" in r]
    compiled = any("compiled_ms" in r or "compile_error" in r for r in fam)
    head = ["model", "baseline", "params", "train ms", "tok/s", "time / base", "FLOPs / base", "cost / bound",
            "GFLOP/tok", "MFU", "infer / base", "act. MiB"] + (["compiled ms", "eager / compiled"] if compiled else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in fam:
        cells = [r["name"], r["baseline"], f"{r['params']:,}", f"{r['train_ms']:.1f}", f"{r['train_tok_s']:,.0f}",
                 f"{r['train_ratio']:.2f}", f"{r['flop_ratio']:.2f}", f"{r['cost_over_bound']:.2f}",
                 f"{r['flops_per_token'] / 1e9:.4f}", f"{r['mfu']:.1%}", f"{r['infer_ratio']:.2f}",
                 f"{r.get('peak_mb', r['saved_mb']):.1f}"]
        if compiled:
            cells += ([f"{r['compiled_ms']:.1f}", f"{r['compile_speedup']:.2f}"] if "compiled_ms" in r
                      else [r.get("compile_error", "-"), "-"])
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| checkpointing | memory | T=4 / T=1 | T=4 checkpointed / T=1 | time with / without |",
              "|---|---|---:|---:|---:|"]
    for r in ck:
        lines.append(f"| {r['family']} | {r['memory']} | {r['t4_over_t1']:.2f} | {r['t4_ckpt_over_t1']:.2f} | "
                     f"{r['recompute_time_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="d128", choices=sorted(MODEL_SHAPES), help="a registry shape")
    ap.add_argument("--d-model", type=int, default=None,
                    help="width instead of --shape (heads: head size 32 up to 256, 64 above; Llama d_ff default)")
    ap.add_argument("--n-heads", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=74)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--peak-n", type=int, default=None,
                    help="size of the square matmul that measures the peak (default 2048 on CPU, 8192 on CUDA)")
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                    help="auto: bf16 autocast on CUDA, fp32 elsewhere (the peak is measured the same way)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(model, fullgraph=True)")
    ap.add_argument("--rows", default=None, metavar="A,B",
                    help="only the families whose names contain one of these comma-separated parts (and baselines)")
    ap.add_argument("--no-checkpointing", action="store_true", help="skip the activation checkpointing rows")
    ap.add_argument("--quick", action="store_true", help="tiny shape (or --d-model at batch 2 x 32), 3 repeats")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed (each miss is printed)")
    ap.add_argument("--profile", metavar="ROW", default=None,
                    help="print the torch.profiler table of this family's training step (name or unique part of "
                         "it; the compiled model with --compile) and exit")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/bench_models-<shape>-<device>.json)")
    args = parse_args(ap, argv)
    if args.peak_n is None:
        args.peak_n = 256 if args.quick else 8192 if args.device.startswith("cuda") else 2048
    if args.quick:
        args.repeats = 3
    if args.d_model is not None:
        quick = dict(depth=2, block_size=32, batch_size=2) if args.quick else {}
        shape, tag = model_shape(args.d_model, n_heads=args.n_heads, **quick), f"d{args.d_model}"
    else:
        tag = "tiny" if args.quick else args.shape
        shape = MODEL_SHAPES[tag]
    shape = ModelShape(**{**shape.as_dict(), **{k: v for k, v in (("batch_size", args.batch_size),
                                                                 ("block_size", args.block_size)) if v}})
    precision = args.precision if args.precision != "auto" else ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.profile:
        print(profile_model(args.profile, shape, args.vocab_size, args.device, precision, args.compile))
        return 0
    result = measure(shape, vocab=args.vocab_size, repeats=args.repeats, device=args.device, precision=precision,
                     compile=args.compile, peak_n=args.peak_n, checkpoint=not args.no_checkpointing,
                     only=args.rows.split(",") if args.rows else None)
    print(f"shape {shape.as_dict()}, device {args.device}, {precision}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats}; matmul peak {result['peak_flops'] / 1e9:.1f} GFLOP/s ({args.peak_n}³)")
    print(format_tables(result))
    settings = {**vars(args), "shape": tag, "model_shape": shape.as_dict(), "precision": precision,
                "peak_flops": result["peak_flops"], "peak_ms": result["peak_ms"]}
    return finish("bench_models", args, settings, result["rows"], tag)


if __name__ == "__main__":
    sys.exit(run_main(main))
