"""Training: run configs, the loop, optimizer/schedule, checkpoints and metrics logs.

    from energyformer.train import load_config, train
    summary = train(load_config("configs/shakespeare_char/gpt.yaml", ["--train.max_steps", "100"],
                                resolve_vocab=True))
"""
from energyformer.train.checkpoint import load_run
from energyformer.train.config import DataConfig, RunConfig, TrainConfig, load_config, save_config
from energyformer.train.loop import TrainingDivergedError, train
from energyformer.train.optim import build_optimizer, lr_at

__all__ = ["DataConfig", "RunConfig", "TrainConfig", "load_config", "save_config", "train",
           "TrainingDivergedError", "load_run", "build_optimizer", "lr_at"]
