"""``energyformer experiment NAME --jobs N``: N trainings at once, the CPU threads split between them.

These models are small, so one training does not use two cores well: two single-thread trainings
nearly double the throughput of one two-thread training. The results do not depend on it: a run's
numbers come from its seed, not from its timing, and each run records its own wall time.

The driver calls the experiment in *deferred* mode (:class:`~energyformer.experiments.common.Context`
``deferred``): every run it asks for that is not yet recorded is queued instead of trained, and the
experiment stops at its next :func:`~energyformer.experiments.common.need_runs` barrier (after its LR
sweeps, before its analysis). The queued runs train in a pool of N processes, each run recorded as
it finishes; then the experiment is called again, until it asks for nothing new and writes its table.

Ctrl-C reaches only the driver (the workers ignore SIGINT): it stops the workers and exits with one
line; the runs recorded so far stay recorded, and a run in progress resumes from its last checkpoint
when the command is run again.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from typing import Any

from energyformer.experiments.common import Context, PendingRuns, train_now


def threads_per_job(jobs: int, cores: int | None = None) -> int:
    """CPU threads for each of ``jobs`` trainings on ``cores`` cores (at least 1)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // jobs)


def _ignore_sigint() -> None:
    """A worker's initializer: Ctrl-C is the driver's to handle (no traceback from every worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while worker processes start (an ignored signal stays ignored across ``exec``, so a
    Ctrl-C while a worker is still importing cannot print its traceback); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _stop_workers() -> None:
    """Terminate the pool's worker processes (after Ctrl-C in the driver) and wait for them."""
    children = mp.active_children()
    for p in children:
        p.terminate()
    for p in children:
        p.join(timeout=10)


def _train_one(ctx_fields: dict[str, Any], run: str, cfg: dict[str, Any], threads: int) -> str:
    import torch

    torch.set_num_threads(threads)
    ctx = Context(**{k: v for k, v in ctx_fields.items() if k not in ("pending", "rescored", "said")})
    if cfg["train"].get("num_threads") is None:  # an experiment's own thread count (quick mode: 1) stands
        cfg = {**cfg, "train": {**cfg["train"], "num_threads": threads}}
    train_now(ctx, run, cfg)
    return run


def run_parallel(module: Any, ctx: Context) -> dict[str, Any]:
    """Run the experiment ``module`` (its ``run(ctx)``) with ``ctx.jobs`` trainings at once.

    Returns:
        what ``module.run(ctx)`` returns once every run it needs is recorded.

    Raises:
        whatever a training raises (other than divergence, which is recorded), after the runs
        already started have finished.
    """
    threads = ctx.threads or threads_per_job(ctx.jobs)
    while True:
        ctx.deferred, ctx.pending, ctx.waiting_for_sweep = True, {}, False
        try:
            result = module.run(ctx)
        except PendingRuns:
            result = None
        except Exception:  # an analysis that read a queued run before its barrier: train what is queued
            if not ctx.pending:
                raise
            result = None
        if not ctx.pending:
            if result is not None:
                ctx.deferred = False
                return result
            raise RuntimeError(f"experiment {ctx.name} stopped for runs to train but queued none")
        queued = dict(ctx.pending)
        ctx.say(f"training {len(queued)} run(s), {ctx.jobs} at a time with {threads} thread(s) each: "
                + ", ".join(queued))
        fields = {**asdict(ctx), "deferred": False, "jobs": 1}
        pool = ProcessPoolExecutor(max_workers=min(ctx.jobs, len(queued)), mp_context=mp.get_context("spawn"),
                                   initializer=_ignore_sigint)
        try:
            with _sigint_ignored():  # the workers start with SIGINT ignored, before their initializer runs
                futures = [pool.submit(_train_one, fields, run, cfg, threads) for run, cfg in queued.items()]
            errors = []
            for f in as_completed(futures):
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - the others finish and are recorded first
                    errors.append(e)
        except KeyboardInterrupt:
            _stop_workers()
            # wait for the pool's manager thread (it ends once it sees the workers gone): left running,
            # it can close its wake-up pipe while the interpreter's exit hook writes to it, a
            # "Bad file descriptor" traceback after the one line (seen once under a loaded CI)
            pool.shutdown(wait=True, cancel_futures=True)
            raise  # the CLI prints the one line "interrupted"
        pool.shutdown(wait=True)
        if errors:
            raise errors[0]


__all__ = ["run_parallel", "threads_per_job"]
