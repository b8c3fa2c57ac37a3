"""Moved to :mod:`energyformer.train.regression` (kept for one release; ``energyformer.train.train``
picks the regression loop for ``arch: regressor`` itself)."""
from energyformer.train.regression import train_regressor

__all__ = ["train_regressor"]
