"""A plugin architecture that declares a stock ``transformers`` family (``ArchSpec.hf_family``) but
whose config is not of that family's class gets a clear refusal, not an ``AttributeError`` halfway
through the conversion."""
from dataclasses import dataclass
from typing import ClassVar

import pytest

from energyformer.hf.convert import llama_blockers, to_gpt2, to_llama
from energyformer.models.llama import Llama, LlamaConfig
from energyformer.models.nrgpt import NRGPT, NRGPTConfig
from energyformer.models.registry import ArchSpec, register_arch, unregister_arch


@dataclass
class _ClaimsLlama(NRGPTConfig):
    arch: ClassVar[str] = "claims_llama"


@dataclass
class _ClaimsGPT2(NRGPTConfig):
    arch: ClassVar[str] = "claims_gpt2"


@dataclass
class _LlamaSubclass(LlamaConfig):
    arch: ClassVar[str] = "llama_subclass"


@pytest.fixture
def specs():
    names = {"claims_llama": "llama", "claims_gpt2": "gpt2", "llama_subclass": "llama"}
    for name, family in names.items():
        register_arch(ArchSpec(name, module="energyformer.models.nrgpt", model_class="NRGPT",
                               config_class="NRGPTConfig", hf_family=family))
    try:
        yield
    finally:
        for name in names:
            unregister_arch(name)


def test_a_plugin_declaring_llama_without_a_llama_config_is_refused_by_name(specs):
    cfg = _ClaimsLlama(vocab_size=11, d_model=16, n_heads=2, block_size=8)
    assert llama_blockers(cfg) == ["arch='claims_llama' declares hf_family='llama' but its config _ClaimsLlama is "
                                   "not a subclass of energyformer.models.llama.LlamaConfig"]
    with pytest.raises(ValueError, match="cannot be exported as a stock Llama: arch='claims_llama' declares"):
        to_llama(NRGPT(cfg))


def test_a_plugin_whose_config_subclasses_llama_config_exports(specs):
    cfg = _LlamaSubclass(vocab_size=11, d_model=16, n_heads=2, n_layers=1, block_size=8)
    assert llama_blockers(cfg) == []
    hf_config, sd = to_llama(Llama(cfg))
    assert hf_config.hidden_size == 16 and "model.layers.0.self_attn.q_proj.weight" in sd


def test_a_plugin_declaring_gpt2_without_a_gpt_config_is_refused_by_name(specs):
    cfg = _ClaimsGPT2(vocab_size=11, d_model=16, n_heads=2, block_size=8)
    with pytest.raises(ValueError, match="arch='claims_gpt2' declares hf_family='gpt2' but its config _ClaimsGPT2 "
                                         "is not a subclass of energyformer.models.gpt.GPTConfig"):
        to_gpt2(NRGPT(cfg))
