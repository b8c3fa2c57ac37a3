"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): what FSDP2 runs write.

Every rank writes the shards it holds of the model and the AdamW state (no full gather) into one
folder, ``checkpoints/step-N/dcp/``: ``__RANK_0.distcp`` per rank and ``.metadata`` (rank 0). The
state dict saved is ``{"model": ..., "optim": ...}`` of
``torch.distributed.checkpoint.state_dict.get_state_dict`` (parameter names as keys, no wrapper
prefixes), so DCP reshards on load: the folder loads under FSDP2 with any number of ranks, under
DDP, in one process, and the model alone loads into the plain single-device model without a
process group (:func:`load_model_shards`, what ``load_run`` does). Under several processes
the folder must be on a filesystem every rank sees (as torchrun on one machine has).

The commit (temporary folder, rename, ``checkpoint.json``) is the one of
:mod:`energyformer.runs.checkpoint`; see docs/gpu.md.
"""
from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn

METADATA_FILE = ".metadata"  # DCP's index of the shards, written last by the coordinating rank
_NO_SPACE = ("no space left", "errno 28", "storagefull")


def _no_dist() -> bool:
    import torch.distributed as tdist

    return not (tdist.is_available() and tdist.is_initialized())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (which is meant here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def has_shards(folder: str | Path) -> bool:
    """Whether ``folder`` (a checkpoint's step folder) holds a complete DCP checkpoint."""
    from energyformer.runs.layout import SHARDS_DIR

    return (Path(folder) / SHARDS_DIR / METADATA_FILE).is_file()


def save_shards(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``model``'s and ``optimizer``'s state as DCP shards into the new folder ``path``.

    Every rank of the process group calls it (one process without one: a plain model); each
    writes what it holds (an FSDP2 rank its shards), every file fsynced (the folder's entry is
    the caller's to flush).

    Raises:
        OSError: a rank could not write (``ENOSPC`` when a message says the disk is full),
            raised on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    writer = dcp.FileSystemWriter(str(path), sync_files=True, overwrite=True)
    try:
        with _quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer, no_dist=_no_dist())
    except OSError:
        raise
    except CheckpointException as e:  # any rank's failure, raised on every rank
        text = _cause(e)
        code = errno.ENOSPC if any(k in text.lower() for k in _NO_SPACE) else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (sharded save, {text})", str(path)) from None


def load_shards(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what :func:`save_shards` wrote into ``model`` and ``optimizer`` (in place; resharded
    to however they are laid out now). Every rank of the process group calls it.

    Raises:
        ValueError: the folder is unreadable or does not match the model (the message names it).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _as_value_error(path), _quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_model_shards(path: str | Path, model: nn.Module) -> None:
    """Consolidate the model weights of a DCP checkpoint into the plain single-device ``model``
    (on the CPU, without a process group: this process reads every rank's shards).

    Raises:
        ValueError: the folder is unreadable or does not match the model (the message names it).
    """
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with _as_value_error(path), _quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"], strict=True)


def _cause(exc: BaseException) -> str:
    """One line for what failed: the first rank's exception inside DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = next(iter(failures.items()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())[:200]}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


@contextlib.contextmanager
def _as_value_error(path: str | Path) -> Iterator[None]:
    """Re-raise DCP's failures to read ``path`` as one ``ValueError`` naming it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        raise ValueError(f"sharded checkpoint {str(path)!r} is unreadable or does not match the model built "
                         f"from the run's config ({_cause(e)})") from None
