"""Normalization layers used by every model (SPEC §1 notation, §3.7, §4.4).

``LayerNorm(x) = γ ⊙ (x − μ)/sqrt(var + ε) + δ`` and ``RMSNorm(x) = γ ⊙ x / sqrt(mean(x²) + ε)``.
``freeze_weight=True`` keeps γ at 1 as a non-trainable Parameter (NRGPT's ``BareLN``, SPEC §4.4).
Statistics are computed in float32 (float64 inputs stay float64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_float, check_int


class LayerNorm(nn.Module):
    """LayerNorm over the last dim ``d``: ``(…, d) -> (…, d)``.

    Args:
        d_model: feature size ``d``.
        bias: learnable shift δ (else none).
        eps: variance epsilon.
        freeze_weight: keep γ ≡ 1 (a Parameter with ``requires_grad=False``).
    """

    def __init__(self, d_model: int, bias: bool = True, eps: float = 1e-5, freeze_weight: bool = False):
        super().__init__()
        check_int("d_model", d_model, 1)
        self.eps = check_float("eps", eps, 0.0, strict=True)
        self.weight = nn.Parameter(torch.ones(d_model), requires_grad=not freeze_weight)
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x if dt == torch.float64 else x.float()
        w = self.weight.to(xf.dtype)
        b = None if self.bias is None else self.bias.to(xf.dtype)
        return F.layer_norm(xf, (xf.shape[-1],), w, b, self.eps).to(dt)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim ``d``: ``(…, d) -> (…, d)``; matches HF Llama's ``LlamaRMSNorm``."""

    def __init__(self, d_model: int, eps: float = 1e-5, freeze_weight: bool = False):
        super().__init__()
        check_int("d_model", d_model, 1)
        self.eps = check_float("eps", eps, 0.0, strict=True)
        self.weight = nn.Parameter(torch.ones(d_model), requires_grad=not freeze_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x if dt == torch.float64 else x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf.dtype) * y).to(dt)


NORMS = ("layernorm", "rmsnorm", "layernorm_frozen")


def make_norm(kind: str, d_model: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """Factory: ``"layernorm"``, ``"rmsnorm"`` or ``"layernorm_frozen"`` (γ ≡ 1, learnable δ)."""
    check_choice("norm", kind, NORMS)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps)
    return LayerNorm(d_model, bias=bias, eps=eps, freeze_weight=(kind == "layernorm_frozen"))
