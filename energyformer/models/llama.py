"""Llama baseline (docs/baselines.md §3): RMSNorm pre-norm blocks, RoPE, SwiGLU, optional GQA, no biases.

    h'  = h  + W_O · MHA(RoPE(W_Q n₁(h)), RoPE(W_K n₁(h)), W_V n₁(h))
    h'' = h' + W_down (SiLU(W_gate n₂(h')) ⊙ W_up n₂(h'))

The layers (:class:`~energyformer.layers.baseline.LlamaBlock`) use Hugging Face's
``LlamaForCausalLM`` parameter names so weights map one to one; ``tests/models/test_llama.py`` checks
logits parity with ``transformers``. ``d_ff`` defaults to the same width rule as CEM
(:func:`energyformer.models.config.default_d_ff`) so the two are comparable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from energyformer._validate import check_divides, check_float, check_int
from energyformer.layers.baseline import LlamaBlock
from energyformer.models.base import LlamaStyleLM
from energyformer.models.config import LlamaShapeConfig
from energyformer.utils.derived import Rule


@dataclass
class LlamaConfig(LlamaShapeConfig):
    """Llama hyper-parameters. ``n_kv_heads`` (GQA) defaults to ``n_heads``; ``head_dim`` to ``d_model // n_heads``."""

    arch: ClassVar[str] = "llama"
    derived: ClassVar[dict[str, Rule]] = {"n_kv_heads": lambda c: c.n_heads}
    n_kv_heads: int | None = None
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        check_int("n_kv_heads", self.n_kv_heads, 1)
        check_divides("n_kv_heads", self.n_kv_heads, "n_heads", self.n_heads)
        check_float("rope_theta", self.rope_theta, 0.0, strict=True)


class Llama(LlamaStyleLM):
    """Llama decoder ``idx (B, N) -> (logits (B, N, V), loss or None)``; init N(0, 0.02) for every matrix."""

    embed_name, layers_name = "embed_tokens", "layers"

    def make_layer(self, c: LlamaConfig) -> LlamaBlock:
        return LlamaBlock(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff,
                          c.rope_theta, c.norm_eps)
