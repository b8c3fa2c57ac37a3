"""Training: ``train(run_cfg)`` (the loop for the arch: language model or regressor), optimizer/schedule,
parallelism and the metrics log.

    from energyformer.runs import load_config
    from energyformer.train import train
    summary = train(load_config("configs/shakespeare_char/gpt.yaml", ["--train.max_steps", "100"],
                                resolve_vocab=True))

The run config (``DataConfig``, ``TrainConfig``, ``RunConfig``, ``load_config``, ``save_config``)
and ``load_run`` live in ``energyformer.runs`` (also ``from energyformer import ...``); importing
them from here still works, with a ``FutureWarning``.
"""
from __future__ import annotations

import warnings
from typing import Any

from energyformer.train.dispatch import train
from energyformer.train.loop import TrainingDivergedError
from energyformer.train.optim import build_optimizer, lr_at

__all__ = ["train", "TrainingDivergedError", "build_optimizer", "lr_at"]

_MOVED = {"DataConfig": "config", "RunConfig": "config", "TrainConfig": "config", "load_config": "config",
          "save_config": "config", "load_run": "rundir"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        warnings.warn(f"energyformer.train.{name} is deprecated; import it from energyformer.runs "
                      "(or energyformer)", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(f"energyformer.runs.{_MOVED[name]}"), name)
    raise AttributeError(f"module 'energyformer.train' has no attribute {name!r}")
