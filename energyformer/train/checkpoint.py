"""Run directories and checkpoints: safetensors weights + a weights-only torch train state.

Layout of a run directory (``train.out_dir``)::

    config.yaml        resolved RunConfig (``load_config`` reads it back)
    meta.json          copy of the data meta.json (tokenizer, vocab) so sampling needs no data dir
    model.safetensors  weights; tied parameters stored once (aliases in the file metadata);
                       names without ``module.`` / ``_orig_mod.`` wrapper prefixes
    train_state.pt     optimizer state, step, best val loss, torch/numpy/python RNG states and the
                       data generator state; only tensors and primitive containers, so it loads
                       with ``torch.load(weights_only=True)``
    checkpoint.json    completion marker, written last: step, format version, file names
    metrics.jsonl      training log (written by the loop)

Every file is written atomically (a temporary file in the same directory, then ``os.replace``).
A checkpoint is written as: both payloads to temporary files, then weights and state replaced,
then the marker. The marker, the safetensors metadata and the train state all record the step,
so a checkpoint torn by a crash between the two replaces is detected rather than silently used.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

FORMAT_VERSION = 1
CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
MARKER_FILE = "checkpoint.json"
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


# --------------------------------------------------------------------------------------------
# atomic writes
# --------------------------------------------------------------------------------------------

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _tmp_path(path: Path) -> Path:
    """A new empty temporary file next to ``path`` (same filesystem, so os.replace is atomic)."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(name, 0o666 & ~_umask())  # mkstemp creates 0600; give the usual file permissions
    return Path(name)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file in the same directory + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------

def strip_wrapper_prefixes(name: str) -> str:
    """Remove ``_orig_mod.`` (torch.compile) and ``module.`` (DDP) prefixes from a weight name."""
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain model under ``torch.compile`` / DDP wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def weights_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, aliases)``: the state dict with each shared tensor stored once.

    ``aliases`` maps every extra name of a tied tensor to the name kept in ``tensors``.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in unwrap_model(model).state_dict().items():
        name = strip_wrapper_prefixes(name)
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


def _write_safetensors(model: nn.Module, path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors, aliases = weights_state(model)
    meta = {"format": "pt", "energyformer_format": str(FORMAT_VERSION), "aliases": json.dumps(aliases)}
    meta.update(metadata)
    save_file(tensors, str(path), metadata=meta)
    _fsync(path)


def save_weights(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Save the model's weights to a safetensors file, atomically.

    Tied parameters are stored once; their other names are kept in the metadata key
    ``"aliases"`` (JSON) and restored by :func:`read_weights` / :func:`load_weights`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    try:
        _write_safetensors(model, tmp, dict(metadata or {}))
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors re-creates the file as 0600
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors incl. aliases, metadata)`` from a safetensors file written by :func:`save_weights`.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a readable safetensors file.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {str(path)!r} not found; expected the model.safetensors "
                                "that `energyformer train` writes into the run directory")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        aliases = json.loads(metadata.get("aliases", "{}"))
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise ValueError(f"weights file {str(path)!r} is corrupt or not a safetensors file "
                         f"({type(e).__name__}: {e}); expected the model.safetensors written by "
                         "`energyformer train`") from None
    for alias, target in aliases.items():
        if target in tensors:
            tensors[alias] = tensors[target]
    return tensors, metadata


def load_weights(model: nn.Module, path: str | Path) -> dict[str, str]:
    """Load a safetensors file into ``model`` (strict); returns the file's metadata.

    Raises:
        FileNotFoundError: missing file.
        ValueError: corrupt file, or names/shapes that do not match the model (the message lists
            missing, unexpected and mismatched tensors).
    """
    tensors, metadata = read_weights(path)
    target = unwrap_model(model)
    expected = {strip_wrapper_prefixes(k): v for k, v in target.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
              for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {_few(shapes)}")
        raise ValueError(f"weights in {str(path)!r} do not match the model built from its config: "
                         + "; ".join(parts))
    target.load_state_dict({k: tensors[k] for k in expected}, strict=True)
    return metadata


def _few(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return f"[{shown}{', ...' if len(items) > n else ''}] ({len(items)} in all)"


# --------------------------------------------------------------------------------------------
# RNG states (as tensors / primitives so that weights_only loading works)
# --------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Torch (CPU and CUDA), numpy and python RNG states as tensors and primitive containers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": _to_lists(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


# --------------------------------------------------------------------------------------------
# whole checkpoints
# --------------------------------------------------------------------------------------------

def save_checkpoint(out_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    best_val_loss: float | None, data_generator: torch.Generator,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write weights, then train state, then the ``checkpoint.json`` marker into ``out_dir``.

    ``config.yaml`` and ``meta.json`` are written by the loop at the start of the run (see
    :func:`write_run_files`). ``extra`` (primitives only) is stored in the train state.

    Returns the marker path.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "best_val_loss": None if best_val_loss is None else float(best_val_loss),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "data_generator": data_generator.get_state(),
        "extra": dict(extra or {}),
    }
    # both payloads go to temporary files first, so the window in which the directory holds
    # new weights with old state is only the time between two os.replace calls
    w_tmp, s_tmp = _tmp_path(out_dir / WEIGHTS_FILE), _tmp_path(out_dir / STATE_FILE)
    try:
        _write_safetensors(model, w_tmp, {"step": str(step)})
        torch.save(state, s_tmp)
        _fsync(s_tmp)
        os.replace(w_tmp, out_dir / WEIGHTS_FILE)
        os.replace(s_tmp, out_dir / STATE_FILE)
    finally:
        w_tmp.unlink(missing_ok=True)
        s_tmp.unlink(missing_ok=True)
    marker = {"format_version": FORMAT_VERSION, "step": int(step),
              "best_val_loss": state["best_val_loss"],
              "files": [CONFIG_FILE, META_FILE, WEIGHTS_FILE, STATE_FILE]}
    return atomic_write_text(out_dir / MARKER_FILE, json.dumps(marker, indent=2) + "\n")


def write_run_files(out_dir: str | Path, run_cfg: Any, meta: dict[str, Any]) -> None:
    """Write ``config.yaml`` (resolved run config) and ``meta.json`` (data meta copy) atomically."""
    from energyformer.train.config import save_config

    out_dir = Path(out_dir)
    save_config(run_cfg, out_dir / CONFIG_FILE)
    atomic_write_text(out_dir / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")


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
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if not all((Path(run_dir) / f).is_file() for f in files):
        return None
    return marker


def load_train_state(run_dir: str | Path) -> dict[str, Any]:
    """Read ``train_state.pt`` with ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: missing file. ValueError: unreadable file.
    """
    path = Path(run_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"train state {str(path)!r} not found; the run directory has no "
                                "complete checkpoint to resume from")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"train state {str(path)!r} is corrupt or not written by energyformer "
                         f"({type(e).__name__}: {e})") from None


def restore_checkpoint(run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       data_generator: torch.Generator) -> dict[str, Any]:
    """Load weights, optimizer state, RNG states and the data generator state from ``run_dir``.

    Returns the train state dict (``step``, ``best_val_loss``, ``extra``...).

    Raises:
        FileNotFoundError: no complete checkpoint in ``run_dir``.
        ValueError: corrupt files, weights that do not match the model, or files from different
            steps (a torn checkpoint).
    """
    run_dir = Path(run_dir)
    marker = find_checkpoint(run_dir)
    if marker is None:
        raise FileNotFoundError(f"{str(run_dir)!r} holds no complete checkpoint (expected {MARKER_FILE} "
                                f"listing {CONFIG_FILE}, {META_FILE}, {WEIGHTS_FILE}, {STATE_FILE})")
    state = load_train_state(run_dir)
    metadata = load_weights(model, run_dir / WEIGHTS_FILE)
    steps = {"checkpoint.json": int(marker["step"]), STATE_FILE: int(state["step"]),
             WEIGHTS_FILE: int(metadata.get("step", state["step"]))}
    if len(set(steps.values())) != 1:
        raise ValueError(f"checkpoint in {str(run_dir)!r} is inconsistent (files from different steps: "
                         f"{steps}); it was probably interrupted while saving. Start a new run with "
                         "--train.resume never or another --train.out_dir")
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    data_generator.set_state(state["data_generator"])
    return state


def load_run(run_dir: str | Path, device: str | torch.device = "cpu"):
    """Rebuild a trained model from a run directory for sampling, evaluation or inspection.

    Returns ``(model, run_cfg, meta)``: the model in eval mode on ``device``, the
    :class:`~energyformer.train.config.RunConfig` from ``config.yaml`` and the data meta dict
    (from the run's ``meta.json``, falling back to the data directory's).

    Raises:
        FileNotFoundError: the directory, ``config.yaml``, ``model.safetensors`` or any meta.json
            is missing (the message names the file).
        ValueError: corrupt weights or config, or weights that do not match the config.
    """
    from energyformer.models.registry import build_model
    from energyformer.train.config import load_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    cfg_path = run_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(cfg_path)!r} not found; {str(run_dir)!r} is not a run directory "
                                "written by `energyformer train`")
    run_cfg = load_config(cfg_path)
    meta = _read_meta(run_dir, run_cfg)
    model = build_model(run_cfg.model)
    load_weights(model, run_dir / WEIGHTS_FILE)
    model.to(device)
    model.eval()
    return model, run_cfg, meta


def _read_meta(run_dir: Path, run_cfg: Any) -> dict[str, Any]:
    candidates = [run_dir / META_FILE, run_cfg.data.path / META_FILE]
    for path in candidates:
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{str(path)!r} is not valid JSON ({e})") from None
    raise FileNotFoundError(f"no meta.json for run {str(run_dir)!r}: looked for "
                            + " and ".join(repr(str(p)) for p in candidates))
