"""Checkpoints in a run directory: weights + train state, committed by a marker file.

A checkpoint is written as: weights and train state to temporary files, then weights and state
replaced (``os.replace``), then the ``checkpoint.json`` marker. The marker, the safetensors
metadata and the train state all record the step, so a checkpoint torn by a crash between the
two replaces is detected rather than silently used. ``config.yaml`` and ``meta.json`` are
written once per run by :func:`energyformer.runs.rundir.write_run_files`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from energyformer.runs.rng import rng_state, set_rng_state
from energyformer.runs.rundir import CONFIG_FILE, MARKER_FILE, META_FILE, STATE_FILE, WEIGHTS_FILE
from energyformer.runs.weights import load_weights, write_weights_file
from energyformer.utils.io import atomic_path, atomic_write_json

FORMAT_VERSION = 1
CHECKPOINT_FILES = (MARKER_FILE, WEIGHTS_FILE, STATE_FILE)  # what a fresh run deletes


def save_checkpoint(out_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    best_val_loss: float | None, data_generator: torch.Generator,
                    extra: dict[str, Any] | None = None) -> Path:
    """Write weights, then train state, then the ``checkpoint.json`` marker into ``out_dir``.

    ``extra`` (primitives only) is stored in the train state. Returns the marker path.
    """
    out_dir = Path(out_dir)
    state = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "best_val_loss": None if best_val_loss is None else float(best_val_loss),
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "data_generator": data_generator.get_state(),
        "extra": dict(extra or {}),
    }
    # both payloads are staged first, so the window in which the directory holds new weights
    # with old state is only the time between two os.replace calls (the inner one, the weights,
    # is replaced first)
    with atomic_path(out_dir / STATE_FILE) as s_tmp, atomic_path(out_dir / WEIGHTS_FILE) as w_tmp:
        write_weights_file(model, w_tmp, {"step": str(step)})
        torch.save(state, s_tmp)
    marker = {"format_version": FORMAT_VERSION, "step": int(step), "best_val_loss": state["best_val_loss"],
              "files": [CONFIG_FILE, META_FILE, WEIGHTS_FILE, STATE_FILE]}
    return atomic_write_json(out_dir / MARKER_FILE, marker)


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
    steps = {MARKER_FILE: int(marker["step"]), STATE_FILE: int(state["step"]),
             WEIGHTS_FILE: int(metadata.get("step", state["step"]))}
    if len(set(steps.values())) != 1:
        raise ValueError(f"checkpoint in {str(run_dir)!r} is inconsistent (files from different steps: "
                         f"{steps}); it was probably interrupted while saving. Start a new run with "
                         "--train.resume never or another --train.out_dir")
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    data_generator.set_state(state["data_generator"])
    return state
