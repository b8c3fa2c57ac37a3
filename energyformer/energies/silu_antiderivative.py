"""The antiderivative of SiLU and the real dilogarithm it needs (docs/cem.md §3, docs/testing.md §12).

``F(z) = ∫ SiLU = z·softplus(z) + Li₂(−e^z)``, with ``F' = SiLU`` and ``F(0) = −π²/12``.
``F`` is only used to *evaluate* the CEM MLP energy (monitoring, tests); the update uses SiLU.

``Li₂`` is implemented here in plain torch for real arguments ``x ≤ 0`` (all CEM needs):

* ``−1 ≤ x ≤ 0``: Landen's identity ``Li₂(x) = −Li₂(y) − ½ log²(1 − x)`` with
  ``y = x/(x − 1) ∈ [0, ½]``, and the power series ``Li₂(y) = Σ_k y^k / k²`` (60 terms:
  truncation error below ``2^-61/60² ≈ 1e-22``).
* ``x < −1``: inversion ``Li₂(x) = −π²/6 − ½ log²(−x) − Li₂(1/x)`` brings ``1/x`` into ``(−1, 0)``.

For ``x = −e^z`` these become ``y = sigmoid(z)`` and ``log(1 − x) = softplus(z)``, which
:func:`silu_antiderivative` uses directly so that no ``e^z`` is ever formed (no overflow).
Accuracy in float64: ~1e-15 relative (tested against mpmath).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_N_TERMS = 60
PI2_6 = math.pi ** 2 / 6.0


def _li2_series(y: torch.Tensor) -> torch.Tensor:
    """``Σ_{k=1}^{60} y^k / k²`` for ``0 ≤ y ≤ ½`` (Horner form)."""
    acc = torch.zeros_like(y)
    for k in range(_N_TERMS, 0, -1):
        acc = (acc + 1.0 / (k * k)) * y
    return acc


def _li2_neg_exp_nonpos(z: torch.Tensor) -> torch.Tensor:
    """``Li₂(−e^z)`` for ``z ≤ 0`` via Landen: ``−Li₂(sigmoid z) − ½ softplus(z)²``."""
    return -_li2_series(torch.sigmoid(z)) - 0.5 * F.softplus(z) ** 2


def dilog_neg_exp(z: torch.Tensor) -> torch.Tensor:
    """``Li₂(−e^z)`` for any real ``z`` (any shape; float64 recommended).

    For ``z > 0`` uses the inversion ``Li₂(−e^z) = −π²/6 − ½ z² − Li₂(−e^{−z})``.
    """
    zn = torch.where(z > 0, -z, z)  # ≤ 0 everywhere
    base = _li2_neg_exp_nonpos(zn)
    return torch.where(z > 0, -PI2_6 - 0.5 * z * z - base, base)


def dilog(x: torch.Tensor) -> torch.Tensor:
    """Real dilogarithm ``Li₂(x)`` for ``x ≤ 0`` (any shape).

    Raises:
        ValueError: some ``x > 0`` (outside the implemented range).
    """
    if bool((x > 0).any()):
        raise ValueError(f"dilog is implemented for x <= 0 only; got max x = {float(x.max())}")
    # Li₂(0) = 0; log(−x) of 0 would be −inf, so treat it separately.
    zero = x == 0
    z = torch.log(torch.where(zero, torch.full_like(x, -1.0), -x))
    return torch.where(zero, torch.zeros_like(x), dilog_neg_exp(z))


def silu_antiderivative(z: torch.Tensor) -> torch.Tensor:
    """``F(z) = z·softplus(z) + Li₂(−e^z)``, the antiderivative of SiLU with ``F(0) = −π²/12``.

    Shape-preserving. For ``z > 0`` the algebraically equal, cancellation-free form
    ``z²/2 + z·softplus(−z) − π²/6 − Li₂(−e^{−z})`` is used.
    """
    zn = -z.abs()
    li_n = _li2_neg_exp_nonpos(zn)  # Li₂(−e^{−|z|})
    neg = z * F.softplus(z) + li_n
    pos = 0.5 * z * z + z * F.softplus(-z) - PI2_6 - li_n
    return torch.where(z > 0, pos, neg)
