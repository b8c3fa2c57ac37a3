"""nn.Modules with explicit keyword arguments, usable without any config object (DESIGN §2)."""
from energyformer.layers.baseline import MLP, CausalSelfAttention, GPTBlock
from energyformer.layers.cem import CEMAttention, CEMBlock, CEMGatedMLP
from energyformer.layers.norms import LayerNorm, RMSNorm, make_norm
from energyformer.layers.nrgpt import NRGPTBlock
from energyformer.layers.preconditioner import Preconditioner
from energyformer.layers.rope import RotaryEmbedding

__all__ = ["CEMAttention", "CEMBlock", "CEMGatedMLP", "CausalSelfAttention", "GPTBlock", "LayerNorm", "MLP",
           "NRGPTBlock", "Preconditioner", "RMSNorm", "RotaryEmbedding", "make_norm"]
