"""nn.Modules with explicit keyword arguments, usable without any config object (docs/README.md).

Option families are registries (``INTERACTIONS``, ``MLP_TIES``, ``STEP_MAPS``,
``NRGPT_ATTENTIONS``, ``FF_ENERGIES``, ``NORMS``): register a new entry and every layer, config,
recipe and CLI flag accepts its name.
"""
from energyformer.layers.baseline import MLP, CausalSelfAttention, GPTBlock, LlamaAttention, LlamaBlock, LlamaMLP
from energyformer.layers.cem import CEMAttention, CEMBlock, CEMGatedMLP
from energyformer.layers.cem_options import INTERACTIONS, MLP_TIES, Interaction, MLPTie
from energyformer.layers.norms import NORMS, LayerNorm, RMSNorm, make_norm
from energyformer.layers.nrgpt import NRGPTBlock
from energyformer.layers.nrgpt_options import FF_ENERGIES, NRGPT_ATTENTIONS, FFEnergy, NRGPTAttention
from energyformer.layers.rope import RotaryEmbedding
from energyformer.layers.step_maps import STEP_MAPS, StepMap, make_step_map, preconditioner
from energyformer.layers.trace import Trace, TraceRecord, tracing

__all__ = ["CEMAttention", "CEMBlock", "CEMGatedMLP", "CausalSelfAttention", "GPTBlock", "LayerNorm", "MLP",
           "LlamaAttention", "LlamaBlock", "LlamaMLP", "NRGPTBlock", "preconditioner", "RMSNorm",
           "RotaryEmbedding", "make_norm", "make_step_map", "StepMap", "Interaction", "MLPTie", "NRGPTAttention",
           "FFEnergy", "INTERACTIONS", "MLP_TIES", "STEP_MAPS", "NRGPT_ATTENTIONS", "FF_ENERGIES", "NORMS",
           "Trace", "TraceRecord", "tracing"]

from energyformer.layers.nrgpt_recurrent import NRGPTRecurrent  # noqa: E402  (the multi-step NRGPT layer)

__all__ += ["NRGPTRecurrent"]
