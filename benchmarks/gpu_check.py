"""The one prepared GPU check (issues 17, 30): every section inside a budget of 6 minutes on one
H200, ``results.json`` rewritten atomically after every row (a kill at any moment keeps every
finished row), and a table.

A preflight runs first and is written before anything is spent: torch / CUDA, the vendored
pure-Python packages (``.gpu_deps``), a C compiler and the Python headers (inductor needs both,
else the compile rows are skipped, not failed one by one), and the free GPU memory.

Sections, in the order of their value, each with a share of ``--budget`` (a section also gets
what the earlier ones left unused). Each row gets its share of what is left of its section
(weighted by its expected cost) and is stopped when that is spent: an in-process row by an alarm
(recorded as ``stopped``), a compile row by killing the subprocess it runs in.

1. ``env``: torch / CUDA / cuDNN versions, GPU name; the sustained bf16 (and TF32) square matmul
   rate timed with CUDA events after at least 1 s of warm-up (``common.matmul_peak``), and the
   data-sheet peak (``energyformer.train.metrics.PEAK_BF16_FLOPS``, 989 TFLOP/s for H100 / H200).
2. ``pytest``: ``pytest tests/train/test_cuda.py`` in a subprocess; met on a GPU only when every
   test *passed* (a skipped test counts against it); its output in ``test_cuda.log``.
3. ``train``: one training step (forward + backward, no optimizer) of every family at the
   GPT-2-small shape (vocab 50304, batch 16 × 1024, d 768, 12 heads, 12 layers or steps) in fp32
   (TF32 matmuls) and bf16 autocast: ms / step, tokens/s, peak memory, MFU against the timed peak
   and the data sheet (FLOPs from ``energyformer.models.flops``: causal attention charged for its
   ``N(N+1)/2`` pairs), the SDPA kernels of a bf16 step read from the profiler.
4. ``attention``: the wide-head energy attentions (NRGPT full J, keys d wide; CEM's diagonal
   options, heads d_h + d or d wide) forward + backward in bf16 on both paths (SDPA, materialized
   scores) and the path the default picks (``energyformer.energies.heads.attention_path``).
5. ``checkpointing``: NRGPT T = 12 with per-step activation checkpointing against without: the
   bytes autograd saves (the goal; the LM head's logits are the same in both), the CUDA peak above
   the weights (reported), and the recompute cost.
6. ``generation``: KV-cached against uncached greedy generation, warmed up at the timed lengths
   (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` is set before torch is imported, so cuDNN attention
   does not rebuild its graph for every new sequence length).
7. ``compile``: ``torch.compile(fullgraph=True)`` (inductor) in bf16, the most expensive model
   first (NRGPT, CEM, GPT), each in a subprocess: compile time and speed-up over eager.

Goals (met / missed): bf16 ≥ 1.5× fp32 for every family; MFU ≥ 40% for GPT and Llama and ≥ 30%
for every energy family (bf16, timed peak); no math- or memory-efficient-kernel SDPA call in a
wide-head attention's default path; compiled ≥ 1.0× eager; NRGPT T = 12 with checkpointing
≤ 0.35× the saved bytes; every test of tests/train/test_cuda.py passed.

    PYTHONPATH=. python benchmarks/gpu_check.py --out $OUT/results.json     # on the GPU machine, timeout 420 s
    python benchmarks/gpu_check.py --device cpu --tiny                       # CPU smoke (seconds)
    python benchmarks/gpu_check.py --vendor-deps .gpu_deps                   # see benchmarks/README.md

Needs only torch, numpy, pyyaml, safetensors, tqdm and pytest, plus the pure-Python packages
energyformer's run configs import (jsonargparse, typeshed_client, docstring_parser), which
``--vendor-deps`` copies from this environment into a folder that is put on the path when present.
``EF_GPU_CHECK_TEST_SLEEP=ROW:SECONDS`` (a test hook) makes the row called ROW sleep first.
"""
from __future__ import annotations

import os
import time

T0 = time.monotonic()  # the budget counts from here (torch's import included)
# cuDNN attention rebuilds its graph for every new sequence length unless told not to (generation
# would rebuild one per token); it must be set before torch is imported
os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPS = ROOT / ".gpu_deps"
for _p in [str(DEPS)] * DEPS.is_dir() + [str(ROOT), str(ROOT / "benchmarks")]:
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

try:  # a missing dependency is reported by the preflight (in results.json), not as a traceback
    from bench_models import build, family_rows, train_step
    from common import (
        MODEL_SHAPES,
        ModelShape,
        autocast,
        environment,
        goal,
        interleaved_median_ms,
        matmul_peak,
        mfu,
        run_main,
        saved_tensor_bytes,
        sdpa_kernels,
        sync,
    )

    from energyformer.energies import heads as _heads
    from energyformer.models.config import default_d_ff
    from energyformer.models.flops import training_flops_per_token
    GPT2_SMALL = ModelShape(768, 12, 12, default_d_ff(768), 1024, 16)
    IMPORT_ERROR: str | None = None
except ImportError as _e:  # pragma: no cover - the GPU machine without its vendored packages
    IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

#: the pure-Python packages energyformer.runs / energyformer.train import that the GPU machine lacks
VENDORED = ("jsonargparse", "typeshed_client", "docstring_parser")
CUDA_TESTS = "tests/train/test_cuda.py"
GPT2_VOCAB, TINY_VOCAB = 50304, 96
DEFAULT_BUDGET, TINY_BUDGET = 360.0, 60.0
#: seconds of the default 360 s budget per section, in the order they run (scaled with --budget)
SHARES = {"env": 12, "pytest": 70, "train": 110, "attention": 15, "checkpointing": 25, "generation": 23,
          "compile": 105}
#: the same with --tiny (default budget 60 s): there the subprocesses (torch's import) dominate
#: (env's share covers the imports before it, about 5 s on a loaded 2-core machine)
TINY_SHARES = {"env": 8, "pytest": 10, "train": 12, "attention": 4, "checkpointing": 4, "generation": 4,
               "compile": 18}
#: family rows in the order they are measured (the rest of bench_models.family_rows follows)
TRAIN_ORDER = ("gpt", "llama", "gpt_rec_parallel", "cem T=1", "cem diag_shared", "cem diag_per_head", "nrgpt ff2w",
               "nrgpt factored")
#: most expensive first: a budget cut loses the cheap rows
COMPILED = ("nrgpt ff2w", "cem T=1", "gpt")
GENERATED = ("gpt", "llama", "cem T=1", "nrgpt ff2w")
BF16_GOAL, COMPILE_GOAL, CHECKPOINT_GOAL = 1.5, 1.0, 0.35
MFU_GOALS = {"gpt": 0.40, "llama": 0.40}  # every energy family (cem*, nrgpt*): ENERGY_MFU_GOAL
ENERGY_MFU_GOAL = 0.30
MIN_FREE_GIB = 40.0  # the GPT-2-small rows' largest (NRGPT T = 12 in fp32) needs about this much
SLEEP_HOOK = "EF_GPU_CHECK_TEST_SLEEP"


def row_weight(name: str) -> float:
    """Expected cost of a row relative to GPT's (a row's share of its section's time): NRGPT's
    12 full-J steps and the compile of a 12-step graph cost most."""
    if name.startswith("nrgpt"):
        return 3.0
    if name.startswith(("cem", "gpt_rec")):
        return 1.5
    return 1.0


@dataclass
class Ctx:
    """What every section reads: device, shape, vocabulary, repeats, the peaks ``env`` measured,
    and the live results (saved after every row)."""

    device: str
    tiny: bool
    shape: ModelShape
    vocab: int
    repeats: int
    warmup: int
    backend: str
    log_dir: Path
    peak: float | None = None
    datasheet_peak: float | None = None
    goals: list[dict[str, Any]] = field(default_factory=list)
    out: Path | None = None
    results: dict[str, Any] = field(default_factory=dict)
    #: a row's share is never below this (while the section has it left): the first rows also pay
    #: one-time costs (profiler, kernel selection) and, ordered by value, matter most
    min_row_s: float = 0.0

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

    def section(self, name: str) -> dict[str, Any]:
        """The live record of section ``name`` in the results (created empty)."""
        return self.results.setdefault("sections", {}).setdefault(name, {})

    def save(self) -> None:
        """Write the results now (atomically); a no-op without ``out`` (row functions in tests)."""
        if self.out is not None:
            self.results["elapsed_s"] = time.monotonic() - T0
            write_json(self.out, self.results)


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def write_json(path: Path, results: dict[str, Any]) -> None:
    """Write the results atomically (a kill mid-write leaves the previous complete file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------
# row time limits
# ------------------------------------------------------------------------------------------------


class RowTimeout(Exception):
    """Raised in the main thread when a row's share of the budget is spent."""


@contextlib.contextmanager
def row_alarm(seconds: float):
    """Raise :class:`RowTimeout` in the body once ``seconds`` have passed (``SIGALRM``; Python code,
    ``time.sleep`` and anything that returns to the interpreter is interrupted; a CUDA call returns
    at its next sync). Where there is no ``SIGALRM`` the body runs unbounded."""
    if not hasattr(signal, "setitimer"):  # pragma: no cover - Windows
        yield
        return

    def ring(signum, frame):
        f = frame
        while f is not None:  # never inside an import: a half-imported module breaks every later row
            if f.f_code.co_filename.startswith("<frozen importlib"):
                signal.setitimer(signal.ITIMER_REAL, 0.05)
                return
            f = f.f_back
        raise RowTimeout(f"stopped at its share of the budget ({seconds:.1f} s)")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sleep_hook(name: str) -> None:
    """The test hook: ``EF_GPU_CHECK_TEST_SLEEP=ROW:SECONDS`` sleeps in row ROW (kill tests)."""
    hook = os.environ.get(SLEEP_HOOK, "")
    if ":" in hook:
        row, seconds = hook.rsplit(":", 1)
        if row == name:
            time.sleep(float(seconds))


def guarded_rows(ctx: Ctx, section: str, deadline: float, items: list[tuple[str, Any]], fn: Callable,
                 in_process: bool = True) -> list[dict[str, Any]]:
    """``fn(ctx, name, item)`` for every item, each within its share of what is left of the section
    (weighted by :func:`row_weight`, at least ``ctx.min_row_s`` while that is left); the results
    are saved before a row starts (its name under ``running``) and after it ends, so a kill keeps
    every finished row. A row that runs past its share is stopped (``in_process``: by
    :func:`row_alarm`) and recorded as ``stopped``; an exception (out of memory, a failed compile)
    is recorded in the row; the next row runs either way."""
    sec = ctx.section(section)
    rows: list[dict[str, Any]] = sec.setdefault("rows", [])
    for i, (name, item) in enumerate(items):
        left = deadline - time.monotonic()
        weights = [row_weight(n) for n, _ in items[i:]]
        limit = max(left * weights[0] / sum(weights), min(left, ctx.min_row_s))  # earlier rows matter more
        if limit < 0.05:
            rows.append({"name": name, "skipped": "the section's time budget was spent"})
            say(f"  {name}: skipped (section budget spent)")
            ctx.save()
            continue
        sec["running"] = {"name": name, "limit_s": round(limit, 1)}
        ctx.save()
        t0 = time.monotonic()
        try:
            if in_process:
                with row_alarm(limit):
                    sleep_hook(name)
                    row = fn(ctx, name, item)
            else:
                row = fn(ctx, name, item, limit)
        except RowTimeout as e:
            row = {"name": name, "stopped": str(e)}
        except Exception as e:  # record it, keep measuring the others
            row = {"name": name, "error": err_text(e)}
        row["seconds"] = time.monotonic() - t0
        rows.append(row)
        sec.pop("running", None)
        ctx.save()
        say("  " + row_line(row))
        free(ctx.device)
    return rows


def row_line(r: dict[str, Any]) -> str:
    """One printed line of a row: its numbers, or why it has none."""
    for key in ("error", "skipped", "stopped"):
        if key in r:
            return f"{r['name']}: {key}: {r[key]}"
    keys = [k for k in r if k.endswith(("_ms", "_s", "speedup", "ratio", "mfu", "same_tokens", "path"))
            and k != "seconds"]
    parts = []
    for k in keys:
        v = r[k]
        if isinstance(v, dict):
            continue
        parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    extra = f" kernels {r['sdpa_kernels']}" if "sdpa_kernels" in r else ""
    return f"{r['name']}: " + ", ".join(parts) + extra


# ------------------------------------------------------------------------------------------------
# preflight
# ------------------------------------------------------------------------------------------------


def preflight(device: str, backend: str, tiny: bool) -> dict[str, Any]:
    """What the run needs, checked before anything is spent: ``{"checks": {name: {"ok", "detail"}},
    "fatal", "skip": {section: reason}}``. Fatal (nothing runs): the benchmark modules do not import,
    or CUDA is asked for and absent. Skipped sections: ``pytest`` without the vendored packages,
    ``compile`` (inductor) without a C compiler or the Python headers."""
    checks: dict[str, dict[str, Any]] = {}
    skip: dict[str, str] = {}
    checks["imports"] = {"ok": IMPORT_ERROR is None, "detail": IMPORT_ERROR or "benchmarks and energyformer import"}
    checks["torch"] = {"ok": True, "detail": f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                             f"available {torch.cuda.is_available()}"}
    missing = [n for n in VENDORED if importlib.util.find_spec(n) is None]
    checks["vendored_deps"] = {"ok": not missing, "detail": (f"missing {', '.join(missing)}: run "
                                                             "--vendor-deps .gpu_deps here and carry it")
                               if missing else f"{', '.join(VENDORED)} importable"}
    if missing:
        skip["pytest"] = f"the vendored packages are missing ({', '.join(missing)})"
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    cc_path = shutil.which(cc) if cc else None
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    checks["c_compiler"] = {"ok": cc_path is not None, "detail": cc_path or "no cc, gcc or clang on PATH"}
    checks["python_headers"] = {"ok": header.is_file(), "detail": str(header)}
    if backend == "inductor" and not (cc_path and header.is_file()):
        skip["compile"] = "inductor needs a C compiler and the Python headers: " + (
            "no compiler" if not cc_path else f"no {header}")
    fatal = None if IMPORT_ERROR is None else f"cannot import the benchmark modules: {IMPORT_ERROR}"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            fatal = fatal or f"--device {device}: CUDA is not available"
        else:
            free_b, total_b = torch.cuda.mem_get_info(torch.device(device))
            need = 1.0 if tiny else MIN_FREE_GIB
            checks["gpu_memory"] = {"ok": free_b / 2**30 >= need,
                                    "detail": f"{free_b / 2**30:.1f} of {total_b / 2**30:.1f} GiB free "
                                              f"(the GPT-2-small rows need about {need:g})"}
    for name, c in checks.items():
        say(f"preflight {name}: {'ok' if c['ok'] else 'NOT OK'} ({c['detail']})")
    return {"checks": checks, "fatal": fatal, "skip": skip}


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------


def section_env(ctx: Ctx, deadline: float) -> dict[str, Any]:
    env = environment(ctx.device)
    env.update(cuda=torch.version.cuda, tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
               cudnn_sdpa_avoid_recompile=os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"))
    if ctx.cuda:
        props = torch.cuda.get_device_properties(torch.device(ctx.device))
        env.update(cudnn=torch.backends.cudnn.version(), capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
        try:
            from energyformer.train.metrics import peak_flops

            ctx.datasheet_peak = peak_flops(torch.device(ctx.device))
        except Exception as e:  # the table is informative only
            env["datasheet_peak_error"] = err_text(e)
    n = 256 if ctx.tiny else 8192
    warmup_s, iters = (0.05, 5) if ctx.tiny else (1.0, 50)
    peaks = {p: matmul_peak(n, ctx.device, p, warmup_s=warmup_s, iters=iters) for p in ("bf16", "fp32")}
    ctx.peak = peaks["bf16"]["flops_per_s"]
    tf = {p: r["flops_per_s"] / 1e12 for p, r in peaks.items()}
    sheet = "-" if ctx.datasheet_peak is None else f"{ctx.datasheet_peak / 1e12:.0f}"
    say(f"env: torch {env['torch']}, CUDA {env['cuda']}, {env.get('gpu', env['cpu'])}; matmul {n}³ "
        f"({iters} timed after {peaks['bf16']['warmup_s']:.1f} s warm-up): bf16 {tf['bf16']:.1f} TFLOP/s "
        f"(data sheet {sheet}), fp32 (TF32 {env['tf32_matmul']}) {tf['fp32']:.1f} TFLOP/s")
    return {"env": env, "matmul": peaks, "matmul_tflops": tf, "peak_flops": ctx.peak,
            "datasheet_peak_flops": ctx.datasheet_peak}


def pytest_counts(summary: str) -> dict[str, int]:
    """``{"passed": 3, "skipped": 1, ...}`` from pytest's last summary line."""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary)}
    if "errors" in counts:
        counts["error"] = counts.pop("errors") + counts.get("error", 0)
    return counts


def pytest_not_passed(counts: dict[str, int], timed_out: bool) -> int:
    """The CUDA tests that did not pass: failed, errors, skipped (a skip on a GPU means the check did
    not run), one more when pytest timed out, and one when nothing passed at all."""
    bad = sum(counts.get(k, 0) for k in ("failed", "error", "skipped", "xfailed", "xpassed"))
    return bad + int(timed_out) + int(counts.get("passed", 0) == 0)


def section_pytest(ctx: Ctx, deadline: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", CUDA_TESTS, "-rfEs", "-p", "no:cacheprovider"]  # -q: addopts
    paths = [str(DEPS)] * DEPS.is_dir() + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
    timeout = max(5.0, deadline - time.monotonic())
    t0 = time.monotonic()
    log = ctx.log_dir / "test_cuda.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        rc, timed_out = wait_or_kill(proc, timeout)
    out = log.read_text(errors="replace")
    lines = [ln for ln in out.splitlines() if not ln.startswith("USDT:")]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "")
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    counts = pytest_counts(summary)
    data = {"command": " ".join(cmd[1:]), "rc": rc, "timed_out": timed_out, "summary": summary, "counts": counts,
            "failures": failures, "seconds": time.monotonic() - t0, "log": str(log), "tail": lines[-15:]}
    if ctx.cuda:
        ctx.add_goal("pytest", CUDA_TESTS, "tests not passed (failed + errors + skipped, +1 timed out, +1 none passed)",
                     pytest_not_passed(counts, timed_out), "<=", 0)
    else:
        data["note"] = "no goal on the CPU: the CUDA tests skip there (EF_CUDA_TESTS_ON_CPU=1 dry-runs them)"
    say(f"pytest {CUDA_TESTS}: {summary or '(no summary line)'}" + (" [timed out]" if timed_out else ""))
    for ln in failures:
        say("  " + ln)
    return data


def wait_or_kill(proc: subprocess.Popen, timeout: float) -> tuple[int | None, bool]:
    """``(returncode, timed_out)``: wait up to ``timeout`` s, then kill the process group (started
    with ``start_new_session=True``) and wait for it."""
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, True


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
        row[f"{p}_mfu_datasheet"] = (None if ctx.datasheet_peak is None
                                     else mfu(row["flops_per_token"], row[f"{p}_tok_s"], ctx.datasheet_peak))
    row["bf16_speedup"] = ms["fp32"] / ms["bf16"]
    del model, steps
    row["goals"] = [ctx.add_goal("train", name, "bf16 speed-up over fp32", row["bf16_speedup"], ">=", BF16_GOAL),
                    ctx.add_goal("train", name, "math-kernel SDPA calls (bf16)", row["sdpa_kernels"].get("math", 0),
                                 "<=", 0)]
    target = mfu_goal(name)
    if target is not None and row["bf16_mfu"] is not None:
        row["goals"].append(ctx.add_goal("train", name, "MFU (bf16, timed peak)", row["bf16_mfu"], ">=", target))
    return row


def section_train(ctx: Ctx, deadline: float) -> dict[str, Any]:
    guarded_rows(ctx, "train", deadline, train_families(ctx.shape), train_row)
    return {"shape": ctx.shape.as_dict(), "vocab": ctx.vocab, "fp32": "TF32 matmuls" if ctx.cuda else "fp32",
            "flops": "energyformer.models.flops: causal attention charged for N(N+1)/2 pairs"}


# ---- attention: both paths of every wide-head energy attention --------------------------------


def attention_cases(d: int, n_heads: int) -> dict[str, dict[str, Any]]:
    """The wide-head energy attentions at width ``d``: each a ``make(g, h, gen)`` of the gradient
    function's arguments and the width its default path is chosen by."""
    from energyformer.energies import cem as C
    from energyformer.energies import nrgpt as E

    dh = d // n_heads
    tau = dh ** 0.5

    def nrgpt_full(g, h, gen, dev):
        J = (torch.randn(n_heads, d, d, generator=gen) * d ** -0.5).to(dev).requires_grad_(True)
        return lambda: E.attention_grad(g, J, torch.ones(n_heads, device=dev), 1.0 / dh ** 0.5, True), [J]

    def cem(diag_shape, fn, lowrank=True):
        def make(g, h, gen, dev):
            w = [(torch.randn(d, d, generator=gen) * d ** -0.5).to(dev).requires_grad_(True) for _ in range(2)]
            diag = (0.1 * torch.randn(*diag_shape, generator=gen)).to(dev).requires_grad_(True)
            if not lowrank:
                return lambda: fn(g, C.interaction_context(h, None, n_heads), diag, tau), [diag]
            return lambda: fn(g, C.interaction_context(h, w[1], n_heads), w[0], diag, n_heads, tau), [*w, diag]
        return make

    aug = dh + d + (-(dh + d) % 8)
    return {
        "nrgpt full J": {"make": nrgpt_full, "width": d},
        "cem diag_shared": {"make": cem((d,), C.diag_shared_grad), "width": aug},
        "cem diag_per_head": {"make": cem((n_heads, d), C.diag_per_head_grad), "width": aug},
        "cem diag_only": {"make": cem((n_heads, d), C.diag_only_grad, lowrank=False), "width": d},
    }


def attention_row(ctx: Ctx, name: str, case: dict[str, Any]) -> dict[str, Any]:
    """Forward + backward of one wide-head energy attention at the batch shape in the run's
    precision, on each path (forced), and the path the default takes here."""
    s = ctx.shape
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(s.batch_size, s.block_size, s.d_model, generator=gen).to(ctx.device).requires_grad_(True)
    h = torch.randn(s.batch_size, s.block_size, s.d_model, generator=gen).to(ctx.device)
    fn, params = case["make"](g, h, gen, ctx.device)
    default = _heads.attention_path(case["width"], ctx.device)
    if name == "cem diag_shared" and not ctx.cuda:
        default = "scores"  # the CPU's dense path (diag_shared_grad's rule)

    def step(path):
        def run():
            with _heads.force_attention_path(path), autocast(ctx.device, ctx.precision):
                out = fn()
            out.float().square().mean().backward()
        return run

    steps = {p: step(p) for p in _heads.ATTENTION_PATHS}
    outs = {}
    for p in steps:
        with _heads.force_attention_path(p), autocast(ctx.device, ctx.precision), torch.no_grad():
            outs[p] = fn().float()
    row: dict[str, Any] = {"name": name, "head_width": case["width"], "precision": ctx.precision,
                           "default_path": default,
                           "max_abs_diff": float((outs["sdpa"] - outs["scores"]).abs().max()),
                           "max_abs": float(outs["sdpa"].abs().max())}
    row["sdpa_kernels"] = sdpa_kernels(steps["sdpa"])
    default_kernels = sdpa_kernels(steps[default])
    ms = interleaved_median_ms(steps, ctx.repeats, ctx.device, warmup=ctx.warmup)
    row.update(sdpa_ms=ms["sdpa"], scores_ms=ms["scores"], scores_speedup=ms["sdpa"] / ms["scores"],
               default_kernels=default_kernels)
    slow = default_kernels.get("math", 0) + (default_kernels.get("efficient", 0) if ctx.cuda else 0)
    row["goals"] = [ctx.add_goal("attention", name, "math / memory-efficient SDPA calls on the default path", slow,
                                 "<=", 0)]
    del params
    return row


def section_attention(ctx: Ctx, deadline: float) -> dict[str, Any]:
    s = ctx.shape
    items = list(attention_cases(s.d_model, s.n_heads).items())
    guarded_rows(ctx, "attention", deadline, items, attention_row)
    return {"shape": {"batch": s.batch_size, "n": s.block_size, "d": s.d_model, "heads": s.n_heads},
            "fused_head_dim_max": _heads.FUSED_HEAD_DIM_MAX}


# ---- checkpointing: saved bytes -----------------------------------------------------------------


def saved_mb(model, idx: torch.Tensor, ctx: Ctx) -> float:
    """MiB autograd saves for the backward of one training step (each storage once, parameters
    excluded): what activation checkpointing trades for compute, on every device."""
    model.zero_grad(set_to_none=True)

    def forward():
        with autocast(ctx.device, ctx.precision):
            return model(idx, targets=idx)[1]

    return saved_tensor_bytes(forward, exclude=list(model.parameters())) / 2**20


def peak_above_mb(model, idx: torch.Tensor, ctx: Ctx) -> float | None:
    """On CUDA the peak allocated during a training step above what was held before it (weights,
    gradients: it includes the LM head's logits and cross-entropy transients, which checkpointing
    cannot touch); ``None`` elsewhere."""
    if not ctx.cuda:
        return None
    step = train_step(model, idx, ctx.device, ctx.precision)
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
                           "memory": "MiB autograd saves (goal); peak MiB above the weights on CUDA (reported)"}
    fns = {}
    for key, ck in (("plain", False), ("checkpointed", True)):
        model = build(cfg, s, ctx.vocab, ctx.device)
        if ck:
            apply_activation_checkpointing(model)
        row[f"{key}_saved_mb"] = saved_mb(model, idx, ctx)
        row[f"{key}_peak_mb"] = peak_above_mb(model, idx, ctx)
        fns[key] = train_step(model, idx, ctx.device, ctx.precision)
    ms = interleaved_median_ms(fns, ctx.repeats, ctx.device, warmup=0)
    row.update(plain_ms=ms["plain"], checkpointed_ms=ms["checkpointed"],
               saved_ratio=row["checkpointed_saved_mb"] / row["plain_saved_mb"],
               time_ratio=ms["checkpointed"] / ms["plain"])
    if ctx.cuda:
        row["peak_ratio"] = row["checkpointed_peak_mb"] / row["plain_peak_mb"]
    row["goals"] = [ctx.add_goal("checkpointing", name, "checkpointed / plain saved bytes", row["saved_ratio"], "<=",
                                 CHECKPOINT_GOAL)]
    return row


def section_checkpointing(ctx: Ctx, deadline: float) -> dict[str, Any]:
    t = 4 if ctx.tiny else 12
    guarded_rows(ctx, "checkpointing", deadline, [(f"nrgpt T={t}", t)], checkpoint_row)
    return {}


# ---- generation -----------------------------------------------------------------------------------


def generation_row(ctx: Ctx, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Greedy generation of ``new`` tokens after a 16-token prompt, with and without the cache;
    each warmed up by one untimed generation of the same length (every sequence length the timed
    run meets has been seen, so no kernel is built or autotuned inside the timing)."""
    new = 8 if ctx.tiny else 128
    model = build(cfg, ctx.shape, ctx.vocab, ctx.device).eval()
    prompt = torch.randint(0, ctx.vocab, (1, 16), device=ctx.device)
    out, ms, warm_ms = {}, {}, {}
    for key, cache in (("cached", True), ("uncached", False)):
        with autocast(ctx.device, ctx.precision):
            sync(ctx.device)
            t0 = time.perf_counter()
            model.generate(prompt, new, temperature=0.0, use_cache=cache)  # warm-up at the timed lengths
            sync(ctx.device)
            warm_ms[key] = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            out[key] = model.generate(prompt, new, temperature=0.0, use_cache=cache)
            sync(ctx.device)
        ms[key] = (time.perf_counter() - t0) * 1e3
    return {"name": name, "new_tokens": new, "precision": ctx.precision, "cached_ms": ms["cached"],
            "uncached_ms": ms["uncached"], "warmup_ms": warm_ms, "cached_tok_s": new / (ms["cached"] / 1e3),
            "speedup": ms["uncached"] / ms["cached"], "same_tokens": bool(torch.equal(out["cached"], out["uncached"]))}


def section_generation(ctx: Ctx, deadline: float) -> dict[str, Any]:
    fams = dict(train_families(ctx.shape))
    guarded_rows(ctx, "generation", deadline, [(n, fams[n]) for n in GENERATED], generation_row)
    return {"cudnn_sdpa_avoid_recompile": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE")}


# ---- compile (a subprocess per row) ------------------------------------------------------------------


def compile_row(ctx: Ctx, name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile(model, fullgraph=True)`` of one family: compile time and speed-up (in this
    process; :func:`compile_row_subprocess` runs it where it can be killed)."""
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


def compile_row_subprocess(ctx: Ctx, name: str, cfg: dict[str, Any], limit: float) -> dict[str, Any]:
    """:func:`compile_row` in a child process (``--compile-row NAME``), killed with its process
    group when ``limit`` seconds pass: inductor's compile cannot be interrupted in-process."""
    child_out = ctx.log_dir / f"compile-{re.sub(r'[^A-Za-z0-9]+', '_', name)}.json"
    child_out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-row", name, "--device", ctx.device,
           "--compile-backend", ctx.backend, "--repeats", str(ctx.repeats), "--out", str(child_out)]
    if ctx.tiny:
        cmd.append("--tiny")
    paths = [str(DEPS)] * DEPS.is_dir() + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    log = child_out.with_suffix(".log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        rc, timed_out = wait_or_kill(proc, limit)
    if timed_out:
        return {"name": name, "stopped": f"killed at its share of the budget ({limit:.1f} s)", "log": str(log)}
    if rc != 0 or not child_out.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        return {"name": name, "error": f"exit status {rc}: {tail[0][:250]}", "log": str(log)}
    row = json.loads(child_out.read_text())
    for g in row.get("goals", []):
        ctx.goals.append(g)
    return row


def section_compile(ctx: Ctx, deadline: float) -> dict[str, Any]:
    fams = dict(train_families(ctx.shape))
    rows = guarded_rows(ctx, "compile", deadline, [(n, fams[n]) for n in COMPILED], compile_row_subprocess,
                        in_process=False)
    for r in rows:
        if "error" in r:  # a graph break or a failed compile misses the goal
            ctx.add_goal("compile", r["name"], f"compiled speed-up ({r['error'][:60]})", 0.0, ">=", COMPILE_GOAL)
    return {"backend": ctx.backend, "precision": ctx.precision, "subprocess": True}


SECTIONS: dict[str, Callable[[Ctx, float], dict[str, Any]]] = {
    "env": section_env, "pytest": section_pytest, "train": section_train, "attention": section_attention,
    "checkpointing": section_checkpointing, "generation": section_generation, "compile": section_compile}


# ------------------------------------------------------------------------------------------------
# the run: budget, results file, table, goals
# ------------------------------------------------------------------------------------------------


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def train_table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of the train section."""
    head = ["family", "params", "GFLOP/tok", "fp32 ms", "bf16 ms", "bf16 tok/s", "bf16 / fp32", "MFU bf16 (timed)",
            "MFU bf16 (data sheet)", "peak MiB bf16", "SDPA kernels (bf16)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        why = r.get("error") or r.get("skipped") or r.get("stopped")
        if why:
            lines.append(f"| {r['name']} | " + why + " |" + " |" * (len(head) - 2))
            continue
        peak = r["peak_mb"]["bf16"]
        kernels = ", ".join(f"{k} ×{v}" for k, v in sorted(r["sdpa_kernels"].items())) or "none (no SDPA)"
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['flops_per_token'] / 1e9:.3f} | "
                     f"{r['fp32_ms']:.1f} | {r['bf16_ms']:.1f} | {r['bf16_tok_s']:,.0f} | {r['bf16_speedup']:.2f} | "
                     f"{_pct(r['bf16_mfu'])} | {_pct(r.get('bf16_mfu_datasheet'))} | "
                     f"{'-' if peak is None else f'{peak:,.0f}'} | {kernels} |")
    return lines


def report(results: dict[str, Any], goals: list[dict[str, Any]]) -> str:
    """The printed table: preflight, environment, pytest summary, the train table, and every other
    section's rows, then one line per goal (met / missed) and the count."""
    sec = results.get("sections", {})
    env = sec.get("env", {})
    lines = ["", "## gpu_check", ""]
    for name, c in results.get("preflight", {}).get("checks", {}).items():
        if not c["ok"]:
            lines.append(f"preflight {name}: NOT OK ({c['detail']})")
    if "env" in env:
        e = env["env"]
        sheet = env.get("datasheet_peak_flops")
        lines.append(f"torch {e['torch']}, CUDA {e.get('cuda')}, cuDNN {e.get('cudnn')}, {e.get('gpu', e['cpu'])}; "
                     f"bf16 matmul {env['matmul_tflops']['bf16']:.1f} TFLOP/s timed "
                     f"({'no data-sheet entry' if not sheet else f'data sheet {sheet / 1e12:.0f}'}), "
                     f"fp32 {env['matmul_tflops']['fp32']:.1f} TFLOP/s ({env['matmul']['bf16']['n']}³)")
    if "summary" in sec.get("pytest", {}):
        lines.append(f"pytest {CUDA_TESTS}: {sec['pytest']['summary']}")
    if "rows" in sec.get("train", {}):
        lines += [""] + train_table(sec["train"]["rows"])
    for name in ("attention", "checkpointing", "generation", "compile"):
        for r in sec.get(name, {}).get("rows", []):
            lines.append(f"{name}: " + row_line(r))
    for name, s in sec.items():
        for key in ("error", "skipped"):
            if key in s:
                lines.append(f"{name}: {key}: {s[key]}")
    lines.append("")
    for g in goals:
        lines.append(f"goal {'met   ' if g['met'] else 'MISSED'} | {g['section']} | {g['row']} | {g['goal']} = "
                     f"{g['value']:.3f} (goal {g['op']} {g['target']:g})")
    lines.append(f"goals: {sum(g['met'] for g in goals)} of {len(goals)} met")
    return "\n".join(lines)


def run_sections(ctx: Ctx, names: list[str], budget: float, skip: dict[str, str]) -> dict[str, Any]:
    """Every section of ``names`` in order, each until its cumulative share of ``budget`` (counted
    from the script's start) is spent; the results are saved after every row and every section."""
    shares = TINY_SHARES if ctx.tiny else SHARES
    scale = budget / sum(shares.values())
    allowed = 0.0
    for name in SECTIONS:
        allowed += shares[name] * scale
        if name not in names:
            ctx.section(name)["skipped"] = "not selected (--only / --skip)"
            continue
        if name in skip:
            ctx.section(name)["skipped"] = "preflight: " + skip[name]
            if name == "pytest" and ctx.cuda:
                ctx.add_goal("pytest", CUDA_TESTS, "tests not passed (preflight: not run)", 1, "<=", 0)
            ctx.save()
            continue
        deadline = T0 + allowed
        say(f"== {name} (until {allowed:.0f} s of the {budget:.0f} s budget; {deadline - time.monotonic():.0f} s left)")
        t0 = time.monotonic()
        try:
            data = SECTIONS[name](ctx, deadline)
        except Exception as e:  # record it; the later sections still run
            traceback.print_exc()
            data = {"error": err_text(e)}
        sec = ctx.section(name)
        sec.update(data)
        sec["seconds"] = time.monotonic() - t0
        ctx.save()
        free(ctx.device)
    return ctx.results


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
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for everything, from the script's start (default {DEFAULT_BUDGET:g}; "
                         f"{TINY_BUDGET:g} with --tiny)")
    ap.add_argument("--only", default=None, metavar="A,B", help="only these sections: " + ", ".join(SECTIONS))
    ap.add_argument("--skip", default=None, metavar="A,B", help="skip these sections")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row (default 3; 1 with --tiny)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; eager --tiny)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--vendor-deps", default=None, metavar="DIR",
                    help=f"copy {', '.join(VENDORED)} from this environment into DIR (e.g. .gpu_deps) and exit")
    ap.add_argument("--compile-row", default=None, metavar="NAME", help=argparse.SUPPRESS)  # the compile child
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


def make_ctx(args: argparse.Namespace) -> Ctx:
    return Ctx(device=args.device, tiny=args.tiny, shape=MODEL_SHAPES["tiny"] if args.tiny else GPT2_SMALL,
               vocab=TINY_VOCAB if args.tiny else GPT2_VOCAB, repeats=args.repeats or (1 if args.tiny else 3),
               warmup=0 if args.tiny else 1,
               backend=args.compile_backend or ("eager" if args.tiny else "inductor"),
               log_dir=Path(args.out).parent if args.out else ROOT / "benchmarks" / "results",
               min_row_s=2.0 if args.tiny else 15.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vendor_deps:
        return vendor_deps(Path(args.vendor_deps))
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be at least 1")
    if args.budget is not None and args.budget <= 0:
        raise ValueError(f"--budget {args.budget} must be a positive number of seconds")
    names = selected(args)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # the CUDA default of every command
    if args.compile_row:  # the child of compile_row_subprocess: one row, written to --out
        ctx = make_ctx(args)
        row = compile_row(ctx, args.compile_row, dict(train_families(ctx.shape))[args.compile_row])
        write_json(Path(args.out), row)
        return 0
    budget = args.budget or (TINY_BUDGET if args.tiny else DEFAULT_BUDGET)
    backend = args.compile_backend or ("eager" if args.tiny else "inductor")
    out = (Path(args.out) if args.out else ROOT / "benchmarks" / "results"
           / f"gpu_check-{args.device.replace(':', '')}{'-tiny' * args.tiny}.json")
    results: dict[str, Any] = {"script": "gpu_check", "settings": {
        "device": args.device, "tiny": args.tiny, "budget_s": budget, "sections": names, "compile_backend": backend,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "sections": {}}
    pre = preflight(args.device, backend, args.tiny)
    results["preflight"] = pre
    write_json(out, results)
    if pre["fatal"]:
        say(f"preflight: {pre['fatal']}; nothing run (wrote {out})")
        return 2
    ctx = make_ctx(args)
    ctx.out, ctx.results = out, results
    results["goals"] = ctx.goals
    results["settings"].update(shape=ctx.shape.as_dict(), vocab=ctx.vocab, repeats=ctx.repeats)
    run_sections(ctx, names, budget, pre["skip"])
    text = report(results, ctx.goals)
    results["table"] = text.splitlines()
    ctx.save()
    say(text)
    say(f"wrote {out}")
    return 1 if args.check and not all(g["met"] for g in ctx.goals) else 0


if __name__ == "__main__":
    if IMPORT_ERROR is not None:  # pragma: no cover - the preflight reports it in results.json
        sys.exit(main())
    sys.exit(run_main(main))
