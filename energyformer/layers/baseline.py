"""Standard (non-energy) Transformer pieces for the GPT baselines (SPEC §2.3).

``CausalSelfAttention``: nanoGPT-style fused qkv (no bias), output projection with bias.
``MLP``: ``Linear(d, d_ff) → act → Linear(d_ff, d)`` with biases; ``act`` is ``"relu"`` (the
NRGPT reference code) or ``"gelu"`` (GPT-2).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_divides, check_float, check_int

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention ``(B, N, d) -> (B, N, d)``.

    Raises:
        ValueError: ``n_heads`` does not divide ``d_model``; dropout outside [0, 1).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, proj_bias: bool = True):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        check_divides("n_heads", n_heads, "d_model", d_model)
        check_float("dropout", dropout, 0.0, maximum=0.999)
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=proj_bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, d = x.shape
        q, k, v = self.qkv_proj(x).split(d, dim=2)
        q, k, v = (t.view(B, N, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, N, d)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """Position-wise MLP ``(B, N, d) -> (B, N, d)``: ``Linear(d, d_ff) → act → Linear(d_ff, d)``."""

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
    """Pre-norm GPT block (SPEC §2.3).

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel:
            return x + self.attn(self.ln_1(x)) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
