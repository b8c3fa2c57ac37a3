"""Training logs: ``metrics.jsonl`` (one JSON object per log line), optional TensorBoard and
Weights & Biases (``train.tensorboard``, ``train.wandb``; :func:`logger_options` reads them); the
peak FLOP/s table the logged MFU divides by (:func:`peak_flops`).

Each record has at least ``step``, ``train_loss``, ``lr``, ``tokens_per_s``; evaluation steps add
``val_loss`` (and ``train_loss_eval``, the loss on ``eval_iters`` training batches). The
reader, ``read_metrics``, lives with the other run-directory readers in ``energyformer.runs``.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

from energyformer.runs.rundir import METRICS_FILE, read_metrics
from energyformer.utils.io import atomic_write_text

PEAK_FLOPS_ENV = "ENERGYFORMER_PEAK_FLOPS"

#: ``(pattern of torch.cuda.get_device_name, dense bf16 FLOP/s)``, the first match wins (so the
#: PCIe/NVL variants come before their SXM name). Every entry is the vendor's data-sheet dense
#: (not 2:4 sparse) tensor-core bf16 rate (H100 / H200 SXM: 989 TFLOP/s); none was measured here
#: (docs/gpu.md, "MFU"). ``benchmarks/gpu_check.py`` reports MFU against a timed matmul peak too.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGH200\b", 989e12), (r"\bH200\b", 989e12),
    (r"\bH100\b.*\bPCIe\b", 756e12), (r"\bH100\b.*\bNVL\b", 835e12), (r"\bH100\b", 989e12),
    (r"\bH800\b", 989e12), (r"\bB200\b", 2250e12), (r"\bA100\b", 312e12), (r"\bA800\b", 312e12),
    (r"\bA10G\b", 125e12), (r"\bA10\b", 125e12), (r"\bA30\b", 165e12), (r"\bL40S\b", 362e12),
    (r"\bL40\b", 181e12), (r"\bL4\b", 121e12), (r"\bRTX 4090\b", 165e12), (r"\bRTX 3090\b", 71e12),
    (r"\bRTX A6000\b", 155e12),
)


def peak_flops_for_name(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU called ``name`` (as ``torch.cuda.get_device_name`` says,
    e.g. ``"NVIDIA H100 80GB HBM3"``) from :data:`PEAK_BF16_FLOPS`; ``None`` when not listed."""
    for pattern, value in PEAK_BF16_FLOPS:
        if re.search(pattern, name):
            return value
    return None


def peak_flops(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` for MFU: the ``ENERGYFORMER_PEAK_FLOPS`` environment
    variable when set (a number, e.g. ``7.9e14``), else the data-sheet entry of a CUDA device's
    name; ``None`` for the CPU, MPS and unlisted GPUs (MFU is then not reported).

    The logged MFU is ``training_flops_per_token × tokens/s ÷ peak``, the FLOPs counted by
    ``energyformer.models.flops`` (causal attention charged for the ``N(N+1)/2`` pairs of its mask).

    Raises:
        ValueError: ``ENERGYFORMER_PEAK_FLOPS`` is not a positive number.
    """
    import torch

    env = os.environ.get(PEAK_FLOPS_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            value = -1.0
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{PEAK_FLOPS_ENV}={env!r} is not valid; expected a positive number of FLOP/s, "
                             "e.g. 7.9e14")
        return value
    if torch.device(device).type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


WANDB_ID_FILE = "wandb_run_id"  # in the run directory: a resumed run continues the same W&B run


def logger_options(run_cfg: Any) -> dict[str, Any]:
    """The :class:`MetricsLogger` options of a run config (``train.tensorboard``, ``train.wandb*``)."""
    tc = run_cfg.train
    wandb = None
    if tc.wandb:
        wandb = {"project": tc.wandb_project or "energyformer",
                 "name": tc.wandb_run_name or Path(tc.out_dir).name, "config": run_cfg.to_dict()}
    return {"tensorboard": tc.tensorboard, "wandb": wandb}


def start_wandb(out_dir: Path, resume: bool, project: str, name: str, config: dict[str, Any]) -> Any:
    """A ``wandb`` run logging into ``out_dir/wandb``; a resumed training run continues the W&B run
    whose id ``out_dir/wandb_run_id`` holds. ``WANDB_MODE=offline`` works without an account.

    Raises:
        ModuleNotFoundError: wandb is not installed (the CLI names ``pip install 'energyformer[wandb]'``).
    """
    try:
        import wandb
    except ImportError as e:
        raise ModuleNotFoundError("train.wandb=true needs the optional package 'wandb', which is not installed; "
                                  "pip install 'energyformer[wandb]'", name="wandb") from e
    id_file = out_dir / WANDB_ID_FILE
    run_id = id_file.read_text(encoding="utf-8").strip() if resume and id_file.is_file() else None
    run = wandb.init(project=project, name=name, config=config, dir=str(out_dir), id=run_id,
                     resume="allow" if run_id else None)
    atomic_write_text(id_file, run.id + "\n")
    return run


class MetricsLogger:
    """Append records to ``out_dir/metrics.jsonl`` and, optionally, TensorBoard (``out_dir/tb``).

    Args:
        out_dir: the run directory.
        keep_until_step: ``None`` starts a new log (an existing file is replaced); an int keeps
            the records with ``step <= keep_until_step`` (resuming from that checkpoint drops
            the lines of steps that will be trained again).
        tensorboard: also write scalars with ``torch.utils.tensorboard.SummaryWriter``; when
            TensorBoard is not installed a warning is issued and only the JSONL is written.
        wandb: also log every record to Weights & Biases: ``{"project", "name", "config"}``
            (:func:`start_wandb`); None: off.

    Raises:
        ModuleNotFoundError: ``wandb`` given but the package is not installed.
    """

    def __init__(self, out_dir: str | Path, keep_until_step: int | None = None, tensorboard: bool = False,
                 wandb: dict[str, Any] | None = None):
        self.path = Path(out_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [] if keep_until_step is None else [r for r in read_metrics(out_dir)
                                                   if r.get("step", 0) <= keep_until_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = self._wandb = None
        if wandb is not None:
            self._wandb = start_wandb(Path(out_dir), keep_until_step is not None, **wandb)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))
            except ImportError as e:
                warnings.warn(f"train.tensorboard=true but TensorBoard is not available ({e}); "
                              "writing metrics.jsonl only", stacklevel=2)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (must contain ``step``); non-finite floats are written as null."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in clean.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        step = int(record["step"])
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
