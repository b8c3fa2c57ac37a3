"""Full language models; see ``registry.ARCHS`` for the names."""
from energyformer.models.base import CausalLM, ModelConfig
from energyformer.models.registry import ARCHS, build_model, config_from_dict, get_arch

__all__ = ["CausalLM", "ModelConfig", "ARCHS", "build_model", "config_from_dict", "get_arch"]
