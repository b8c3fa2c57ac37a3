"""Standard (non-energy) Transformer layers of the baselines (docs/baselines.md §3).

GPT (nanoGPT-style): ``CausalSelfAttention`` (fused qkv, no bias; output projection with bias),
``MLP`` (``Linear(d, d_ff) → act → Linear(d_ff, d)`` with biases; ``act`` is ``"relu"``, the NRGPT
reference code, or ``"gelu"``, GPT-2) and the pre-norm ``GPTBlock`` (sequential or parallel).

Llama: ``LlamaAttention`` (RoPE, optional GQA, no biases), ``LlamaMLP`` (SwiGLU) and the
pre-norm ``LlamaBlock`` (RMSNorm). Parameter names follow Hugging Face's ``LlamaForCausalLM``
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``,
``input_layernorm``, ``post_attention_layernorm``) so weights map one to one.

Every attention takes an optional ``cache`` (docs/architecture.md §5): its keys and values
(Llama: per key/value head, before the GQA repeat) go to slot ``layer_idx`` and the new tokens
sit at positions ``offset …``; without a cache the code path is the plain one.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_divides, check_float, check_int, check_width
from energyformer.energies.heads import apply_rope, merge_heads, sdpa_causal_kwargs, split_heads
from energyformer.layers.norms import RMSNorm
from energyformer.layers.rope import RotaryEmbedding

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention ``(B, N, d) -> (B, N, d)``: a branch output (``o_proj`` of the
    attention), which the block adds to the residual stream.

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``; dropout outside [0, 1).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, proj_bias: bool = True):
        super().__init__()
        head_dim = check_width(d_model, n_heads)
        check_float("dropout", dropout, 0.0, maximum=0.999)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=proj_bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0) -> torch.Tensor:
        """``x`` (B, N, d) -> (B, N, d). With ``cache``, keys/values (B, H, N, d_h) are appended to
        slot ``layer_idx`` and the queries attend to everything the slot holds."""
        q, k, v = (split_heads(t, self.n_heads) for t in self.qkv_proj(x).split(x.shape[-1], dim=2))
        mask = {"is_causal": True}
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
            mask = sdpa_causal_kwargs(q.shape[2], k.shape[2], x.device)
        y = F.scaled_dot_product_attention(q, k, v, **mask, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.o_proj(merge_heads(y)))


class MLP(nn.Module):
    """Position-wise MLP ``(B, N, d) -> (B, N, d)``: ``Linear(d, d_ff) → act → Linear(d_ff, d)``, a
    branch output that the block adds to the residual stream."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", dropout: float = 0.0, bias: bool = True):
        super().__init__()
        check_int("d_ff", d_ff, 1)
        check_choice("activation", activation, ACTIVATIONS)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(self.act(self.up_proj(x))))


class GPTBlock(nn.Module):
    """Pre-norm GPT block ``(B, N, d) -> (B, N, d)`` (docs/baselines.md §3): returns the updated
    residual stream (the input plus both branches).

    ``parallel=False``: ``x ← x + Attn(LN₁x); x ← x + MLP(LN₂x)`` (GPT / GPT_Rec).
    ``parallel=True``: ``x ← x + Attn(LN₁x) + MLP(LN₂x)`` (GPT-J style; GPT_Rec_parallel).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, activation: str = "gelu",
                 dropout: float = 0.0, bias: bool = True, parallel: bool = False):
        super().__init__()
        self.parallel = parallel
        self.ln_1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, proj_bias=bias)
        self.ln_2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, d_ff, activation, dropout, bias=bias)

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0) -> torch.Tensor:
        """``x`` (B, N, d) -> (B, N, d); ``cache``/``layer_idx`` go to the attention."""
        if self.parallel:
            return x + self.attn(self.ln_1(x), cache, layer_idx) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), cache, layer_idx)
        return x + self.mlp(self.ln_2(x))


class LlamaAttention(nn.Module):
    """Causal multi-head attention with RoPE and optional GQA, ``(B, N, d) -> (B, N, d)``: a branch
    output that the block adds to the residual stream.

    Raises:
        ValueError: ``n_kv_heads`` not dividing ``n_heads``, odd ``head_dim``.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, rope_theta: float = 10000.0):
        super().__init__()
        check_divides("n_kv_heads", n_kv_heads, "n_heads", n_heads)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0) -> torch.Tensor:
        """``x`` (B, N, d) at positions ``offset … offset+N−1`` -> (B, N, d). With ``cache``, the
        rotated keys and the values (B, n_kv_heads, N, d_h) are appended to slot ``layer_idx``."""
        cos, sin = self.rotary(x.shape[1], device=x.device, dtype=x.dtype, start=offset)
        q = apply_rope(split_heads(self.q_proj(x), self.n_heads), cos, sin)
        k = apply_rope(split_heads(self.k_proj(x), self.n_kv_heads), cos, sin)
        v = split_heads(self.v_proj(x), self.n_kv_heads)
        mask = {"is_causal": True}
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
            mask = sdpa_causal_kwargs(q.shape[2], k.shape[2], x.device)
        if self.n_kv_heads != self.n_heads:  # GQA: each key/value head serves n_heads // n_kv_heads query heads
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, **mask)
        return self.o_proj(merge_heads(y))


class LlamaMLP(nn.Module):
    """SwiGLU ``W_down(SiLU(W_gate x) ⊙ W_up x)``, ``(B, N, d) -> (B, N, d)``: a branch output."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        check_int("d_ff", d_ff, 1)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm Llama block ``(B, N, d) -> (B, N, d)`` (docs/baselines.md §3): returns the updated
    residual stream (the input plus both branches)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                 rope_theta: float = 10000.0, norm_eps: float = 1e-5):
        super().__init__()
        self.input_layernorm = RMSNorm(d_model, eps=norm_eps)
        self.self_attn = LlamaAttention(d_model, n_heads, n_kv_heads, head_dim, rope_theta)
        self.post_attention_layernorm = RMSNorm(d_model, eps=norm_eps)
        self.mlp = LlamaMLP(d_model, d_ff)

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0) -> torch.Tensor:
        """``x`` (B, N, d) at positions ``offset …`` -> (B, N, d); ``cache`` goes to the attention."""
        x = x + self.self_attn(self.input_layernorm(x), cache, layer_idx, offset)
        return x + self.mlp(self.post_attention_layernorm(x))
