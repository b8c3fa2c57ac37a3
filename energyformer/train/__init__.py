"""Training: ``train(run_cfg)`` (the loop for the arch: language model or regressor), optimizer/schedule,
parallelism and the metrics log.

    from energyformer.runs import load_config
    from energyformer.train import train
    summary = train(load_config("configs/shakespeare_char/gpt.yaml", ["--train.max_steps", "100"],
                                resolve_vocab=True))

The run config (``DataConfig``, ``TrainConfig``, ``RunConfig``, ``load_config``, ``save_config``)
and ``load_run`` live in ``energyformer.runs`` (also ``from energyformer import ...``).
"""
from __future__ import annotations

from energyformer.train.dispatch import train
from energyformer.train.loop import TrainingDivergedError
from energyformer.train.optim import build_optimizer, lr_at

__all__ = ["train", "TrainingDivergedError", "build_optimizer", "lr_at"]
