"""Checkpoints in a run directory, committed crash-consistently by one atomic rename.

Layout (format 2)::

    checkpoint.json                         the marker: step, best val loss, the checkpoint folder,
                                            its files, the identity of the training data
    checkpoints/step-00000030/model.safetensors
    checkpoints/step-00000030/train_state.pt
    model.safetensors                       a hard link to the committed checkpoint's weights
                                            (for tools that read the file directly)

:func:`save_checkpoint` writes the new checkpoint into a temporary folder beside the old one
(every file fsynced), renames the folder to ``checkpoints/step-N``, and then commits it by
replacing ``checkpoint.json`` (``os.replace``: one atomic rename). Only then is the top-level
``model.safetensors`` re-linked and the previous checkpoint folder removed. A crash at any
moment leaves either the old checkpoint committed or the new one; never a mix. What an
interrupted save leaves behind (temporary folders and files, an uncommitted step folder) is
removed by :func:`clean_orphans`, which training calls on start while it holds the run
directory's lock (``energyformer.runs.rundir.lock_run_dir``).

Run directories of format 1 (the weights and train state at the top level, listed by the
marker) are still found, loaded and resumed.

Sharded checkpoints (FSDP2 runs, ``train.fsdp_checkpoint: sharded``; :func:`save_sharded_checkpoint`)
hold ``dcp/`` (every rank's shards of the model and optimizer state, ``torch.distributed.checkpoint``)
and ``train_state.pt`` instead of the weights file, and the marker lists ``dcp/.metadata``; the last
checkpoint of a finished run adds ``model.safetensors`` (the single-file export). They are
written, committed and cleaned the same way.

The optimizer state is saved with parameter names as keys
(``torch.distributed.checkpoint.state_dict``, full state dict), so a checkpoint written by a
single process, DDP or FSDP2 resumes under any of them.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from energyformer.runs import sharded
from energyformer.runs.layout import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    MARKER_FILE,
    META_FILE,
    SHARDS_DIR,
    STATE_FILE,
    WEIGHTS_FILE,
)
from energyformer.runs.rng import rng_state, set_rng_state
from energyformer.runs.weights import load_weights, unwrap_model, write_weights_file
from energyformer.utils.io import atomic_write_json, temp_path_for, usual_mode

FORMAT_VERSION = 2
_STEP_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"
CHECKPOINT_FILES = (MARKER_FILE, WEIGHTS_FILE, STATE_FILE)  # top-level files a fresh run deletes
STATE_KEYS = ("format_version", "step", "best_val_loss", "optimizer", "rng", "data_generator")


def save_checkpoint(out_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | dict[str, Any],
                    step: int, best_val_loss: float | None, data_generator: torch.Generator,
                    extra: dict[str, Any] | None = None, data: dict[str, Any] | None = None,
                    model_state: dict[str, torch.Tensor] | None = None,
                    rng_ranks: list[dict[str, Any]] | None = None) -> Path:
    """Write a checkpoint of ``step`` into ``out_dir`` and commit it; returns the marker path.

    Args:
        out_dir: the run directory.
        model: the model (its plain state dict is saved; wrapper prefixes are stripped).
        optimizer: the optimizer, or an already gathered full optimizer state dict keyed by
            parameter names (what distributed training passes; see :func:`optimizer_state`).
        step: the optimizer step the checkpoint holds.
        best_val_loss: best validation loss so far (None before the first evaluation).
        data_generator: the generator that draws training batches (its state is saved).
        extra: primitives stored in the train state (e.g. the last train loss, time totals).
        data: the identity of the training data (``energyformer.data.data_identity``), recorded
            in the marker so that resume, evaluation and sampling can refuse other data.
        model_state: the full model state dict when the caller gathered it (FSDP2); default:
            ``model.state_dict()``.
        rng_ranks: with several processes, every rank's RNG states (rank order); each rank
            restores its own when resumed with the same number of processes.

    Raises:
        OSError: the files could not be written (e.g. a full disk); the previous checkpoint
            stays committed and no temporary file is left behind.
    """
    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    opt_state = optimizer if isinstance(optimizer, dict) else optimizer_state(model, optimizer)
    state = _train_state(opt_state, step, best_val_loss, data_generator, extra, rng_ranks)
    tmp = Path(_make_temp_dir(root, step))
    return _commit_staged(out_dir, tmp, step, state, data,
                          lambda: _stage(tmp, model, state, step, model_state))


def save_sharded_checkpoint(out_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                            best_val_loss: float | None, data_generator: torch.Generator, *,
                            extra: dict[str, Any] | None = None, data: dict[str, Any] | None = None,
                            rng_ranks: list[dict[str, Any]] | None = None, export: bool = False,
                            model_state: dict[str, torch.Tensor] | None = None, is_main: bool = True,
                            broadcast: Callable[[Any], Any] = lambda obj: obj) -> Path | None:
    """Write a sharded checkpoint of ``step`` (every rank calls); rank 0 commits it and returns the
    marker path (the other ranks: ``None``).

    The model and optimizer state go through ``torch.distributed.checkpoint``
    (:mod:`energyformer.runs.sharded`: each rank its own shards, no gather) into
    ``checkpoints/step-N/dcp/`` of the same temporary folder as :func:`save_checkpoint`'s;
    rank 0 adds ``train_state.pt`` (``"optimizer": None, "sharded": True``; the rest as there)
    and commits exactly as :func:`save_checkpoint` does. Without ``export`` the step folder
    holds no ``model.safetensors`` (and the top-level link is removed after the commit;
    :func:`load_checkpoint_weights` consolidates the shards); with it rank 0 also writes
    ``model_state`` (the gathered full state, default ``model.state_dict()``) as that file, the
    single-file export of a finished run.

    Args (the others as :func:`save_checkpoint`):
        is_main: whether this is rank 0 (it creates, stages and commits the folder).
        broadcast: rank 0's object on every rank (``DistInfo.broadcast``; one process: identity).

    Raises:
        OSError: a rank could not write (on that rank, and on every rank for a shard); the
            previous checkpoint stays committed.
    """
    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS_DIR
    made: str | OSError = ""
    if is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            made = _make_temp_dir(root, step)
        except OSError as e:
            made = OSError(e.errno, e.strerror, e.filename)
    made = broadcast(made)
    if isinstance(made, OSError):
        raise made
    tmp = Path(made)
    try:
        sharded.save_shards(tmp / SHARDS_DIR, model, optimizer)
    except BaseException:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not is_main:
        return None
    state = {**_train_state(None, step, best_val_loss, data_generator, extra, rng_ranks), "sharded": True}
    return _commit_staged(out_dir, tmp, step, state, data,
                          lambda: _stage(tmp, model, state, step, model_state, weights=export))


def _train_state(opt_state: dict[str, Any] | None, step: int, best_val_loss: float | None,
                 data_generator: torch.Generator, extra: dict[str, Any] | None,
                 rng_ranks: list[dict[str, Any]] | None) -> dict[str, Any]:
    state = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "best_val_loss": None if best_val_loss is None else float(best_val_loss),
        "optimizer": opt_state,
        "rng": rng_state(),
        "data_generator": data_generator.get_state(),
        "extra": dict(extra or {}),
    }
    if rng_ranks is not None:
        state["rng_ranks"] = rng_ranks
    return state


def _commit_staged(out_dir: Path, tmp: Path, step: int, state: dict[str, Any], data: dict[str, Any] | None,
                   stage: Callable[[], list[str]]) -> Path:
    """Stage the folder ``tmp`` (``stage`` returns the names of its files), rename it to its step
    name, commit the marker, re-link the top-level weights and remove the other step folders."""
    root = tmp.parent
    try:
        names = stage()
        final = _publish(root, tmp, step, find_checkpoint(out_dir))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    rel = final.relative_to(out_dir).as_posix()
    marker = {"format_version": FORMAT_VERSION, "step": int(step), "best_val_loss": state["best_val_loss"],
              "dir": rel, "files": [CONFIG_FILE, META_FILE, *(f"{rel}/{name}" for name in names)], "data": data}
    path = _commit(out_dir, marker)
    _link_weights(out_dir, final)
    _remove_other_checkpoints(root, keep=final)
    return path


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename inside it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _make_temp_dir(root: Path, step: int) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{_STEP_PREFIX}{step:08d}-", dir=root)


def _stage(tmp: Path, model: nn.Module, state: dict[str, Any], step: int,
           model_state: dict[str, torch.Tensor] | None, weights: bool = True) -> list[str]:
    """Write the weights (unless not ``weights``) and the train state into the temporary folder
    and flush them (and DCP shards already there) to disk; returns the names the marker lists.

    Raises:
        OSError: a writer failed (safetensors and ``torch.save`` report a full disk as their own
            error types; they are raised as ``OSError``, ``ENOSPC`` when the message says so).
    """
    names = [WEIGHTS_FILE] if weights else []
    if weights:
        with _as_os_error(tmp / WEIGHTS_FILE):
            write_weights_file(model, tmp / WEIGHTS_FILE, {"step": str(step)}, state_dict=model_state)
    with _as_os_error(tmp / STATE_FILE):
        torch.save(state, tmp / STATE_FILE)
    for name in (*names, STATE_FILE):
        usual_mode(tmp / name)  # safetensors writes 0600
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    if (tmp / SHARDS_DIR).is_dir():  # the shards' files were fsynced by their ranks
        fsync_dir(tmp / SHARDS_DIR)
        names.append(f"{SHARDS_DIR}/{sharded.METADATA_FILE}")
    usual_mode(tmp)  # mkdtemp makes 0700
    fsync_dir(tmp)
    return [*names, STATE_FILE]


_NO_SPACE = ("no space left", "storagefull", "code: 28", "file write failed")  # torch: "file write failed"


@contextlib.contextmanager
def _as_os_error(path: Path) -> Iterator[None]:
    """Re-raise a writer's non-``OSError`` failure (``SafetensorError``, torch's ``RuntimeError``
    "PytorchStreamWriter failed writing file") as an ``OSError`` naming ``path``."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - the writers' own error types carry the I/O error as text
        text = " ".join(str(e).split())
        if type(e).__name__ != "SafetensorError" and "failed writing file" not in text:
            raise
        code = errno.ENOSPC if any(k in text.lower() for k in _NO_SPACE) else errno.EIO
        raise OSError(code, f"{os.strerror(code)} ({type(e).__name__}: {text[:200]})", str(path)) from e


def _publish(root: Path, tmp: Path, step: int, committed: dict[str, Any] | None) -> Path:
    """Rename the staged folder to its step name (never the committed one); returns it."""
    current = committed.get("dir") if committed else None
    for name in (f"{_STEP_PREFIX}{step:08d}", f"{_STEP_PREFIX}{step:08d}.1"):
        final = root / name
        if current is not None and Path(current).name == name:
            continue
        if final.exists():  # an uncommitted folder of an interrupted save
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        return final
    raise AssertionError("unreachable")


def _commit(out_dir: Path, marker: dict[str, Any]) -> Path:
    """The commit point: one atomic replace of ``checkpoint.json``."""
    return atomic_write_json(out_dir / MARKER_FILE, marker)


def _link_weights(out_dir: Path, final: Path) -> None:
    """Point the top-level ``model.safetensors`` at the committed weights (a hard link, else a
    copy); remove it when the committed checkpoint has none (sharded, not exported)."""
    target, src = out_dir / WEIGHTS_FILE, final / WEIGHTS_FILE
    if not src.is_file():  # a sharded checkpoint without the single-file export: no stale link
        target.unlink(missing_ok=True)
        return
    if target.exists() and os.path.samefile(target, src):
        return
    tmp = temp_path_for(target)
    try:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(src, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_other_checkpoints(root: Path, keep: Path) -> None:
    for path in root.iterdir():
        if path != keep and path.is_dir() and (path.name.startswith(_STEP_PREFIX) or path.name.startswith(_TMP_PREFIX)):
            shutil.rmtree(path, ignore_errors=True)


def clean_orphans(run_dir: str | Path) -> list[str]:
    """Remove what interrupted saves left in ``run_dir``; returns the names removed.

    Removed: temporary files of atomic writes (``.NAME.*.tmp``), temporary checkpoint folders
    and step folders the marker does not name. The top-level ``model.safetensors`` is re-linked
    to the committed weights. Call it only while holding the run directory's lock.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    removed = []
    for path in run_dir.iterdir():
        if path.is_file() and path.name.startswith(".") and path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    marker = find_checkpoint(run_dir)
    root = run_dir / CHECKPOINTS_DIR
    if root.is_dir():
        keep = run_dir / marker["dir"] if marker and marker.get("dir") else None
        # without a readable marker a step folder may be the only copy of trained weights
        # (the marker deleted by hand): only temporary folders go then
        known = marker is not None or _read_marker(run_dir) is not None
        for path in root.iterdir():
            if path != keep and (known or path.name.startswith(_TMP_PREFIX)):
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(f"{CHECKPOINTS_DIR}/{path.name}")
        if keep is not None:
            _link_weights(run_dir, keep)
    return removed


def delete_checkpoint(run_dir: str | Path) -> None:
    """Remove every checkpoint file of ``run_dir`` (a fresh start): the marker first.

    Then an empty marker (``"step": null``) is written: it says that any step folder found
    later without a committed marker is an interrupted save of this run, safe to remove.
    """
    run_dir = Path(run_dir)
    for name in CHECKPOINT_FILES:
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / CHECKPOINTS_DIR, ignore_errors=True)
    atomic_write_json(run_dir / MARKER_FILE, {"format_version": FORMAT_VERSION, "step": None, "files": []})


def _read_marker(run_dir: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((run_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return marker if isinstance(marker, dict) else None


def has_checkpoint_files(run_dir: str | Path) -> list[str]:
    """Names of checkpoint files or folders present in ``run_dir`` (complete or not; the empty
    marker of a run that has not committed a checkpoint yet does not count)."""
    run_dir = Path(run_dir)
    empty = (_read_marker(run_dir) or {}).get("step", 0) is None
    found = [n for n in CHECKPOINT_FILES if (run_dir / n).exists() and not (n == MARKER_FILE and empty)]
    root = run_dir / CHECKPOINTS_DIR
    if root.is_dir() and any(root.iterdir()):
        found.append(CHECKPOINTS_DIR + "/")
    return found


def find_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The ``checkpoint.json`` marker if ``run_dir`` holds a complete checkpoint, else ``None``.

    Complete means: the marker parses and every file it lists exists.
    """
    marker_path = Path(run_dir) / MARKER_FILE
    if not marker_path.is_file():
        return None
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
        files = marker["files"]
        int(marker["step"])
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            return None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
        return None
    if not all((Path(run_dir) / f).is_file() for f in files):
        return None
    return marker


def checkpoint_dir(run_dir: str | Path, marker: dict[str, Any] | None = None) -> Path:
    """The folder holding the committed weights and train state (the run directory for format 1)."""
    run_dir = Path(run_dir)
    marker = find_checkpoint(run_dir) if marker is None else marker
    if marker and marker.get("dir"):
        return run_dir / marker["dir"]
    return run_dir


def weights_path(run_dir: str | Path) -> Path:
    """The committed ``model.safetensors`` of ``run_dir`` (the top-level file without a marker)."""
    return checkpoint_dir(run_dir) / WEIGHTS_FILE


def load_train_state(run_dir: str | Path) -> dict[str, Any]:
    """Read the committed ``train_state.pt`` with ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: missing file.
        ValueError: the file is unreadable, holds objects other than tensors and plain
            containers, or is not an energyformer train state (the message names the file and
            the missing keys).
    """
    path = checkpoint_dir(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"train state {str(path)!r} not found; the run directory has no "
                                "complete checkpoint to resume from")
    try:
        # torch warns before refusing some files (a plain pickle: "Detected pickle protocol 4"):
        # its warnings are passed on only when the load succeeds, so a refusal is our one line
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            state = torch.load(path, map_location="cpu", weights_only=True)
        for w in said:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    except Exception as e:  # noqa: BLE001 - any failure of the safe loader means: not ours
        # the loader's own message advises unsafe loading; never pass that on
        kind = "holds objects other than tensors and plain containers" if "weights_only" in str(e) \
            else f"is unreadable ({type(e).__name__})"
        raise ValueError(f"train state {str(path)!r} {kind}: it is corrupt or was not written by "
                         "energyformer; start over with --train.resume never or choose another "
                         "--train.out_dir") from None
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        raise ValueError(f"train state {str(path)!r} was not written by energyformer (missing keys "
                         f"{missing}); start over with --train.resume never or choose another --train.out_dir")
    return state


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's full state dict keyed by parameter names (any of plain, DDP, FSDP2).

    Under FSDP2 every rank must call it (it gathers); the result is complete on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                               cpu_offload=_is_sharded(model)))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load what :func:`optimizer_state` returned (or a format-1 index-keyed state dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    keys = list(state.get("state", {})) + [p for g in state.get("param_groups", []) for p in g.get("params", [])]
    if keys and all(isinstance(k, int) for k in keys):  # format 1: positional
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _is_sharded(model: nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def restore_checkpoint(run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       data_generator: torch.Generator) -> dict[str, Any]:
    """Load weights, optimizer state, RNG states and the data generator state from ``run_dir``.

    ``model`` is the plain model (distributed training loads the weights before wrapping it
    and the optimizer state after, with :func:`load_weights` and :func:`restore_train_state`).

    A sharded checkpoint (:func:`save_sharded_checkpoint`) loads the weights and the optimizer
    state from its DCP shards (in one process: resharded to the plain model).

    Returns the train state dict (``step``, ``best_val_loss``, ``extra``...).

    Raises:
        FileNotFoundError: no complete checkpoint in ``run_dir``.
        ValueError: corrupt or foreign files, weights that do not match the model, or files
            from different steps (a torn format-1 checkpoint).
    """
    run_dir = Path(run_dir)
    marker = find_checkpoint(run_dir)
    if marker is None:
        raise FileNotFoundError(f"{str(run_dir)!r} holds no complete checkpoint (expected {MARKER_FILE} "
                                f"listing {CONFIG_FILE}, {META_FILE}, {WEIGHTS_FILE}, {STATE_FILE})")
    state = load_train_state(run_dir)
    folder = checkpoint_dir(run_dir, marker)
    if not is_sharded(state):
        metadata = load_weights(model, folder / WEIGHTS_FILE)
        check_consistent(run_dir, marker, state, metadata)
    restore_train_state(model, optimizer, data_generator, state, folder)
    return state


def is_sharded(state: dict[str, Any]) -> bool:
    """Whether a train state belongs to a sharded checkpoint (:func:`save_sharded_checkpoint`)."""
    return bool(state.get("sharded"))


def load_checkpoint_weights(model: nn.Module, run_dir: str | Path) -> dict[str, str]:
    """Load the committed weights of ``run_dir`` into the plain ``model``; returns their metadata.

    The checkpoint's ``model.safetensors`` (of a full checkpoint, or the export of a finished
    sharded run), else the DCP shards of a sharded checkpoint (a run still training or killed),
    consolidated in this process without a process group
    (:func:`energyformer.runs.sharded.load_model_shards`).

    Raises:
        FileNotFoundError: neither is there.
        ValueError: corrupt files, or weights that do not match the model.
    """
    marker = find_checkpoint(run_dir)
    folder = checkpoint_dir(run_dir, marker)
    if not (folder / WEIGHTS_FILE).is_file() and sharded.has_shards(folder):
        sharded.load_model_shards(folder / SHARDS_DIR, unwrap_model(model))
        return {"step": str((marker or {}).get("step"))}
    return load_weights(model, folder / WEIGHTS_FILE)


def check_consistent(run_dir: Path, marker: dict[str, Any], state: dict[str, Any], metadata: dict[str, str]) -> None:
    """Raise ``ValueError`` unless the marker, the train state and the weights are of one step."""
    steps = {MARKER_FILE: int(marker["step"]), STATE_FILE: int(state["step"]),
             WEIGHTS_FILE: int(metadata.get("step", state["step"]))}
    if len(set(steps.values())) != 1:
        raise ValueError(f"checkpoint in {str(run_dir)!r} is inconsistent (files from different steps: "
                         f"{steps}); it was probably interrupted while saving. Start a new run with "
                         "--train.resume never or another --train.out_dir")


def restore_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, data_generator: torch.Generator,
                        state: dict[str, Any], folder: str | Path | None = None) -> None:
    """Load the optimizer state, every RNG state and the data generator state from ``state``;
    for a sharded checkpoint the model and optimizer state from the DCP shards in ``folder``
    (the checkpoint's step folder; every rank calls, see :func:`energyformer.runs.sharded.load_shards`).

    Raises:
        ValueError: a sharded state without ``folder``, or shards that do not load.
    """
    if is_sharded(state):
        if folder is None:
            raise ValueError("a sharded checkpoint's train state needs its folder to load the shards from")
        sharded.load_shards(Path(folder) / SHARDS_DIR, model, optimizer)
    else:
        load_optimizer_state(model, optimizer, state["optimizer"])
    set_rng_state(state["rng"])
    data_generator.set_state(state["data_generator"])
