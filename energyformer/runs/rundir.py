"""The run directory: its layout, and the one reader (and writer) of each file in it.

Layout of a run directory (``train.out_dir``)::

    config.yaml        resolved RunConfig (``load_config`` reads it back; no ``base:``)
    meta.json          copy of the data meta.json (tokenizer, vocab) so sampling needs no data dir
    model.safetensors  weights (``energyformer.runs.weights``): tied parameters stored once,
                       aliases in the file metadata, no ``module.`` / ``_orig_mod.`` prefixes
    train_state.pt     optimizer state, step, best val loss, RNG states, data generator state;
                       loaded with ``torch.load(weights_only=True)`` (``energyformer.runs.checkpoint``)
    checkpoint.json    the commit marker: names the checkpoint folder ``checkpoints/step-N/``
                       (weights + train state) and records the data identity
                       (``energyformer.runs.checkpoint``); ``model.safetensors`` above is a hard
                       link to the committed weights
    .lock              held (``flock``) by the training that writes the directory
    metrics.jsonl      training log, one JSON object per line (written by ``energyformer.train``)
    summary.json       final numbers of a finished run (what ``energyformer compare`` tabulates)

Every file is written atomically (``energyformer.utils.io``).
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from energyformer.models.registry import LANGUAGE_MODELS, get_spec
from energyformer.runs.checkpoint import find_checkpoint, load_checkpoint_weights
from energyformer.runs.config import IMPORTS_KEY, RunConfig, load_config, save_config
from energyformer.runs.layout import (  # noqa: F401
    CONFIG_FILE,
    LOCK_FILE,
    MARKER_FILE,
    META_FILE,
    METRICS_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
)
from energyformer.runs.recipe import read_yaml_mapping
from energyformer.utils.io import atomic_write_json, read_json_object
from energyformer.utils.plugins import check_imports, load_listed_plugins


class RunDirLockedError(ValueError):
    """Another process holds the run directory's lock (another training writes there)."""


@contextlib.contextmanager
def lock_run_dir(run_dir: str | Path) -> Iterator[Path]:
    """Hold an exclusive lock on ``run_dir`` (created if needed) for the body of the ``with``.

    The lock is ``flock`` on ``run_dir/.lock`` (released by the OS when the process dies, so a
    killed training never leaves a stale lock); the file records the holder's pid. Where
    ``fcntl`` does not exist (Windows) nothing is locked.

    Raises:
        RunDirLockedError: another process holds the lock (the message names its pid).
        NotADirectoryError: ``run_dir`` is an existing file.
        PermissionError / OSError: the directory cannot be created or written.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"train.out_dir={str(run_dir)!r} is a file; expected a run directory "
                                 "(or a path where one can be created)")
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield run_dir
        return
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            raise RunDirLockedError(f"train.out_dir={str(run_dir)!r} is in use by another training "
                                    f"(pid {holder}); wait for it to finish or choose another "
                                    "--train.out_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield run_dir
    finally:
        os.close(fd)  # releases the lock


def training_pid(run_dir: str | Path) -> int | None:
    """The pid of the training that holds ``run_dir``'s lock (a run in progress; 0 when the lock
    file names none), else ``None``. Never creates or locks anything."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: nothing is locked
        return None
    path = Path(run_dir) / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return int(holder) if holder.isdigit() else 0
    finally:
        os.close(fd)


def warn_if_training(run_dir: str | Path) -> int | None:
    """Warn (one line) when a training holds ``run_dir``'s lock: the committed checkpoint is not
    the run's last; returns its step then (else ``None``). Never creates or locks anything."""
    if training_pid(run_dir) is None:
        return None
    step = (find_checkpoint(run_dir) or {}).get("step")
    if step is not None:
        warnings.warn(f"using step {step} of a run still training ({str(run_dir)!r}); later "
                      "checkpoints will differ", UserWarning, stacklevel=2)
    return step


def run_progress(run_dir: str | Path, run_cfg: RunConfig | None = None) -> dict[str, Any]:
    """Where a run stands, from its files: ``{"step", "max_steps", "finished", "pid"}``.

    ``step`` is the committed checkpoint's (``None`` without one), ``max_steps`` the config's
    ``train.max_steps`` (``None`` for an imported model, which was not trained here), ``pid`` the
    training that holds the lock (:func:`training_pid`; ``None`` when none runs), ``finished``
    whether ``summary.json`` is written and no training holds the lock (or the model was imported).

    Raises:
        FileNotFoundError / ValueError: no readable ``config.yaml`` (when ``run_cfg`` is not given).
    """
    run_dir = Path(run_dir)
    marker = find_checkpoint(run_dir) or {}
    imported = "imported_from" in marker
    run_cfg = read_run_config(run_dir) if run_cfg is None else run_cfg
    pid = training_pid(run_dir)
    return {"step": marker.get("step"), "max_steps": None if imported else run_cfg.train.max_steps,
            "finished": imported or ((run_dir / SUMMARY_FILE).is_file() and pid is None), "pid": pid}


def progress_note(progress: dict[str, Any], step: int | None = None) -> str:
    """``"step 40 of 100"`` (``step``: default the committed one), with ``", in progress (pid N)"`` or
    ``", unfinished (no training running)"`` unless the run finished: for tables and warnings."""
    step = progress["step"] if step is None else step
    text = f"step {step}" + (f" of {progress['max_steps']}" if progress["max_steps"] is not None else "")
    if progress["finished"]:
        return text
    if progress["pid"] is not None:
        return text + (f", in progress (pid {progress['pid']})" if progress["pid"] else ", in progress")
    return text + ", unfinished (no training running)"


def write_run_files(run_dir: str | Path, run_cfg: RunConfig, meta: dict[str, Any], write_meta: bool = True) -> None:
    """Write ``config.yaml`` (resolved run config) and ``meta.json`` (data meta copy) atomically.

    ``write_meta=False`` (a resumed run) keeps the run's meta.json: the tokenizer a run was
    trained with is never replaced.
    """
    run_dir = Path(run_dir)
    save_config(run_cfg, run_dir / CONFIG_FILE)
    if write_meta or not (run_dir / META_FILE).is_file():
        atomic_write_json(run_dir / META_FILE, meta, sort_keys=True)


def run_config_path(run_dir: str | Path, alternative: str | None = None) -> Path:
    """``run_dir/config.yaml``, the file that makes a directory a run directory.

    Args:
        run_dir: the directory.
        alternative: what else the caller accepts, named in the error (e.g. "a recipe YAML file").

    Raises:
        FileNotFoundError: no ``config.yaml``; the message says what a run directory holds,
            which commands write one, and what ``run_dir`` holds instead.
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        expected = (f"{alternative} or " if alternative else "") + (
            f"a run directory holding {CONFIG_FILE} (with {WEIGHTS_FILE} and {META_FILE}), as `energyformer "
            "train` and `energyformer import-hf` write")
        raise FileNotFoundError(f"{str(path)!r} not found; {str(run_dir)!r} is not a run directory: expected "
                                f"{expected}; {_contents(Path(run_dir))}")
    return path


def _contents(directory: Path, shown: int = 8) -> str:
    """``"it holds a.txt, b/"`` / ``"it is empty"`` / ``"it does not exist"``: for error messages."""
    if not directory.is_dir():
        return "it does not exist" if not directory.exists() else "it is a file"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    if not names:
        return "it is empty"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"it holds {', '.join(names[:shown])}{more}"


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The run's ``config.yaml`` as a :class:`RunConfig`.

    Raises:
        FileNotFoundError: no ``config.yaml`` (the message says this is not a run directory and
            what the directory holds; see :func:`run_config_path`).
        ValueError: the config does not load (see ``load_config``).
    """
    return load_config(run_config_path(run_dir))


def run_imports(run_dir: str | Path) -> list[str]:
    """The plugin modules a run directory's ``config.yaml`` names (``imports:``), read without building
    its model (``[]`` where there is no ``config.yaml`` or it names none).

    Raises:
        ValueError: the file is not valid YAML, or its ``imports`` are not a list of module names.
    """
    path = Path(run_dir) / CONFIG_FILE
    return check_imports(read_yaml_mapping(path).get(IMPORTS_KEY)) if path.is_file() else []


def load_run_plugins(run_dir: str | Path) -> list[str]:
    """Import the plugin modules of a run directory (:func:`run_imports`), so that a config naming its
    architecture or options can be read before the run's own ``config.yaml`` is: a resumed ``train``
    whose recipe or command line does not repeat them (``read_run_config`` imports them by itself).

    Returns:
        the module names.

    Raises:
        ValueError: as :func:`run_imports`; a module that fails to import
            (:class:`~energyformer.utils.plugins.PluginError`).
    """
    path = Path(run_dir) / CONFIG_FILE
    imports = read_yaml_mapping(path).get(IMPORTS_KEY) if path.is_file() else None
    return load_listed_plugins(imports, path)


def read_run_meta(run_dir: str | Path, run_cfg: RunConfig | None = None) -> dict[str, Any]:
    """The run's copy of the data ``meta.json``; without one, the data directory's.

    Both are read with ``energyformer.data.load_meta`` (same format, same checks).

    Raises:
        FileNotFoundError: neither meta.json exists (the message names both paths).
        ValueError: the meta.json found is corrupt.
    """
    from energyformer.data import load_meta

    run_dir = Path(run_dir)
    candidates = [run_dir] + ([run_cfg.data.path] if run_cfg is not None else [])
    for directory in candidates:
        if (directory / META_FILE).is_file():
            return load_meta(directory)
    raise FileNotFoundError(f"no meta.json for run {str(run_dir)!r}: looked for "
                            + " and ".join(repr(str(d / META_FILE)) for d in candidates))


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``summary.json`` atomically."""
    return atomic_write_json(Path(run_dir) / SUMMARY_FILE, summary)


def clear_summary(run_dir: str | Path) -> None:
    """Remove ``summary.json`` when a run starts (or resumes) training: the run is unfinished until
    its new summary is written, so a stop in between never leaves the previous segment's numbers
    looking like a finished run (``compare``, ``experiment`` records)."""
    (Path(run_dir) / SUMMARY_FILE).unlink(missing_ok=True)


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The ``summary.json`` of a finished run.

    Raises:
        FileNotFoundError: no ``summary.json`` (the run has not finished).
        ValueError: ``summary.json`` is not a valid JSON object.
    """
    run_dir = Path(run_dir)
    return read_json_object(run_dir / SUMMARY_FILE, missing=f"is {str(run_dir)!r} a finished `energyformer train` run?",
                            corrupt="it is rewritten when the run finishes (energyformer train)")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``run_dir/metrics.jsonl`` (an empty list if there is none).

    A line cut short by a crash is skipped.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def require_language_model(run_dir: str | Path, run_cfg: RunConfig) -> None:
    """Raise ``ValueError`` unless the run is a language model (token ids in, next-token logits out).

    Commands that read text (sample, inspect, eval, export) call it so that a ``regressor`` run is
    refused by what it is, not by a tokenizer error further down.
    """
    arch = run_cfg.model.arch
    if not get_spec(arch).language_model:
        raise ValueError(f"{str(run_dir)!r} is an arch={arch!r} run, which reads continuous values, not text; "
                         f"this command works on the language models ({', '.join(LANGUAGE_MODELS)})")


def load_run(run_dir: str | Path, device: str | torch.device = "cpu", *,
             language_model: bool = True) -> tuple[Any, RunConfig, dict[str, Any]]:
    """Rebuild a trained model from a run directory for sampling, evaluation or inspection.

    ``run_dir`` may name a model of the zoo that ships with energyformer, ``"zoo:NAME"``
    (:mod:`energyformer.runs.zoo`; ``energyformer zoo`` lists them).

    Returns:
        ``(model, run_cfg, meta)``: the model in eval mode on ``device``, the
        :class:`RunConfig` from ``config.yaml`` and the data meta dict (the run's ``meta.json``,
        falling back to the data directory's).

    The weights are the committed checkpoint's (``checkpoint.json``), else the top-level
    ``model.safetensors``; a sharded checkpoint (an FSDP2 run still training or killed) is
    consolidated from its DCP shards in this process, on the CPU, without a process group. The
    tokenizer (meta.json) is checked against the data identity the run recorded, so a run is
    never decoded with another character table.

    Raises:
        NotADirectoryError: ``run_dir`` is a file.
        FileNotFoundError: ``zoo:NAME`` names no entry; the directory, ``config.yaml``,
            ``model.safetensors`` or any meta.json
            is missing (the message names the file).
        ValueError: corrupt weights or config, weights that do not match the config, a
            meta.json whose vocabulary differs from the one the run trained with (named), or
            (with ``language_model=True``, the default) a run that is not a language model.
    """
    from energyformer.data import identity_change, vocab_identity
    from energyformer.models.registry import build_model
    from energyformer.runs.zoo import resolve_run_dir

    run_dir = resolve_run_dir(run_dir)  # "zoo:NAME": a model that ships with the package
    if run_dir.is_file():
        raise NotADirectoryError(f"{str(run_dir)!r} is a file; expected a run directory written by "
                                 "`energyformer train` (its train.out_dir)")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    run_cfg = read_run_config(run_dir)
    if language_model:
        require_language_model(run_dir, run_cfg)
    meta = read_run_meta(run_dir, run_cfg)
    marker = find_checkpoint(run_dir)
    recorded = (marker or {}).get("data")
    if isinstance(recorded, dict) and get_spec(run_cfg.model.arch).language_model:
        change = identity_change(recorded, vocab_identity(meta), None, meta)
        if change:
            raise ValueError(f"the meta.json found for run {str(run_dir)!r} does not match the data it was "
                             f"trained on: {change}; restore the run's meta.json or re-prepare the data it used")
    model = build_model(run_cfg.model)
    load_checkpoint_weights(model, run_dir)
    model.to(device)
    model.eval()
    return model, run_cfg, meta


class OpenRun(NamedTuple):
    """A trained run opened for inference by :func:`open_run` (a named tuple: unpack it or read the fields)."""

    model: Any
    """the language model in eval mode on :attr:`device` (``(B, N)`` token ids in, ``(B, N, V)`` logits out)"""
    run_cfg: RunConfig
    """the run's :class:`RunConfig` (``config.yaml``)"""
    meta: dict[str, Any]
    """the data meta dict (the run's ``meta.json``)"""
    tokenizer: Any
    """the run's tokenizer (``energyformer.data.load_tokenizer(meta)``)"""
    device: torch.device
    """where the model is (``device`` resolved: ``"auto"`` is CUDA when available, else the CPU)"""
    run_dir: Path
    """the run directory (a ``zoo:NAME`` reference resolved to the zoo's folder)"""


def open_run(run_ref: str | Path, device: str | torch.device = "auto") -> OpenRun:
    """Open a trained language model for inference, as ``sample``, ``inspect`` and ``eval`` do.

    In this order: resolve ``run_ref`` (``zoo:NAME`` → the zoo's folder) and ``device``
    (:func:`energyformer.utils.device.resolve_device`), apply the process-wide backend settings
    for it (``configure_backends``, docs/gpu.md), rebuild the model (:func:`load_run`), warn in
    one line when a training still holds the run (:func:`warn_if_training`: the committed
    checkpoint is not the run's last), and build the run's tokenizer. One home for what every
    inference command does first (docs/architecture.md §1, ``runs/``).

    Args:
        run_ref: a run directory, or ``"zoo:NAME"``, a model that ships with the package
            (:mod:`energyformer.runs.zoo`).
        device: ``"auto"`` (default), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or a ``torch.device``.

    Returns:
        :class:`OpenRun` ``(model, run_cfg, meta, tokenizer, device, run_dir)``.

    Raises:
        ValueError: ``device`` is not a device or not available here; an invalid tokenizer in the
            meta; everything :func:`load_run` raises (corrupt files, a run that is not a language model).
        FileNotFoundError / NotADirectoryError: as :func:`load_run` (a missing run, ``zoo:NAME``
            naming no entry, a missing ``config.yaml``, weights or meta.json).
    """
    from energyformer.data import load_tokenizer
    from energyformer.runs.zoo import resolve_run_dir
    from energyformer.utils.device import configure_backends, resolve_device

    run_dir = resolve_run_dir(run_ref)  # "zoo:NAME": a model that ships with the package
    dev = resolve_device(device)
    configure_backends(dev)
    model, run_cfg, meta = load_run(run_dir, device=dev)
    warn_if_training(run_dir)
    return OpenRun(model, run_cfg, meta, load_tokenizer(meta), dev, run_dir)
