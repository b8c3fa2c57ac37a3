"""What every benchmark script shares: the shape registry, the interleaved timer, the matmul peak
and MFU, the saved-tensor byte counter, goals and ``--check``, and the JSON results file.

Only ratios measured in one run mean anything on a shared machine: every script times all its
rows in turn (:func:`interleaved_median_ms`), so a load spike hits every row alike, and reports
each row against a peer timed in the same loop.
"""
from __future__ import annotations

import argparse
import json
import operator
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# ----------------------------------------------------------------------------------------------
# Shape registry
# ----------------------------------------------------------------------------------------------

#: layer shapes ``(d_model, n_heads, N, B)`` of bench_layers.py (the issue's three CPU shapes, the
#: GPU shape, and a tiny one for --quick and the tests)
LAYER_SHAPES: dict[str, list[tuple[int, int, int, int]]] = {
    "cpu": [(128, 4, 128, 32), (256, 8, 256, 4), (512, 8, 256, 4), (768, 12, 512, 2)],
    "gpu": [(768, 12, 1024, 16)],
    "tiny": [(64, 4, 32, 2)],
}


@dataclass(frozen=True)
class ModelShape:
    """One model-level shape: width, heads, depth (layers, or recurrent steps), the MLP width of
    the Llama-style models (``d_ff``; GPT-style models use ``4·d_model``), context and batch."""

    d_model: int
    n_heads: int
    depth: int
    d_ff: int
    block_size: int
    batch_size: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def heads_for(d_model: int) -> int:
    """Heads the registry uses at a width: head size 32 up to d = 256 (as the d = 128 recipes
    and the first CPU layer shape), 64 above (the other layer shapes and the GPU shape)."""
    if d_model < 1:
        raise ValueError(f"d_model={d_model} must be a positive integer")
    size = 32 if d_model <= 256 else 64
    if d_model % size:
        raise ValueError(f"d_model={d_model} must be a multiple of the head size {size} "
                         "(or pass --n-heads explicitly)")
    return d_model // size


def model_shape(d_model: int = 128, *, n_heads: int | None = None, depth: int = 4, block_size: int = 128,
                batch_size: int = 32) -> ModelShape:
    """The model rows' shape at a width (d_ff from ``default_d_ff``, heads from :func:`heads_for`)."""
    from energyformer.models.config import default_d_ff

    h = n_heads if n_heads is not None else heads_for(d_model)
    if d_model % h:
        raise ValueError(f"n_heads={h} must divide d_model={d_model}")
    return ModelShape(d_model, h, depth, default_d_ff(d_model), block_size, batch_size)


#: model shapes of bench_models.py / bench_generate.py: the Shakespeare recipe width (d 128, 4
#: heads, 4 layers or steps, batch 32 × 128), the GPU shape (batch 16 × 1024, d 768, 12 heads)
#: and a tiny one for --quick and the tests
MODEL_SHAPES: dict[str, ModelShape] = {
    "d128": model_shape(128),
    "gpu": model_shape(768, n_heads=12, block_size=1024, batch_size=16),
    "tiny": model_shape(32, n_heads=4, depth=2, block_size=32, batch_size=2),
}

# ----------------------------------------------------------------------------------------------
# Timing, peak, MFU, memory
# ----------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def interleaved_median_ms(fns: dict[str, Callable[[], Any]], repeats: int, device: str,
                          warmup: int = 2) -> dict[str, float]:
    """Median wall-clock milliseconds of every callable, timed in turn ``repeats`` times (after
    ``warmup`` untimed calls each) so that machine load hits all of them alike.

    Raises:
        ValueError: ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_flops(n: int) -> int:
    """FLOPs of one ``(n × n) @ (n × n)`` product: ``2·n³`` (a multiply and an add per term)."""
    return 2 * n ** 3


def flops_per_s(flops: float, ms: float) -> float:
    """FLOP/s of ``flops`` done in ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"ms={ms} must be positive")
    return flops / (ms / 1e3)


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOP utilization: achieved ``flops_per_token · tokens_per_s`` over the peak."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak_flops_per_s={peak_flops_per_s} must be positive")
    return flops_per_token * tokens_per_s / peak_flops_per_s


def matmul_step(n: int, device: str, precision: str = "fp32") -> Callable[[], torch.Tensor]:
    """A callable doing one square ``n³`` product in the precision the models run in (fp32, or
    bf16 as autocast runs a matmul: bf16 operands, made once so no cast is timed), to be timed
    with the model rows: its FLOP/s is the run's matmul peak."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def step() -> torch.Tensor:
        with autocast(device, precision):
            return torch.mm(a, b)

    return step


def matmul_peak(n: int, device: str, precision: str = "bf16", *, warmup_s: float = 1.0,
                iters: int = 50) -> dict[str, float]:
    """The sustained square-matmul rate, the peak an MFU is measured against: ``{"n", "ms",
    "flops_per_s", "iters", "warmup_s"}``, ``ms`` per ``n³`` product.

    Products are issued back to back for at least ``warmup_s`` seconds (clocks and cuBLAS
    heuristics settle), then ``iters`` more are timed as one stream: with CUDA events on a GPU
    (no host sync between products), with the wall clock elsewhere.

    Raises:
        ValueError: ``iters < 1`` or ``warmup_s < 0``.
    """
    if iters < 1 or warmup_s < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup_s={warmup_s} >= 0")
    step = matmul_step(n, device, precision)
    cuda = str(device).startswith("cuda")
    t0 = time.perf_counter()
    warm = 0
    while True:
        for _ in range(10):
            step()
        warm += 10
        sync(device)
        if time.perf_counter() - t0 >= warmup_s:
            break
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
    else:
        t1 = time.perf_counter()
        for _ in range(iters):
            step()
        ms = (time.perf_counter() - t1) * 1e3 / iters
    return {"n": n, "ms": ms, "flops_per_s": flops_per_s(matmul_flops(n), ms), "iters": iters,
            "warmup_s": time.perf_counter() - t0 - ms * iters / 1e3, "warmup_iters": warm}


def autocast(device: str, precision: str):
    """``torch.autocast`` to bf16 for ``precision == "bf16"``, else a no-op context.

    Raises:
        ValueError: ``precision`` not ``"fp32"`` or ``"bf16"``.
    """
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={precision!r} must be 'fp32' or 'bf16'")
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                          enabled=precision == "bf16")


def saved_tensor_bytes(fn: Callable[[], Any], exclude: Any = ()) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn()`` runs, each storage
    counted once (views and repeated saves share it); storages of the tensors in ``exclude``
    (e.g. the model's parameters) are left out. This is the activation memory of a training
    step that activation checkpointing trades for compute."""
    def key(t: torch.Tensor) -> tuple:
        s = t.untyped_storage()
        return (s.device.type, s.device.index, s.data_ptr())

    skip = {key(t) for t in exclude}
    seen: set = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = key(t)
        if k not in seen and k not in skip:
            seen.add(k)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


#: the SDPA backend of each ``aten`` op name the profiler records (forward and backward ops alike);
#: an op is matched by the first fragment its name contains
SDPA_KERNELS: tuple[tuple[str, str], ...] = (
    ("flash_attention_for_cpu", "flash_cpu"),
    ("flash_attention", "flash"),
    ("cudnn_attention", "cudnn"),
    ("efficient_attention", "efficient"),
    ("attention_math", "math"),
    ("fused_attention_overrideable", "overrideable"),
)


def sdpa_kernel_of(op_name: str) -> str | None:
    """The SDPA backend an ``aten`` op name belongs to (``"flash"``, ``"cudnn"``, ``"efficient"``,
    ``"math"``, ``"flash_cpu"``, ``"overrideable"``), or ``None`` for any other op."""
    if "scaled_dot_product" not in op_name and "_attention_" not in op_name:
        return None
    for fragment, kernel in SDPA_KERNELS:
        if fragment in op_name:
            return kernel
    return None


def sdpa_kernels(fn: Callable[[], Any]) -> dict[str, int]:
    """Which SDPA kernels ``fn()`` really runs, read from the op names torch.profiler records on
    the host (CPU activity only: the ``aten`` ops of CUDA kernels are dispatched there too):
    ``{kernel: number of op calls}``, forward and backward ops together; ``{}`` when ``fn`` calls
    no SDPA (e.g. a materialized attention)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for evt in prof.key_averages():
        kernel = sdpa_kernel_of(evt.key)
        if kernel is not None:
            counts[kernel] = counts.get(kernel, 0) + evt.count
    return counts


# ----------------------------------------------------------------------------------------------
# Goals, --check, results
# ----------------------------------------------------------------------------------------------

_OPS = {"<=": operator.le, ">=": operator.ge}


def run_main(main: Callable[[], int]) -> int:
    """Run a script's ``main``; a bad argument or input (``ValueError``, ``FileNotFoundError``) is
    one ``error:`` line on stderr and exit status 2 instead of a traceback. TF32 matmuls are on
    where CUDA is (``energyformer.utils.device.configure_backends``, as every command)."""
    from energyformer.utils.device import configure_backends

    try:
        configure_backends()
        return main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``ap.parse_args(argv)``, then ``torch.set_num_threads(args.threads)`` where ``--threads`` is given."""
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def find_name(name: str, names: list[str], option: str = "--profile") -> str:
    """The entry called ``name``, or the one entry whose name contains it (case-insensitive).

    Raises:
        ValueError: no entry, or several, match ``name`` (the message lists them).
    """
    if name in names:
        return name
    hits = [k for k in names if name.lower() in k.lower()]
    if len(hits) == 1:
        return hits[0]
    what = "matches several rows" if hits else "matches no row"
    raise ValueError(f"{option} {name!r} {what}; expected one of: " + "; ".join(hits or names))


def profile_table(step: Callable[[], Any], device: str, head: str, steps: int = 3, row_limit: int = 25) -> str:
    """``head`` and the torch.profiler table of ``steps`` calls of ``step`` (after two warm-up
    calls): the top ops by self CPU time (self device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    step(), step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    sort = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    return head + "\n" + prof.key_averages().table(sort_by=sort, row_limit=row_limit)


def goal(name: str, value: float, op: str, target: float) -> dict[str, Any]:
    """One goal of a row: ``value op target`` with ``met`` evaluated (``op`` is ``<=`` or ``>=``).

    Raises:
        ValueError: an unknown ``op``.
    """
    if op not in _OPS:
        raise ValueError(f"op={op!r} must be one of {sorted(_OPS)}")
    return {"goal": name, "value": float(value), "op": op, "target": float(target),
            "met": bool(_OPS[op](value, target))}


def missed_goals(rows: list[dict[str, Any]]) -> list[str]:
    """A line per missed goal of every row: the row, the goal and the numbers."""
    out = []
    for r in rows:
        for g in r.get("goals", []):
            if not g["met"]:
                out.append(f"{row_label(r)}: {g['goal']} = {g['value']:.3f}, goal {g['op']} {g['target']:g}")
    return out


def row_label(r: dict[str, Any]) -> str:
    shape = f"{tuple(r['shape'])} " if "shape" in r else ""
    name = r.get("row") or r.get("name") or r.get("family") or "?"
    extra = f" @ {r['new_tokens']} tokens" if "new_tokens" in r else ""
    return f"{shape}{name}{extra}"


def check_exit(rows: list[dict[str, Any]], check: bool) -> int:
    """``--check``: print every missed goal with its numbers to stderr and return 1 if any was
    missed, else 0 (also 0 without ``check``, after printing a one-line summary)."""
    missed = missed_goals(rows)
    n_goals = sum(len(r.get("goals", [])) for r in rows)
    print(f"goals: {n_goals - len(missed)} of {n_goals} met")
    if missed and check:
        print(f"--check: {len(missed)} goal(s) missed:", file=sys.stderr)
        for line in missed:
            print("  " + line, file=sys.stderr)
        return 1
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(device: str) -> dict[str, Any]:
    """torch and Python versions, machine, CPU or GPU name, threads and device of this run."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "platform": platform.platform(), "cpu": _cpu_name(), "threads": torch.get_num_threads(),
           "device": device}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def default_out(script: str, device: str, tag: str = "") -> Path:
    """``benchmarks/results/<script>[-<tag>]-<device>.json``."""
    parts = [script] + ([tag] if tag else []) + [str(device).replace(":", "")]
    return RESULTS / ("-".join(parts) + ".json")


def write_results(path: str | Path, device: str, settings: dict[str, Any], rows: list[dict[str, Any]],
                  script: str | None = None) -> Path:
    """Write ``{"script", "env", "settings", "rows"}`` as JSON to ``path`` (parents created) and say
    where. ``script`` (the benchmark's name, what report.py picks the table layout by) defaults to
    the file name up to its first ``-``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    script = script or path.stem.split("-")[0]
    data = {"script": script, "env": environment(device), "settings": settings, "rows": rows}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def finish(script: str, args: argparse.Namespace, settings: dict[str, Any], rows: list[dict[str, Any]],
           tag: str = "") -> int:
    """The end of every benchmark's ``main``: write the results to ``args.out`` (default
    :func:`default_out`) and return :func:`check_exit`'s status for ``args.check``."""
    write_results(args.out or default_out(script, args.device, tag), args.device, settings, rows, script=script)
    return check_exit(rows, args.check)
