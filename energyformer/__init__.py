"""energyformer: Transformer layers as explicit descent steps on causal energies.

See README.md for usage and docs/ for the math of each model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.2.0"
__all__ = ["build_model", "__version__"]


def build_model(spec: Any, **overrides: Any):
    """Build a freshly initialized model from a config object, a dict or a YAML recipe path.

    ``overrides`` replace model config fields, e.g. ``build_model("recipe.yaml", vocab_size=65,
    n_steps=6)`` or ``build_model({"arch": "cem", "vocab_size": 74}, n_steps=2)``. A recipe
    without ``vocab_size`` reads it from its data directory's ``meta.json`` (``data.root`` is
    relative to the working directory); pass ``vocab_size=`` when that data is not prepared there.

    Raises:
        ValueError: unknown arch or config keys, invalid values.
        FileNotFoundError: the recipe path does not exist, or its data ``meta.json`` is needed
            (no ``vocab_size`` in the recipe or the overrides) and missing.
    """
    if isinstance(spec, (str, Path)):
        from energyformer.runs.config import build_model_from_recipe

        return build_model_from_recipe(spec, **overrides)
    from energyformer.models.registry import build_model as build_from_config

    return build_from_config(spec, **overrides)
