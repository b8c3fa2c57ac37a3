"""Training logs: ``metrics.jsonl`` (one JSON object per log line) and optional TensorBoard.

Each record has at least ``step``, ``train_loss``, ``lr``, ``tokens_per_s``; evaluation steps add
``val_loss`` (and ``train_loss_eval``, the loss on ``eval_iters`` training batches). The
reader, ``read_metrics``, lives with the other run-directory readers in ``energyformer.runs``.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from energyformer.runs.rundir import METRICS_FILE, read_metrics
from energyformer.utils.io import atomic_write_text


class MetricsLogger:
    """Append records to ``out_dir/metrics.jsonl`` and, optionally, TensorBoard (``out_dir/tb``).

    Args:
        out_dir: the run directory.
        keep_until_step: ``None`` starts a new log (an existing file is replaced); an int keeps
            the records with ``step <= keep_until_step`` (resuming from that checkpoint drops
            the lines of steps that will be trained again).
        tensorboard: also write scalars with ``torch.utils.tensorboard.SummaryWriter``; when
            TensorBoard is not installed a warning is issued and only the JSONL is written.
    """

    def __init__(self, out_dir: str | Path, keep_until_step: int | None = None, tensorboard: bool = False):
        self.path = Path(out_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [] if keep_until_step is None else [r for r in read_metrics(out_dir)
                                                   if r.get("step", 0) <= keep_until_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
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
        if self._tb is not None:
            step = int(record["step"])
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
