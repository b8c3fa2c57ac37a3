"""energyformer: Transformer layers as explicit descent steps on causal energies.

The library's front door (docs/python.md)::

    from energyformer import CEMAttention, CEMBlock, NRGPTRecurrent, build_model, load_run

* **layers** (``(B, N, d) -> (B, N, d)``, usable without any config): the energy layers
  :class:`CEMAttention`, :class:`CEMGatedMLP` and :class:`CEMBlock` (each returns the updated
  residual stream ``x − η∇E``, not a branch to add), :class:`NRGPTBlock` (one NRGPT descent
  step, also the residual stream) and :class:`NRGPTRecurrent` (a whole NRGPT: the shared block
  applied ``n_steps`` times, with ``stop_tol`` and tracing); the baselines' :class:`GPTBlock`
  and :class:`LlamaBlock` (residual stream) and their branches :class:`CausalSelfAttention`,
  :class:`MLP`, :class:`LlamaAttention`, :class:`LlamaMLP` (branch outputs); :class:`RMSNorm`,
  :class:`LayerNorm`, :class:`KVCache`, :func:`tracing`;
* **models** (token ids ``(B, N)`` -> ``(logits (B, N, V), loss)``): :class:`GPT`,
  :class:`Llama`, :class:`CEMLlama`, :class:`NRGPT`, :class:`RecurrentGPT`, each from its
  config (:class:`GPTConfig`, :class:`LlamaConfig`, :class:`CEMConfig`, :class:`NRGPTConfig`,
  :class:`RecurrentGPTConfig`; the base :class:`ModelConfig`), or by :func:`build_model`;
* **runs**: the run config (:class:`RunConfig`, :class:`DataConfig`, :class:`TrainConfig`,
  :func:`load_config`) and :func:`load_run` (a trained run directory back to its model); the
  training loop is ``energyformer.train.train`` (``energyformer.train`` is the package, so the
  function is not a name here).

Names are imported on first use, so ``import energyformer`` stays cheap. The math of each
layer is in docs/ (start at docs/README.md).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__version__ = "0.3.0"

#: public name -> the module that defines it (its one home)
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("CEMAttention", "CEMBlock", "CEMGatedMLP"), "energyformer.layers.cem"),
    "NRGPTBlock": "energyformer.layers.nrgpt",
    "NRGPTRecurrent": "energyformer.layers.nrgpt_recurrent",
    **dict.fromkeys(("GPTBlock", "LlamaBlock", "CausalSelfAttention", "MLP", "LlamaAttention", "LlamaMLP"),
                    "energyformer.layers.baseline"),
    **dict.fromkeys(("RMSNorm", "LayerNorm"), "energyformer.layers.norms"),
    "KVCache": "energyformer.layers.kv_cache",
    **dict.fromkeys(("Trace", "tracing"), "energyformer.layers.trace"),
    "ModelConfig": "energyformer.models.config",
    **dict.fromkeys(("GPT", "GPTConfig"), "energyformer.models.gpt"),
    **dict.fromkeys(("Llama", "LlamaConfig"), "energyformer.models.llama"),
    **dict.fromkeys(("CEMLlama", "CEMConfig"), "energyformer.models.cem"),
    **dict.fromkeys(("NRGPT", "NRGPTConfig"), "energyformer.models.nrgpt"),
    **dict.fromkeys(("RecurrentGPT", "RecurrentGPTConfig"), "energyformer.models.recurrent_gpt"),
    **dict.fromkeys(("RunConfig", "DataConfig", "TrainConfig", "load_config"), "energyformer.runs.config"),
    "load_run": "energyformer.runs.rundir",
}

__all__ = ["__version__", "build_model", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # imported once
        return value
    raise AttributeError(f"module 'energyformer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def build_model(spec: Any, **overrides: Any):
    """Build a freshly initialized model from a config object, a dict or a YAML recipe path.

    The one entry point for building a model (the CLI, the training loop and ``load_run`` all
    build through :func:`energyformer.models.registry.build_model`, which this calls).
    ``overrides`` replace model config fields, e.g. ``build_model("recipe.yaml", vocab_size=65,
    n_steps=6)`` or ``build_model({"arch": "cem", "vocab_size": 74}, n_steps=2)``. A recipe
    without ``vocab_size`` reads it from its data directory's ``meta.json`` (``data.root`` is
    relative to the working directory); pass ``vocab_size=`` when that data is not prepared there.

    Returns:
        the model (a :class:`~energyformer.models.base.CausalLM`), in training mode on the CPU.

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
