"""``train(run_cfg)``: the one place that picks the training loop for a model's arch.

The loop is the arch's :class:`~energyformer.models.registry.ArchSpec` ``train_loop``: language
models train on token streams with :func:`energyformer.train.loop.train`; the in-context regressor
(``arch: regressor``) trains on sequences of continuous pairs with
:func:`energyformer.train.regression.train_regressor`; a plugin arch names its own. Training keys
the chosen loop does not read are refused first (:meth:`ArchSpec.check_train_config`).
"""
from __future__ import annotations

from typing import Any

from energyformer.models.registry import get_spec
from energyformer.runs.config import RunConfig


def train(run_cfg: RunConfig, progress: bool | None = None) -> dict[str, Any]:
    """Train ``run_cfg`` with the loop of its ``model.arch`` and return the run summary.

    Args:
        run_cfg: a validated run config (``energyformer.runs.config.load_config``).
        progress: show progress (a bar for language models; None: only on a terminal).

    Returns:
        the summary written to ``train.out_dir/summary.json`` (see the loops' docstrings).

    Raises:
        ValueError: a ``train`` key set away from its default that the arch's loop does not read (one
            line naming the keys), or what the chosen loop raises for its config.
        TrainingDivergedError, FileNotFoundError: what the chosen loop raises.
    """
    spec = get_spec(run_cfg.model.arch)
    spec.check_train_config(run_cfg.train)
    return spec.train_function()(run_cfg, progress=progress)
