"""Full language models; see ``registry.ARCHS`` for the names. Build one with ``energyformer.build_model``."""
from __future__ import annotations

from energyformer.models.base import CausalLM
from energyformer.models.config import ModelConfig
from energyformer.models.registry import ARCHS, config_from_dict, get_arch

__all__ = ["CausalLM", "ModelConfig", "ARCHS", "config_from_dict", "get_arch"]
