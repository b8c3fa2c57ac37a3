"""The one prepared GPU check (issue 17): every section in at most 8 minutes on one H200, with
``results.json`` rewritten after each section (so a timeout keeps what was done) and a table.

Sections, in order, each with its share of ``--budget`` (a section also gets what the earlier
ones left unused; once its time is spent the remaining rows are skipped with a note):

1. ``env``: torch / CUDA / cuDNN versions, GPU name, and the measured bf16 (and TF32) square
   matmul rate; the bf16 rate is the peak every MFU below is measured against.
2. ``pytest``: ``pytest tests/test_cuda.py`` in a subprocess; its summary line and failures are
   recorded, its whole output is written beside the results file (``test_cuda.log``).
3. ``train``: one training step (forward + backward, no optimizer) of every family at the
   GPT-2-small shape (vocab 50304, batch 16 × 1024, d 768, 12 heads, 12 layers or steps) in fp32
   (TF32 matmuls, the CUDA default) and bf16 autocast: ms / step, tokens/s, peak memory, MFU
   from the measured FLOPs (``energyformer.models.flops``), and the SDPA kernels of a bf16 step
   read from the profiler's op names.
4. ``compile``: ``torch.compile(fullgraph=True)`` (inductor) of GPT, CEM and NRGPT in bf16:
   compile time (the first step) and speed-up over eager.
5. ``checkpointing``: NRGPT T = 12 with per-step activation checkpointing against without:
   memory ratio (peak allocated above the weights on CUDA, bytes autograd saves on the CPU) and
   the recompute cost.
6. ``generation``: KV-cached against uncached greedy generation (tokens/s, speed-up, same ids).

Goals (printed as met / missed): bf16 ≥ 1.5× fp32 for every family; MFU ≥ 40% for GPT and Llama
and ≥ 30% for every energy family (bf16); no math-kernel SDPA; compiled ≥ 1.0× eager; NRGPT
T = 12 with checkpointing ≤ 0.35× the memory; no failure in tests/test_cuda.py.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT/results.json     # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --tiny                       # CPU smoke (seconds)
    python benchmarks/gpu_check.py --vendor-deps .gpu_deps                   # see benchmarks/README.md

Needs only torch, numpy, pyyaml, safetensors, tqdm and pytest, plus the pure-Python packages
energyformer's run configs import (jsonargparse, typeshed_client, docstring_parser), which
``--vendor-deps`` copies from this environment into a folder that is put on the path when present.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEPS = ROOT / ".gpu_deps"
for _p in [str(DEPS)] * DEPS.is_dir() + [str(ROOT), str(ROOT / "benchmarks")]:
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from bench_models import build, family_rows, train_step  # noqa: E402
from common import (  # noqa: E402
    MODEL_SHAPES,
    ModelShape,
    autocast,
    environment,
    flops_per_s,
    goal,
    interleaved_median_ms,
    matmul_flops,
    matmul_step,
    mfu,
    run_main,
    saved_tensor_bytes,
    sdpa_kernels,
    sync,
)

from energyformer.models.config import default_d_ff  # noqa: E402
from energyformer.models.flops import training_flops_per_token  # noqa: E402

#: the pure-Python packages energyformer.runs / energyformer.train import that the GPU machine lacks
VENDORED = ("jsonargparse", "typeshed_client", "docstring_parser")
GPT2_SMALL = ModelShape(768, 12, 12, default_d_ff(768), 1024, 16)
GPT2_VOCAB, TINY_VOCAB = 50304, 96
#: seconds of the default 450 s budget per section (scaled with --budget)
SHARES = {"env": 20, "pytest": 120, "train": 150, "compile": 105, "checkpointing": 35, "generation": 20}
#: the same with --tiny (default budget 60 s): there the pytest subprocess (torch's import) dominates
TINY_SHARES = {"env": 3, "pytest": 20, "train": 15, "compile": 8, "checkpointing": 7, "generation": 7}
#: family rows in the order they are measured (the rest of bench_models.family_rows follows)
TRAIN_ORDER = ("gpt", "llama", "gpt_rec_parallel", "cem T=1", "cem diag_shared", "cem diag_per_head", "nrgpt ff2w",
               "nrgpt factored")
COMPILED = ("gpt", "cem T=1", "nrgpt ff2w")
GENERATED = ("gpt", "llama", "cem T=1", "nrgpt ff2w")
BF16_GOAL, COMPILE_GOAL, CHECKPOINT_GOAL = 1.5, 1.0, 0.35
MFU_GOALS = {"gpt": 0.40, "llama": 0.40}  # every energy family (cem*, nrgpt*): ENERGY_MFU_GOAL
ENERGY_MFU_GOAL = 0.30
COMPILE_MIN_S = 45.0  # a compile row starts only with this much of the section left (on CUDA)


@dataclass
class Ctx:
    """What every section reads: device, shape, vocabulary, repeats, and the peak ``env`` measured."""

    device: str
    tiny: bool
    shape: ModelShape
    vocab: int
    repeats: int
    warmup: int
    backend: str
    log_dir: Path
    peak: float | None = None
    goals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def precision(self) -> str:
        """bf16 autocast on CUDA (the project's default there), fp32 on the CPU."""
        return "bf16" if self.cuda else "fp32"

    def add_goal(self, section: str, row: str, name: str, value: float, op: str, target: float) -> dict:
        g = {"section": section, "row": row, **goal(name, value, op, target)}
        self.goals.append(g)
        return g


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------


def section_env(ctx: Ctx, deadline: float) -> dict[str, Any]:
    env = environment(ctx.device)
    env.update(cuda=torch.version.cuda, tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    if ctx.cuda:
        props = torch.cuda.get_device_properties(torch.device(ctx.device))
        env.update(cudnn=torch.backends.cudnn.version(), capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
        try:
            from energyformer.train.loop import peak_flops

            env["table_peak_flops"] = peak_flops(torch.device(ctx.device))
        except Exception as e:  # the table is informative only
            env["table_peak_flops"] = err_text(e)
    n = 256 if ctx.tiny else 8192
    fns = {p: matmul_step(n, ctx.device, p) for p in ("bf16", "fp32")}
    ms = interleaved_median_ms(fns, repeats=3 if ctx.tiny else 10, device=ctx.device, warmup=2)
    rates = {p: flops_per_s(matmul_flops(n), t) for p, t in ms.items()}
    ctx.peak = rates["bf16"]
    say(f"env: torch {env['torch']}, CUDA {env['cuda']}, {env.get('gpu', env['cpu'])}; matmul {n}³: "
        f"bf16 {rates['bf16'] / 1e12:.1f} TFLOP/s, fp32 (TF32 {env['tf32_matmul']}) {rates['fp32'] / 1e12:.1f} TFLOP/s")
    return {"env": env, "matmul_n": n, "matmul_ms": ms, "matmul_tflops": {p: r / 1e12 for p, r in rates.items()},
            "peak_flops": ctx.peak}


def section_pytest(ctx: Ctx, deadline: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-rfEs", "-p", "no:cacheprovider"]  # -q: addopts
    paths = [str(DEPS)] * DEPS.is_dir() + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
    timeout = max(5.0, deadline - time.monotonic())
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        rc, timed_out = None, True
    log = ctx.log_dir / "test_cuda.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(out)
    lines = [ln for ln in out.splitlines() if not ln.startswith("USDT:")]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "")
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0) + (rc is None)
    ctx.add_goal("pytest", "tests/test_cuda.py", "failed + errors (+1 when timed out)", bad, "<=", 0)
    say(f"pytest tests/test_cuda.py: {summary or '(no summary line)'}" + (" [timed out]" if timed_out else ""))
    for ln in failures:
        say("  " + ln)
    return {"command": " ".join(cmd[1:]), "rc": rc, "timed_out": timed_out, "summary": summary, "counts": counts,
            "failures": failures, "seconds": time.monotonic() - t0, "log": str(log), "tail": lines[-15:]}


def train_families(shape: ModelShape) -> list[tuple[str, dict[str, Any]]]:
    """``(name, model config)`` of every family of bench_models at ``shape``, TRAIN_ORDER first."""
    rows = {name: cfg for name, _, cfg in family_rows(shape)}
    order = [n for n in TRAIN_ORDER if n in rows] + [n for n in rows if n not in TRAIN_ORDER]
    return [(n, rows[n]) for n in order]


def peak_memory_mb(step: Callable[[], None], device: str) -> float | None:
    """Peak MiB allocated during one call of ``step`` (on CUDA; the call is also the row's first
    warm-up), ``None`` on the CPU (nothing is run)."""
    if not device.startswith("cuda"):
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def mfu_goal(name: str) -> float | None:
    """The MFU goal of a family: 40% for GPT and Llama, 30% for every energy family (CEM, NRGPT)."""
    if name in MFU_GOALS:
        return MFU_GOALS[name]
    return ENERGY_MFU_GOAL if name.startswith(("cem", "nrgpt")) else None


def train_row(ctx: Ctx, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One family's fp32 and bf16 training step at ``ctx.shape`` (see the module docstring)."""
    s = ctx.shape
    row: dict[str, Any] = {"name": name, "config": cfg}
    model = build(cfg, s, ctx.vocab, ctx.device)
    row.update(params=model.num_params(), flops_per_token=training_flops_per_token(model, s.block_size))
    idx = torch.randint(0, ctx.vocab, (s.batch_size, s.block_size), device=ctx.device)
    steps = {p: train_step(model, idx, ctx.device, p) for p in ("fp32", "bf16")}
    row["peak_mb"] = {p: peak_memory_mb(fn, ctx.device) for p, fn in steps.items()}
    row["sdpa_kernels"] = sdpa_kernels(steps["bf16"])
    ms = interleaved_median_ms(steps, ctx.repeats, ctx.device, warmup=ctx.warmup)
    tokens = s.batch_size * s.block_size
    for p, t in ms.items():
        row[f"{p}_ms"], row[f"{p}_tok_s"] = t, tokens / (t / 1e3)
        row[f"{p}_mfu"] = None if ctx.peak is None else mfu(row["flops_per_token"], row[f"{p}_tok_s"], ctx.peak)
    row["bf16_speedup"] = ms["fp32"] / ms["bf16"]
    del model, steps
    row["goals"] = [ctx.add_goal("train", name, "bf16 speed-up over fp32", row["bf16_speedup"], ">=", BF16_GOAL),
                    ctx.add_goal("train", name, "math-kernel SDPA calls (bf16)", row["sdpa_kernels"].get("math", 0),
                                 "<=", 0)]
    target = mfu_goal(name)
    if target is not None and row["bf16_mfu"] is not None:
        row["goals"].append(ctx.add_goal("train", name, "MFU (bf16)", row["bf16_mfu"], ">=", target))
    return row


def guarded_rows(ctx: Ctx, deadline: float, items: list[tuple[str, Any]], fn: Callable, min_left: float = 0.0
                 ) -> list[dict[str, Any]]:
    """``fn(ctx, name, item)`` for every item while the section has time left (at least
    ``min_left`` seconds, and as long as the previous row took, before a row starts), else a row
    saying it was skipped; an exception in a row (out of memory, a failed compile) is recorded in
    that row and the next one runs."""
    rows: list[dict[str, Any]] = []
    for name, item in items:
        last = rows[-1].get("seconds", 0.0) if rows else 0.0
        if time.monotonic() + max(min_left, last) > deadline:
            rows.append({"name": name, "skipped": "the section's time budget was spent"})
            say(f"  {name}: skipped (section budget spent)")
            continue
        t0 = time.monotonic()
        try:
            row = fn(ctx, name, item)
        except Exception as e:  # record it, keep measuring the others
            row = {"name": name, "error": err_text(e)}
        row["seconds"] = time.monotonic() - t0
        rows.append(row)
        say("  " + row_line(row))
        free(ctx.device)
    return rows


def row_line(r: dict[str, Any]) -> str:
    """One printed line of a row: its numbers, or its error."""
    if "error" in r or "skipped" in r:
        return f"{r['name']}: {r.get('error') or r.get('skipped')}"
    keys = [k for k in r if k.endswith(("_ms", "_s", "speedup", "ratio", "mfu", "same_tokens")) and k != "seconds"]
    parts = []
    for k in keys:
        v = r[k]
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    extra = f" kernels {r['sdpa_kernels']}" if "sdpa_kernels" in r else ""
    return f"{r['name']}: " + ", ".join(parts) + extra


def section_train(ctx: Ctx, deadline: float) -> dict[str, Any]:
    rows = guarded_rows(ctx, deadline, train_families(ctx.shape), train_row)
    return {"shape": ctx.shape.as_dict(), "vocab": ctx.vocab, "fp32": "TF32 matmuls" if ctx.cuda else "fp32",
            "rows": rows}


def compile_row(ctx: Ctx, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(model, fullgraph=True)`` of one family: compile time and speed-up."""
    torch._dynamo.reset()
    s = ctx.shape
    model = build(cfg, s, ctx.vocab, ctx.device)
    idx = torch.randint(0, ctx.vocab, (s.batch_size, s.block_size), device=ctx.device)
    compiled = torch.compile(model, fullgraph=True, backend=ctx.backend)
    compiled_step = train_step(compiled, idx, ctx.device, ctx.precision)
    sync(ctx.device)
    t0 = time.perf_counter()
    compiled_step()
    sync(ctx.device)
    row = {"name": name, "backend": ctx.backend, "precision": ctx.precision, "compile_s": time.perf_counter() - t0}
    ms = interleaved_median_ms({"eager": train_step(model, idx, ctx.device, ctx.precision), "compiled": compiled_step},
                               ctx.repeats, ctx.device, warmup=ctx.warmup)
    row.update(eager_ms=ms["eager"], compiled_ms=ms["compiled"], speedup=ms["eager"] / ms["compiled"])
    row["goals"] = [ctx.add_goal("compile", name, "compiled speed-up over eager", row["speedup"], ">=", COMPILE_GOAL)]
    return row


def section_compile(ctx: Ctx, deadline: float) -> dict[str, Any]:
    fams = dict(train_families(ctx.shape))
    items = [(n, fams[n]) for n in COMPILED]
    rows = guarded_rows(ctx, deadline, items, compile_row, min_left=COMPILE_MIN_S if ctx.cuda else 0.0)
    for r in rows:
        if "error" in r:  # a graph break or a failed compile misses the goal
            ctx.add_goal("compile", r["name"], f"compiled speed-up ({r['error'][:60]})", 0.0, ">=", COMPILE_GOAL)
    torch._dynamo.reset()
    return {"backend": ctx.backend, "precision": ctx.precision, "rows": rows}


def activation_mb(model, idx: torch.Tensor, ctx: Ctx) -> float:
    """Activation memory of one training step: on CUDA the peak allocated above what was held
    before it, on the CPU the bytes autograd saves (each storage once, parameters excluded)."""
    model.zero_grad(set_to_none=True)
    step = train_step(model, idx, ctx.device, ctx.precision)
    if not ctx.cuda:
        def forward():
            with autocast(ctx.device, ctx.precision):
                return model(idx, targets=idx)[1]
        return saved_tensor_bytes(forward, exclude=list(model.parameters())) / 2**20
    step()  # the gradients exist from here on, as in training
    sync(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    step()
    sync(ctx.device)
    return (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20


def checkpoint_row(ctx: Ctx, name: str, n_steps: int) -> dict[str, Any]:
    from energyformer.train.parallelize import apply_activation_checkpointing

    s = ctx.shape
    cfg = dict(arch="nrgpt", d_model=s.d_model, n_heads=s.n_heads, n_steps=n_steps)
    idx = torch.randint(0, ctx.vocab, (s.batch_size, s.block_size), device=ctx.device)
    row: dict[str, Any] = {"name": name, "n_steps": n_steps, "precision": ctx.precision,
                           "memory": "peak MiB above the weights and gradients" if ctx.cuda else "MiB autograd saves"}
    fns = {}
    for key, ck in (("plain", False), ("checkpointed", True)):
        model = build(cfg, s, ctx.vocab, ctx.device)
        if ck:
            apply_activation_checkpointing(model)
        row[f"{key}_mb"] = activation_mb(model, idx, ctx)
        fns[key] = train_step(model, idx, ctx.device, ctx.precision)
    ms = interleaved_median_ms(fns, ctx.repeats, ctx.device, warmup=0)
    row.update(plain_ms=ms["plain"], checkpointed_ms=ms["checkpointed"],
               memory_ratio=row["checkpointed_mb"] / row["plain_mb"], time_ratio=ms["checkpointed"] / ms["plain"])
    row["goals"] = [ctx.add_goal("checkpointing", name, "checkpointed / plain memory", row["memory_ratio"], "<=",
                                 CHECKPOINT_GOAL)]
    return row


def section_checkpointing(ctx: Ctx, deadline: float) -> dict[str, Any]:
    t = 4 if ctx.tiny else 12
    return {"rows": guarded_rows(ctx, deadline, [(f"nrgpt T={t}", t)], checkpoint_row)}


def generation_row(ctx: Ctx, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation of ``new`` tokens after a 16-token prompt, with and without the cache."""
    new = 8 if ctx.tiny else 128
    model = build(cfg, ctx.shape, ctx.vocab, ctx.device).eval()
    prompt = torch.randint(0, ctx.vocab, (1, 16), device=ctx.device)
    out, ms = {}, {}
    for key, cache in (("cached", True), ("uncached", False)):
        with autocast(ctx.device, ctx.precision):
            model.generate(prompt, 4, temperature=0.0, use_cache=cache)  # warm-up
            sync(ctx.device)
            t0 = time.perf_counter()
            out[key] = model.generate(prompt, new, temperature=0.0, use_cache=cache)
            sync(ctx.device)
        ms[key] = (time.perf_counter() - t0) * 1e3
    return {"name": name, "new_tokens": new, "precision": ctx.precision, "cached_ms": ms["cached"],
            "uncached_ms": ms["uncached"], "cached_tok_s": new / (ms["cached"] / 1e3),
            "speedup": ms["uncached"] / ms["cached"], "same_tokens": bool(torch.equal(out["cached"], out["uncached"]))}


def section_generation(ctx: Ctx, deadline: float) -> dict[str, Any]:
    fams = dict(train_families(ctx.shape))
    return {"rows": guarded_rows(ctx, deadline, [(n, fams[n]) for n in GENERATED], generation_row)}


SECTIONS: dict[str, Callable[[Ctx, float], dict[str, Any]]] = {
    "env": section_env, "pytest": section_pytest, "train": section_train, "compile": section_compile,
    "checkpointing": section_checkpointing, "generation": section_generation}


# ------------------------------------------------------------------------------------------------
# the run: budget, results file, table, goals
# ------------------------------------------------------------------------------------------------


def train_table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of the train section."""
    head = ["family", "params", "GFLOP/tok", "fp32 ms", "bf16 ms", "bf16 tok/s", "bf16 / fp32", "MFU bf16",
            "peak MiB bf16", "SDPA kernels (bf16)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['name']} | " + (r.get("error") or r["skipped"]) + " |" + " |" * (len(head) - 2))
            continue
        mfu_cell = "-" if r["bf16_mfu"] is None else f"{r['bf16_mfu']:.1%}"
        peak = r["peak_mb"]["bf16"]
        kernels = ", ".join(f"{k} ×{v}" for k, v in sorted(r["sdpa_kernels"].items())) or "none (no SDPA)"
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['flops_per_token'] / 1e9:.3f} | "
                     f"{r['fp32_ms']:.1f} | {r['bf16_ms']:.1f} | {r['bf16_tok_s']:,.0f} | {r['bf16_speedup']:.2f} | "
                     f"{mfu_cell} | {'-' if peak is None else f'{peak:,.0f}'} | {kernels} |")
    return lines


def report(results: dict[str, Any], goals: list[dict[str, Any]]) -> str:
    """The printed table: environment, pytest summary, the train table, and every other section's
    rows, then one line per goal (met / missed) and the count."""
    sec = results["sections"]
    env = sec.get("env", {})
    lines = ["", "## gpu_check", ""]
    if "env" in env:
        e = env["env"]
        lines.append(f"torch {e['torch']}, CUDA {e.get('cuda')}, cuDNN {e.get('cudnn')}, {e.get('gpu', e['cpu'])}; "
                     f"bf16 matmul {env['matmul_tflops']['bf16']:.1f} TFLOP/s, "
                     f"fp32 {env['matmul_tflops']['fp32']:.1f} TFLOP/s ({env['matmul_n']}³)")
    if "summary" in sec.get("pytest", {}):
        lines.append(f"pytest tests/test_cuda.py: {sec['pytest']['summary']}")
    if "rows" in sec.get("train", {}):
        lines += [""] + train_table(sec["train"]["rows"])
    for name in ("compile", "checkpointing", "generation"):
        for r in sec.get(name, {}).get("rows", []):
            lines.append(f"{name}: " + row_line(r))
    for name, s in sec.items():
        if "error" in s or "skipped" in s:
            lines.append(f"{name}: {s.get('error') or s.get('skipped')}")
    lines.append("")
    for g in goals:
        lines.append(f"goal {'met   ' if g['met'] else 'MISSED'} | {g['section']} | {g['row']} | {g['goal']} = "
                     f"{g['value']:.3f} (goal {g['op']} {g['target']:g})")
    lines.append(f"goals: {sum(g['met'] for g in goals)} of {len(goals)} met")
    return "\n".join(lines)


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Write the results atomically (a kill mid-write leaves the previous section's file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_sections(ctx: Ctx, names: list[str], budget: float, out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Every section of ``names`` in order, each until its cumulative share of ``budget`` is
    spent, rewriting ``out`` after each."""
    results: dict[str, Any] = {"script": "gpu_check", "settings": settings, "sections": {}, "goals": ctx.goals}
    shares = TINY_SHARES if ctx.tiny else SHARES
    scale = budget / sum(shares.values())
    start, allowed = time.monotonic(), 0.0
    for name in SECTIONS:
        allowed += shares[name] * scale
        if name not in names:
            results["sections"][name] = {"skipped": "not selected (--only / --skip)"}
            continue
        say(f"== {name} (until {allowed:.0f} s of the {budget:.0f} s budget)")
        t0 = time.monotonic()
        try:
            data = SECTIONS[name](ctx, start + allowed)
        except Exception as e:  # record it; the later sections still run
            traceback.print_exc()
            data = {"error": err_text(e)}
        data["seconds"] = time.monotonic() - t0
        results["sections"][name] = data
        results["elapsed_s"] = time.monotonic() - start
        write_json(out, results)
        free(ctx.device)
    return results


def vendor_deps(dest: Path) -> int:
    """Copy the pure-Python packages of VENDORED (and their dist-info) from this environment into
    ``dest``, which gpu_check.py and its pytest subprocess put on the path when it is ``.gpu_deps``."""
    import importlib

    dest.mkdir(parents=True, exist_ok=True)
    for name in VENDORED:
        src = Path(importlib.import_module(name).__file__).parent
        shutil.copytree(src, dest / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        for info in src.parent.glob(f"{name}-*.dist-info"):
            shutil.copytree(info, dest / info.name, dirs_exist_ok=True)
        say(f"copied {name} from {src}")
    say(f"wrote {dest}")
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, 1 repeat, the eager compile backend (seconds)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/gpu_check-<device>.json)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all sections (default 450; 60 with --tiny)")
    ap.add_argument("--only", default=None, metavar="A,B", help="only these sections: " + ", ".join(SECTIONS))
    ap.add_argument("--skip", default=None, metavar="A,B", help="skip these sections")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 3; 1 with --tiny)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager --tiny)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--vendor-deps", default=None, metavar="DIR",
                    help=f"copy {', '.join(VENDORED)} from this environment into DIR (e.g. .gpu_deps) and exit")
    return ap.parse_args(argv)


def selected(args: argparse.Namespace) -> list[str]:
    """The sections to run from ``--only`` and ``--skip``.

    Raises:
        ValueError: an unknown section name.
    """
    def names(text: str | None, default: list[str]) -> list[str]:
        if text is None:
            return default
        parts = [p.strip() for p in text.split(",") if p.strip()]
        for p in parts:
            if p not in SECTIONS:
                raise ValueError(f"section {p!r} is unknown; expected one of: {', '.join(SECTIONS)}")
        return parts

    chosen = names(args.only, list(SECTIONS))
    skipped = names(args.skip, [])
    return [n for n in chosen if n not in skipped]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vendor_deps:
        return vendor_deps(Path(args.vendor_deps))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: CUDA is not available here; expected --device cpu")
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be at least 1")
    if args.budget is not None and args.budget <= 0:
        raise ValueError(f"--budget {args.budget} must be a positive number of seconds")
    names = selected(args)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # the CUDA default of every command
    budget = args.budget or (60.0 if args.tiny else 450.0)
    ctx = Ctx(device=args.device, tiny=args.tiny, shape=MODEL_SHAPES["tiny"] if args.tiny else GPT2_SMALL,
              vocab=TINY_VOCAB if args.tiny else GPT2_VOCAB, repeats=args.repeats or (1 if args.tiny else 3),
              warmup=0 if args.tiny else 1,
              backend=args.compile_backend or ("eager" if args.tiny else "inductor"),
              log_dir=Path(args.out).parent if args.out else ROOT / "benchmarks" / "results")
    out = (Path(args.out) if args.out
           else ctx.log_dir / f"gpu_check-{args.device.replace(':', '')}{'-tiny' * args.tiny}.json")
    settings = {"device": args.device, "tiny": args.tiny, "budget_s": budget, "sections": names,
                "shape": ctx.shape.as_dict(), "vocab": ctx.vocab, "repeats": ctx.repeats,
                "compile_backend": ctx.backend,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results = run_sections(ctx, names, budget, out, settings)
    say(report(results, ctx.goals))
    say(f"wrote {out}")
    return 1 if args.check and not all(g["met"] for g in ctx.goals) else 0


if __name__ == "__main__":
    sys.exit(run_main(main))
