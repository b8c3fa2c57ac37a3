"""Training: ``train(run_cfg)`` (the loop for the arch: language model or regressor), optimizer/schedule
and the metrics log.

    from energyformer.train import load_config, train
    summary = train(load_config("configs/shakespeare_char/gpt.yaml", ["--train.max_steps", "100"],
                                resolve_vocab=True))

The run config (``DataConfig``, ``TrainConfig``, ``RunConfig``, ``load_config``, ``save_config``)
and ``load_run`` live in ``energyformer.runs``; they are re-exported here for compatibility.
"""
from energyformer.runs.config import DataConfig, RunConfig, TrainConfig, load_config, save_config
from energyformer.runs.rundir import load_run
from energyformer.train.dispatch import train
from energyformer.train.loop import TrainingDivergedError
from energyformer.train.optim import build_optimizer, lr_at

__all__ = ["DataConfig", "RunConfig", "TrainConfig", "load_config", "save_config", "train",
           "TrainingDivergedError", "load_run", "build_optimizer", "lr_at"]
