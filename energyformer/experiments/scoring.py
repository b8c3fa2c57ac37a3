"""One fixed evaluation for every number an experiment reports, and the kept weights that let any
number be scored again (docs/experiments.md §6).

- **Kept weights**: every finished run's record holds its final ``model.safetensors``; a file over
  :data:`BF16_OVER_BYTES` is stored in bfloat16 (:func:`keep_weights`). The fixed evaluation is
  always computed from the kept file, so re-scoring reproduces it exactly.
- **The fixed evaluation** (:func:`final_eval`): a language model's loss on its corpus' *whole*
  validation split in consecutive windows of ``block_size`` tokens
  (:func:`energyformer.eval.suite.val_loss`), the same tokens for every run of every experiment on
  that corpus; a regressor's (GP) mean squared error on the whole validation split. It is written
  next to the weights as ``final_eval.json`` with the weights' SHA-256, and recomputed when the
  weights change or when asked (``energyformer experiment NAME --rescore``).

The per-step curve (``metrics.jsonl``) stays the cheaper seeded estimate: it shows the shape of
training, the fixed evaluation gives the reported number.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from energyformer.utils.io import atomic_path, atomic_write_json

WEIGHTS_FILE = "model.safetensors"
FINAL_EVAL_FILE = "final_eval.json"
#: a kept weights file larger than this (bytes, float32) is stored in bfloat16
BF16_OVER_BYTES = 4_000_000


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of the file at ``path``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def keep_weights(src: str | Path, dst: str | Path, bf16_over: int = BF16_OVER_BYTES) -> Path:
    """Copy the weights file ``src`` to ``dst`` (atomically), in bfloat16 when ``src`` is larger
    than ``bf16_over`` bytes (floating tensors only; the file's metadata is kept).

    Raises:
        FileNotFoundError: ``src`` does not exist.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"no weights file {str(src)!r} to keep")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dst) as tmp:
        if src.stat().st_size <= bf16_over:
            Path(tmp).write_bytes(src.read_bytes())
        else:
            with safe_open(str(src), framework="pt") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                       for k, v in tensors.items()}
            save_file(tensors, str(tmp), metadata={**meta, "energyformer_kept_dtype": "bfloat16"})
    return dst


def cached_eval(run_dir: str | Path, file_name: str, inputs: dict[str, Any], compute: Callable[[], dict[str, Any]],
                force: bool = False) -> dict[str, Any]:
    """An evaluation of the run recorded at ``run_dir`` kept beside its weights as ``file_name`` (JSON):
    read from there while it was computed on the same weights (SHA-256) and the same ``inputs``
    (what else it read: a test set's hash, a problem count; ``{}`` for none), else ``compute()``-d and
    written there (atomically) with ``"weights_sha256"`` and, when given, ``"inputs"``. ``force``
    computes it again (``--rescore``).

    Raises:
        FileNotFoundError: the record keeps no weights (the message says how to get them).
    """
    run_dir = Path(run_dir)
    weights = run_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"run record {str(run_dir)!r} keeps no {WEIGHTS_FILE}: it cannot be scored; "
                                "train it again (energyformer experiment NAME retrains runs without weights)")
    sha = file_sha256(weights)
    path = run_dir / file_name
    if path.is_file() and not force:
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = {}
        if saved.get("weights_sha256") == sha and saved.get("inputs", {}) == inputs:
            return saved
    result = {**compute(), "weights_sha256": sha, **({"inputs": inputs} if inputs else {})}
    atomic_write_json(path, result)
    return result


def final_eval(run_dir: str | Path, force: bool = False) -> dict[str, Any]:
    """The fixed evaluation of the run whose record (config, meta, weights) is ``run_dir``, read from
    ``final_eval.json`` when it was computed on the same weights (and ``force`` is false), else
    computed and written there (:func:`cached_eval`).

    Returns:
        ``{"metric": "val_loss" (nats/token) or "val_mse", "value", "split": "val", "tokens" (scored
        tokens; regressors: sequences), "weights_sha256"}``.

    Raises:
        FileNotFoundError: no weights, config or data (the message names what).
    """
    return cached_eval(run_dir, FINAL_EVAL_FILE, {}, lambda: {**_evaluate(Path(run_dir)), "split": "val"}, force)


def _evaluate(run_dir: Path) -> dict[str, Any]:
    from energyformer.data import load_tokenizer
    from energyformer.models.registry import get_spec
    from energyformer.runs.rundir import load_run, read_run_config

    run_cfg = read_run_config(run_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if get_spec(run_cfg.model.arch).language_model:
        from energyformer.eval.suite import val_loss

        model, run_cfg, meta = load_run(run_dir, device)
        got = val_loss(model, run_cfg.data.path, load_tokenizer(meta), batch_size=32, device=device)
        return {"metric": "val_loss", "value": got["loss"], "tokens": got["tokens"]}
    from energyformer.data.gp import load_gp_split
    from energyformer.train.regression import val_mse

    model, run_cfg, _ = load_run(run_dir, language_model=False)
    val = load_gp_split(run_cfg.data.path, "val")
    return {"metric": "val_mse", "value": float(val_mse(model, val, 256)), "tokens": int(len(val))}


__all__ = ["BF16_OVER_BYTES", "FINAL_EVAL_FILE", "WEIGHTS_FILE", "cached_eval", "file_sha256", "final_eval",
           "keep_weights"]
