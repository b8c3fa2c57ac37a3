"""``train(run_cfg)``: the one place that picks the training loop for a model's arch.

Language models (``energyformer.models.registry.LANGUAGE_MODELS``) train on token streams with
:func:`energyformer.train.loop.train`; the in-context regressor (``arch: regressor``) trains on
sequences of continuous pairs with :func:`energyformer.train.regression.train_regressor`.
"""
from __future__ import annotations

from typing import Any

from energyformer.runs.config import RunConfig


def train(run_cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Train ``run_cfg`` with the loop of its ``model.arch`` and return the run summary.

    Args:
        run_cfg: a validated run config (``energyformer.runs.config.load_config``).
        progress: show progress (a bar for language models; None: only on a terminal).

    Returns:
        the summary written to ``train.out_dir/summary.json`` (see the loops' docstrings).

    Raises:
        what the chosen loop raises (``TrainingDivergedError``, ``ValueError``, ``FileNotFoundError``).
    """
    if run_cfg.model.arch == "regressor":
        from energyformer.train.regression import train_regressor

        return train_regressor(run_cfg, progress=progress)
    from energyformer.train.loop import train as train_language_model

    return train_language_model(run_cfg, progress=progress)
