"""Many processes: DDP (default) or FSDP2 under ``torchrun``, applied to a single-device model.

    torchrun --standalone --nproc_per_node=4 -m energyformer train RECIPE.yaml
    torchrun --standalone --nproc_per_node=4 -m energyformer train RECIPE.yaml --train.parallel fsdp

The model code stays single-device; :mod:`energyformer.train.parallelize` applies the parallelism
afterwards in one place (torchtitan's pattern): ``DistributedDataParallel`` (no
``find_unused_parameters``) or FSDP2's ``fully_shard`` on every layer (the elements of the
model's top-level ``ModuleList`` s), on the shared block of a recurrent model (``model.block``,
kept gathered across its ``n_steps`` applications) and on the root. This module holds the
process group and what a training step needs under it (gradient synchronisation, clipping,
the gathered state). The backend is NCCL when the processes use CUDA
devices, else gloo (CPU). Rank 0 logs, writes metrics and checkpoints; every rank draws its own
micro-batches from the shared seeded batch stream (``energyformer.data.BatchSampler``), so
``W`` ranks with ``A`` accumulation steps train on exactly the windows that one process with
``W·A`` accumulation steps trains on. Gradient accumulation skips the gradient
synchronisation on all but the last micro-batch (:func:`sync_gradients`).

A single process (no ``WORLD_SIZE`` in the environment, or ``WORLD_SIZE=1``) uses none of this.

A user error usually strikes every rank alike (a bad config value, missing data), and each rank
would print it: :func:`first_report` lets the first rank print a message and the others that
fail the same way stay quiet (a different message is printed too).
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn as nn

from energyformer.utils.device import local_cuda_device, resolve_device

PARALLEL_MODES = ("ddp", "fsdp")
_TIMEOUT = datetime.timedelta(minutes=10)
_REPORTS_FRESH_S = 600  # an older record of printed messages belongs to another job


@dataclass
class DistInfo:
    """Where this process stands: ``rank`` of ``world_size``, its ``device`` and ``parallel`` mode."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    parallel: str = "ddp"

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()

    def all_reduce(self, value: float, op: str = "sum") -> float:
        """``value`` summed (``"sum"``), averaged (``"mean"``) or maximized (``"max"``) over ranks."""
        if not self.enabled:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
        out = float(t.item())
        return out / self.world_size if op == "mean" else out

    def all_reduce_tensor(self, value: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Like :meth:`all_reduce` on a tensor (float64 on the collective's device), without a host read."""
        if not self.enabled:
            return value
        t = value.detach().to(torch.float64).to(self.device if self.device.type == "cuda" else "cpu").clone()
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX if op == "max" else tdist.ReduceOp.SUM)
        return t / self.world_size if op == "mean" else t

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed(device: str, parallel: str = "ddp") -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment, if any.

    Args:
        device: ``train.device``. Under torchrun ``"auto"``/``"cuda"`` mean the CUDA device of
            this rank (NCCL) when CUDA is available: ``cuda:LOCAL_RANK``, or ``cuda:(LOCAL_RANK mod
            visible devices)`` under a per-rank ``CUDA_VISIBLE_DEVICES`` (SLURM), see
            :func:`~energyformer.utils.device.local_cuda_device`; ``"auto"``/``"cpu"`` mean the CPU (gloo).
        parallel: ``"ddp"`` or ``"fsdp"``.

    Raises:
        ValueError: an explicit ``cuda:N`` under torchrun (each process takes ``cuda:LOCAL_RANK``),
            a device that is not available, or a ``WORLD_SIZE``/``RANK`` that is not an integer.
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ValueError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (as torchrun sets them); got "
                         f"{os.environ.get('WORLD_SIZE')!r}, {os.environ.get('RANK')!r}, "
                         f"{os.environ.get('LOCAL_RANK')!r}") from None
    if world <= 1:
        return DistInfo(device=resolve_device(device), parallel=parallel)
    if ":" in device:
        raise ValueError(f"train.device={device!r} under torchrun: each process uses cuda:LOCAL_RANK; "
                         "give train.device cuda, cpu or auto")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        dev = local_cuda_device(local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = resolve_device("cpu" if device == "auto" else device)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=_TIMEOUT,
                                 **({"device_id": dev} if dev.type == "cuda" else {}))
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev, parallel=parallel)


def shutdown(info: DistInfo, synchronize: bool = True) -> None:
    """Leave the process group (if this process joined one). With ``synchronize`` (a clean exit) every
    rank first waits at a barrier, so that no rank tears down its Gloo connections while another still
    has work in flight on them (that race aborted a rank: "terminate called without an active
    exception"); after an error pass ``False``: the other ranks may never arrive."""
    if info.enabled and tdist.is_initialized():
        if synchronize and info.world_size > 1:
            tdist.barrier()
        tdist.destroy_process_group()


@contextlib.contextmanager
def sync_gradients(wrapped: nn.Module, sync: bool) -> Iterator[None]:
    """Synchronise gradients in this backward only when ``sync`` (the last micro-batch of a step)."""
    if hasattr(wrapped, "no_sync") and not sync:  # DDP
        with wrapped.no_sync():
            yield
        return
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(sync)
    yield


def reduce_replicated_grads(model: nn.Module, info: DistInfo) -> None:
    """Average over ranks the gradients of parameters FSDP2 left replicated (after the last
    backward): all of them in one flat buffer, one all-reduce per step (not one per scalar)."""
    grads = [p.grad for p in getattr(model, "_replicated_params", ()) if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    flat.div_(info.world_size)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def clip_grad_norm(model: nn.Module, max_norm: float, info: DistInfo) -> torch.Tensor:
    """Clip the global gradient norm to ``max_norm`` (``inf``: no clipping); returns the norm
    before clipping as a 0-d tensor on the device (no host sync: the loop reads it at
    ``log_interval``).

    One process and DDP use ``torch.nn.utils.clip_grad_norm_`` (foreach). FSDP2: the norm of
    the sharded gradients (``torch.nn.utils.get_total_norm`` of the DTensors, completed by one
    all-reduce in ``full_tensor``) combined with that of the replicated ones (already averaged,
    counted once), then ``clip_grads_with_norm_``.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad for p in params if hasattr(p.grad, "to_local")]
    if not sharded:
        if not params:
            return torch.zeros((), device=info.device)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    plain = [p.grad for p in params if not hasattr(p.grad, "to_local")]
    total = torch.nn.utils.get_total_norm(sharded, foreach=True)
    total = total.full_tensor() if hasattr(total, "full_tensor") else total
    if plain:
        total = torch.linalg.vector_norm(torch.stack(
            [total.float(), torch.nn.utils.get_total_norm(plain, foreach=True).float().to(total.device)]))
    if math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_([p for p in params if hasattr(p.grad, "to_local")], max_norm, total,
                                             foreach=True)
        if plain:
            torch.nn.utils.clip_grads_with_norm_([p for p in params if not hasattr(p.grad, "to_local")], max_norm,
                                                 total.to(plain[0].device), foreach=True)
    return total


def full_model_state(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor] | None:
    """The full (gathered, CPU) model state dict under FSDP2 (every rank must call); else None."""
    if not (info.enabled and info.parallel == "fsdp"):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def all_finite(model: nn.Module, info: DistInfo) -> bool:
    """Whether every parameter (every shard on every rank) is finite (one host read)."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    ok = bool(torch.stack([f.to(info.device) for f in flags]).all()) if flags else True
    return info.all_reduce(0.0 if ok else 1.0, "max") == 0.0


def first_report(message: str) -> bool:
    """Whether this process should print ``message`` (an error or warning line).

    A single process: always. Under torchrun: only the first rank of the machine that reports
    this exact text; the job's ranks share a small file in the temporary folder (named by
    torchrun's run id, the launcher's pid and ``MASTER_PORT``; locked while read and written)
    listing the messages printed so far. Where that file cannot be used, every rank prints:
    an error is never hidden.
    """
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return True
        import fcntl
    except (ValueError, ImportError):  # a malformed WORLD_SIZE (named elsewhere); no flock (Windows)
        return True
    key = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_PORT")) + f"-{os.getppid()}"
    path = Path(tempfile.gettempdir()) / f"energyformer-reports-{key}.txt"
    try:
        with open(path, "a+", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            if time.time() - os.fstat(f.fileno()).st_mtime > _REPORTS_FRESH_S:
                f.truncate(0)
            f.seek(0)
            if message in f.read().split("\0"):
                return False
            f.write(message + "\0")
            f.flush()
    except OSError:
        return True
    return True
