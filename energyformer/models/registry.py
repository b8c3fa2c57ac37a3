"""Architecture names → (config class, model class), imported lazily.

``build_model`` accepts a model config object or a dict with an ``arch`` key (YAML recipes are
read by :mod:`energyformer.runs`; ``energyformer.build_model`` accepts a recipe path too).
"""
from __future__ import annotations

import importlib
from typing import Any

import torch.nn as nn

from energyformer._validate import check_choice
from energyformer.models.base import CausalLM
from energyformer.models.config import ModelConfig

# arch name -> (module, model class, config class)
ARCHS: dict[str, tuple[str, str, str]] = {
    "gpt": ("energyformer.models.gpt", "GPT", "GPTConfig"),
    "nrgpt": ("energyformer.models.nrgpt", "NRGPT", "NRGPTConfig"),
    "cem": ("energyformer.models.cem", "CEMLlama", "CEMConfig"),
    "llama": ("energyformer.models.llama", "Llama", "LlamaConfig"),
    "gpt_rec": ("energyformer.models.recurrent_gpt", "RecurrentGPT", "RecurrentGPTConfig"),
    "regressor": ("energyformer.models.regression", "SequenceRegressor", "RegressorConfig"),
}


#: the archs that map token ids to next-token logits (generation, Hugging Face export, lm-eval);
#: "regressor" reads continuous values instead
LANGUAGE_MODELS: tuple[str, ...] = tuple(a for a in ARCHS if a != "regressor")


def get_arch(arch: str) -> tuple[type[CausalLM], type[ModelConfig]]:
    """Return ``(ModelClass, ConfigClass)`` for a registered ``arch`` name."""
    check_choice("model.arch", arch, ARCHS)
    mod_name, model_name, cfg_name = ARCHS[arch]
    mod = importlib.import_module(mod_name)
    return getattr(mod, model_name), getattr(mod, cfg_name)


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """Build the right config class from a dict with an ``arch`` key."""
    if "arch" not in d:
        raise ValueError(f"model config needs an 'arch' key, one of {sorted(ARCHS)}; got keys {sorted(d)}")
    _, cfg_cls = get_arch(d["arch"])
    return cfg_cls.from_dict(d)


def given_fields(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg.to_dict()`` without the fields its config class derived: a field whose dataclass default
    is ``None`` (filled in from other fields, e.g. ``d_ff`` from ``d_model``) and whose value is what
    the class derives when it is left out. Building a config from the result with other values of
    the fields it derives from re-derives them (a value equal to the derived one counts as derived)."""
    from dataclasses import MISSING, fields

    d = cfg.to_dict()
    for f in fields(cfg):
        if f.default is None and f.default_factory is MISSING and d.get(f.name) is not None:
            trial = {k: v for k, v in d.items() if k != f.name}
            try:
                derived = getattr(type(cfg).from_dict(trial), f.name)
            except ValueError:
                continue
            if derived == d[f.name]:
                d.pop(f.name)
    return d


def build_model(spec: ModelConfig | dict[str, Any], **overrides: Any) -> nn.Module:
    """Build a freshly initialized model from a model config or a dict with an ``arch`` key.

    The implementation behind the one public entry point, ``energyformer.build_model`` (which
    also reads YAML recipes); inside the package, code below ``runs/`` builds models here.

    ``overrides`` replace model config fields, e.g. ``build_model(cfg, vocab_size=65, n_steps=6)``;
    fields the config derived from others (``d_ff``, ``head_dim``, …: :func:`given_fields`) are
    derived again from the overridden values, as a fresh config would.

    Raises:
        ValueError: unknown arch or config keys, invalid values.
    """
    if isinstance(spec, ModelConfig):
        spec = given_fields(spec) if overrides else spec.to_dict()
    if isinstance(spec, dict):
        spec = config_from_dict({**spec, **overrides})
    if not isinstance(spec, ModelConfig):
        raise ValueError(f"build_model expects a ModelConfig, dict or recipe path, got {type(spec).__name__}")
    model_cls, _ = get_arch(spec.arch)
    return model_cls(spec)
