"""Llama baseline (SPEC §2.3): RMSNorm pre-norm blocks, RoPE, SwiGLU, optional GQA, no biases.

    h'  = h  + W_O · MHA(RoPE(W_Q n₁(h)), RoPE(W_K n₁(h)), W_V n₁(h))
    h'' = h' + W_down (SiLU(W_gate n₂(h')) ⊙ W_up n₂(h'))

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, ``input_layernorm``,
``post_attention_layernorm``) so weights map one to one; ``tests/test_llama.py`` checks logits
parity with ``transformers``. ``d_ff`` defaults to the same width rule as CEM
(:func:`energyformer.models.base.default_d_ff`) so the two are comparable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_divides, check_float, check_int
from energyformer.energies.cem import merge_heads, split_heads
from energyformer.layers.norms import RMSNorm
from energyformer.layers.rope import RotaryEmbedding, apply_rope
from energyformer.models.base import CausalLM, LlamaShapeConfig


@dataclass
class LlamaConfig(LlamaShapeConfig):
    """Llama hyper-parameters. ``n_kv_heads`` (GQA) defaults to ``n_heads``; ``head_dim`` to ``d_model // n_heads``."""

    arch: ClassVar[str] = "llama"
    n_kv_heads: int | None = None
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE")
        if self.n_kv_heads is not None:
            check_int("n_kv_heads", self.n_kv_heads, 1)
            check_divides("n_kv_heads", self.n_kv_heads, "n_heads", self.n_heads)
        check_float("rope_theta", self.rope_theta, 0.0, strict=True)

    @property
    def resolved_n_kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


class LlamaAttention(nn.Module):
    """Causal multi-head attention with RoPE and optional GQA, ``(B, N, d) -> (B, N, d)``."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, rope_theta: float):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(x.shape[1], device=x.device, dtype=x.dtype)
        q = apply_rope(split_heads(self.q_proj(x), self.n_heads), cos, sin)
        k = apply_rope(split_heads(self.k_proj(x), self.n_kv_heads), cos, sin)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        if self.n_kv_heads != self.n_heads:  # GQA: each key/value head serves n_heads // n_kv_heads query heads
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(merge_heads(y))


class LlamaMLP(nn.Module):
    """SwiGLU ``W_down(SiLU(W_gate x) ⊙ W_up x)``, ``(B, N, d) -> (B, N, d)``."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm Llama block ``(B, N, d) -> (B, N, d)`` (SPEC §2.3)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                 rope_theta: float = 10000.0, norm_eps: float = 1e-5):
        super().__init__()
        self.input_layernorm = RMSNorm(d_model, eps=norm_eps)
        self.self_attn = LlamaAttention(d_model, n_heads, n_kv_heads, head_dim, rope_theta)
        self.post_attention_layernorm = RMSNorm(d_model, eps=norm_eps)
        self.mlp = LlamaMLP(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    """Llama decoder ``idx (B, N) -> (logits (B, N, V), loss or None)``; init N(0, 0.02) for every matrix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(
            LlamaBlock(c.d_model, c.n_heads, c.resolved_n_kv_heads, c.resolved_head_dim, c.resolved_d_ff,
                       c.rope_theta, c.norm_eps) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=c.init_std)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embedding_params(self) -> list[nn.Parameter]:
        return [self.embed_tokens.weight]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx (B, N)`` int64 → ``(logits (B, N, V), loss or None)``. Raises ``ValueError`` on bad ids/length."""
        self.check_input(idx, targets)
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return logits, self.lm_loss(logits, targets)
