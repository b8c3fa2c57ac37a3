"""The run directory: its layout, and the one reader (and writer) of each file in it.

Layout of a run directory (``train.out_dir``)::

    config.yaml        resolved RunConfig (``load_config`` reads it back; no ``base:``)
    meta.json          copy of the data meta.json (tokenizer, vocab) so sampling needs no data dir
    model.safetensors  weights (``energyformer.runs.weights``): tied parameters stored once,
                       aliases in the file metadata, no ``module.`` / ``_orig_mod.`` prefixes
    train_state.pt     optimizer state, step, best val loss, RNG states, data generator state;
                       loaded with ``torch.load(weights_only=True)`` (``energyformer.runs.checkpoint``)
    checkpoint.json    completion marker, written last (``energyformer.runs.checkpoint``)
    metrics.jsonl      training log, one JSON object per line (written by ``energyformer.train``)
    summary.json       final numbers of a finished run (what ``energyformer compare`` tabulates)

Every file is written atomically (``energyformer.utils.io``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from energyformer.runs.config import RunConfig, load_config, save_config
from energyformer.runs.weights import load_weights
from energyformer.utils.io import atomic_write_json

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
MARKER_FILE = "checkpoint.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def write_run_files(run_dir: str | Path, run_cfg: RunConfig, meta: dict[str, Any]) -> None:
    """Write ``config.yaml`` (resolved run config) and ``meta.json`` (data meta copy) atomically."""
    run_dir = Path(run_dir)
    save_config(run_cfg, run_dir / CONFIG_FILE)
    atomic_write_json(run_dir / META_FILE, meta, sort_keys=True)


def read_run_config(run_dir: str | Path) -> RunConfig:
    """The run's ``config.yaml`` as a :class:`RunConfig`.

    Raises:
        FileNotFoundError: no ``config.yaml`` (the message says this is not a run directory).
        ValueError: the config does not load (see ``load_config``).
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found; {str(run_dir)!r} is not a run directory "
                                "written by `energyformer train`")
    return load_config(path)


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


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    """The ``summary.json`` of a finished run.

    Raises:
        FileNotFoundError: no ``summary.json`` (the run has not finished).
        ValueError: ``summary.json`` is not a valid JSON object.
    """
    run_dir = Path(run_dir)
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: is {str(run_dir)!r} a finished `energyformer train` run?")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON ({e})") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{str(path)!r} is not valid JSON (expected an object)")
    return summary


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


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Any, RunConfig, dict[str, Any]]:
    """Rebuild a trained model from a run directory for sampling, evaluation or inspection.

    Returns:
        ``(model, run_cfg, meta)``: the model in eval mode on ``device``, the
        :class:`RunConfig` from ``config.yaml`` and the data meta dict (the run's ``meta.json``,
        falling back to the data directory's).

    Raises:
        FileNotFoundError: the directory, ``config.yaml``, ``model.safetensors`` or any meta.json
            is missing (the message names the file).
        ValueError: corrupt weights or config, or weights that do not match the config.
    """
    from energyformer.models.registry import build_model

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    run_cfg = read_run_config(run_dir)
    meta = read_run_meta(run_dir, run_cfg)
    model = build_model(run_cfg.model)
    load_weights(model, run_dir / WEIGHTS_FILE)
    model.to(device)
    model.eval()
    return model, run_cfg, meta
