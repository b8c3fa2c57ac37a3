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
from energyformer.hf.modeling import MODEL_CLASSES, EnergyformerForCausalLM, model_class
from energyformer.models.registry import LANGUAGE_MODELS

# every language model registered so far: the package's and those of plugins imported before this module
# (a plugin imported later gets its classes, registered with the Auto classes, from ``model_class``)
for _arch in LANGUAGE_MODELS:
    _cls = model_class(_arch)
    AutoConfig.register(_cls.config_class.model_type, _cls.config_class, exist_ok=True)
    AutoModelForCausalLM.register(_cls.config_class, _cls, exist_ok=True)

__all__ = ["CONFIG_CLASSES", "MODEL_CLASSES", "EnergyformerConfig", "EnergyformerForCausalLM", "config_for",
           "model_class"]
