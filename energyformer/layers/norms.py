"""Normalization layers used by every model and their registry (docs/cem.md §7, docs/nrgpt.md §4).

``LayerNorm(x) = γ ⊙ (x − μ)/sqrt(var + ε) + δ`` and ``RMSNorm(x) = γ ⊙ x / sqrt(mean(x²) + ε)``.
``freeze_weight=True`` keeps γ at 1 as a non-trainable Parameter (NRGPT's ``BareLN``, docs/nrgpt.md §4).
Statistics are computed in float32 (float64 inputs stay float64).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_float, check_width
from energyformer.utils.registry import Registry


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
        check_width(d_model)
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
        check_width(d_model)
        self.eps = check_float("eps", eps, 0.0, strict=True)
        self.weight = nn.Parameter(torch.ones(d_model), requires_grad=not freeze_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x if dt == torch.float64 else x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(xf.dtype) * y).to(dt)


NORMS: Registry = Registry("norm", "norms of NRGPT's `g = Norm(x)` (model option `norm`)", "docs/nrgpt.md §4")
"""Norm registry: name -> ``factory(d_model, eps) -> nn.Module | None`` (``"none"``: no norm, ``g = x``)."""


@NORMS.register("layernorm")
def _layernorm(d_model: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm with a learnable scale γ and shift (the reference code's default)."""
    return LayerNorm(d_model, eps=eps)


@NORMS.register("rmsnorm")
def _rmsnorm(d_model: int, eps: float = 1e-5) -> nn.Module:
    """RMSNorm ``γ ⊙ x / rms(x)`` with a learnable scale γ."""
    return RMSNorm(d_model, eps=eps)


@NORMS.register("layernorm_frozen")
def _layernorm_frozen(d_model: int, eps: float = 1e-5) -> nn.Module:
    """LayerNorm with γ ≡ 1 (frozen) and a learnable shift: the NRGPT reference code's ``BareLN``."""
    return LayerNorm(d_model, eps=eps, freeze_weight=True)


@NORMS.register("none")
def _no_norm(d_model: int, eps: float = 1e-5) -> None:
    """No norm: ``g = x`` (pairs with ``eta_param="psd_plus_skew"`` for the no-norm descent condition)."""
    return None


def canonical_norm(kind: str | None) -> str:
    """The registry name of a norm option: ``None`` is spelled ``"none"``.

    Raises:
        ValueError: unknown norm (the message lists the registered ones).
    """
    return NORMS.check("none" if kind is None else kind)


def make_norm(kind: str | None, d_model: int, eps: float = 1e-5) -> nn.Module | None:
    """Build the norm registered as ``kind`` (``None`` or ``"none"``: no norm, returns ``None``).

    Raises:
        ValueError: unknown ``kind``, ``d_model < 1`` or ``eps <= 0``.
    """
    return NORMS.get(canonical_norm(kind))(d_model, eps=eps)
