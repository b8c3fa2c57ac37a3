"""Device names → ``torch.device``, checked against what this machine has; the process-wide GPU
settings every command that runs a model applies (docs/gpu.md).

- :func:`resolve_device`: ``"auto"`` / ``"cpu"`` / ``"cuda[:N]"`` / ``"mps"`` → a device that exists.
- :func:`local_cuda_device`: the CUDA device of a torchrun process (``LOCAL_RANK`` modulo the
  visible devices, so a per-rank ``CUDA_VISIBLE_DEVICES`` as SLURM sets it works).
- :func:`resolve_dtype`: ``train.dtype`` ``"auto"`` → bfloat16 on CUDA, float32 elsewhere.
- :func:`configure_backends`: TF32 matmuls and convolutions on CUDA (or, with
  ``deterministic=True``, deterministic kernels); one function, called by ``train``, ``sample``,
  ``eval``, ``inspect``, ``export`` and the benchmarks.
- :func:`autocast_context`: the bf16 autocast (fp32 master weights) of a dtype, or a no-op.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from energyformer.utils.malloc import keep_freed_memory

__all__ = ["resolve_device", "local_cuda_device", "resolve_dtype", "configure_backends", "autocast_context",
           "DTYPE_CHOICES", "CUBLAS_WORKSPACE"]

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA docs)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA if available, else CPU; checks that an explicit CUDA/MPS device exists.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``.

    Raises:
        ValueError: not a device name, or the requested accelerator is not available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; expected 'auto', 'cpu', 'cuda', 'cuda:N' "
                         "or 'mps'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available; use device 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but MPS is not available; use device 'cpu'")
    return dev


def local_cuda_device(local_rank: int) -> torch.device:
    """The CUDA device of the process with ``local_rank`` on its machine.

    ``cuda:LOCAL_RANK`` when every rank sees all of the machine's GPUs (torchrun's default);
    under a per-rank ``CUDA_VISIBLE_DEVICES`` (SLURM's ``--gpus-per-task``) a rank sees fewer
    devices than ``LOCAL_RANK + 1``, and takes ``cuda:(LOCAL_RANK mod count)`` (``cuda:0`` with
    one visible device).

    Raises:
        ValueError: no CUDA device is visible.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        raise ValueError(f"LOCAL_RANK={local_rank} asks for a CUDA device but none is visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use "
                         "train.device cpu")
    return torch.device("cuda", local_rank % count)


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``"auto"`` → ``"bfloat16"`` on CUDA, ``"float32"`` elsewhere; an explicit dtype stays.

    Raises:
        ValueError: not one of :data:`DTYPE_CHOICES`.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} is not valid; expected one of {', '.join(map(repr, DTYPE_CHOICES))}")
    if dtype == "auto":
        return "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return dtype


def configure_backends(device: torch.device | str | None = None, *, deterministic: bool | None = None) -> None:
    """The process-wide matmul settings of every command that runs a model.

    On CUDA (or ``device=None`` with CUDA available): TF32 for fp32 matmuls and cuDNN
    convolutions (``torch.set_float32_matmul_precision("high")``). ``deterministic=True``
    (``train.deterministic``): ``torch.use_deterministic_algorithms(True)``,
    ``CUBLAS_WORKSPACE_CONFIG`` (set when it is not; a warning says to export it when CUDA was
    already in use), ``cudnn.deterministic`` and no cuDNN autotuning; TF32 stays on (it is
    deterministic, only less precise). ``False`` turns these off again; ``None`` leaves them as
    they are (``sample``, ``eval``).

    On every device: glibc's ``malloc`` keeps freed CPU memory in the process
    (:func:`energyformer.utils.malloc.keep_freed_memory`; ``ENERGYFORMER_MALLOC=system`` opts out).

    Raises:
        ValueError: ``ENERGYFORMER_MALLOC`` set to an unknown value.
    """
    keep_freed_memory()
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if cuda:
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if deterministic is None:
        return
    if deterministic and cuda and os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None:
        if torch.cuda.is_initialized():
            warnings.warn("train.deterministic: CUDA was in use before CUBLAS_WORKSPACE_CONFIG could be set; "
                          f"export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before starting", stacklevel=2)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.backends.cudnn.deterministic = bool(deterministic)
    if deterministic:
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(bool(deterministic))


def autocast_context(device: torch.device, dtype: str) -> Any:
    """``torch.autocast(device.type, bfloat16)`` for ``dtype == "bfloat16"`` (the weights stay
    fp32: mixed precision), else a no-op context. ``dtype`` is resolved (not ``"auto"``)."""
    if dtype == "bfloat16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
