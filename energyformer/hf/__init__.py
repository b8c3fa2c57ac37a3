"""Hugging Face ``transformers`` integration (the only package that imports transformers).

Importing it registers every family (``model_type`` ``energyformer_<arch>``) with
``AutoConfig`` and ``AutoModelForCausalLM``::

    import energyformer.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf/nrgpt")   # a folder from `energyformer export`

Modules: ``configuration`` (configs), ``modeling`` (causal-LM classes), ``tokenizer`` (the run's
tokenizer as a ``PreTrainedTokenizerFast``), ``convert`` (weights to and from stock Llama /
GPT-2), ``export`` (``energyformer export`` / ``import-hf``), ``remote_code`` (the model code an
export carries, for ``trust_remote_code=True`` without energyformer), ``model_card`` (the
folder's ``README.md``). See docs/hf.md.
"""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from energyformer.hf.configuration import CONFIG_CLASSES, EnergyformerConfig, config_for
from energyformer.hf.modeling import MODEL_CLASSES, EnergyformerForCausalLM

for _arch, _cfg in CONFIG_CLASSES.items():
    AutoConfig.register(_cfg.model_type, _cfg, exist_ok=True)
    AutoModelForCausalLM.register(_cfg, MODEL_CLASSES[_arch], exist_ok=True)

__all__ = ["CONFIG_CLASSES", "MODEL_CLASSES", "EnergyformerConfig", "EnergyformerForCausalLM", "config_for"]
