"""Full language models; see ``registry.ARCHS`` for the names. Build one with ``energyformer.build_model``."""
from __future__ import annotations

import warnings
from typing import Any

from energyformer.models.base import CausalLM
from energyformer.models.config import ModelConfig
from energyformer.models.registry import ARCHS, config_from_dict, get_arch

__all__ = ["CausalLM", "ModelConfig", "ARCHS", "config_from_dict", "get_arch"]


def __getattr__(name: str) -> Any:
    if name == "build_model":  # one entry point: energyformer.build_model
        warnings.warn("energyformer.models.build_model is deprecated; use energyformer.build_model",
                      FutureWarning, stacklevel=2)
        from energyformer.models.registry import build_model

        return build_model
    raise AttributeError(f"module 'energyformer.models' has no attribute {name!r}")
