"""Learnable lightweight preconditioner ``P`` for CEM updates (SPEC §3.5).

``x^{t+1} = x^t − η P ∇ε``, with ``P`` a symmetric d×d map applied per token at ``O(d·r)``
cost (the d×d matrix is never formed in the forward; :meth:`Preconditioner.matrix` builds it
for tests and inspection). Kinds:

* ``"diag"``:              ``P = diag(softplus(p))`` (positive definite).
* ``"diag_lowrank"``:      ``P = diag(softplus(p)) + U Vᵀ + V Uᵀ`` (the paper's form; symmetric
  but **indefinite** in general: ``UVᵀ + VUᵀ = ½[(U+V)(U+V)ᵀ − (U−V)(U−V)ᵀ]``).
* ``"diag_lowrank_psd"``:  ``P = diag(softplus(p)) + L Lᵀ`` (positive definite: SPEC §6 option).

Init (``P = s·I`` exactly, ``s = init_scale``, default 1 as in SPEC §3.5). The CEM layers pass
``s = 1/T``, the plain model's initial step size (SPEC §3.6 fixes ``η ≡ 1`` with a preconditioner
and lets ``diag(softplus(p))`` carry the scale), so a preconditioned model starts as the plain
one for every ``T``; at ``T = 1`` this is SPEC's ``P = I``.

* ``p = softplus⁻¹(s)`` (``log(e − 1)`` for ``s = 1``).
* ``diag_lowrank``: ``U ~ N(0, 0.02²)``, ``V = 0`` (SPEC §3.5). ``∂P/∂V ≠ 0`` at ``V = 0``, so the
  low-rank term starts learning at once.
* ``diag_lowrank_psd``: ``L = 0`` would be a dead init: ``L ↦ LLᵀ`` has zero derivative at
  ``L = 0`` (``∂f/∂L = (G + Gᵀ)L = 0``), so ``L`` would never move. Instead ``L`` starts with
  orthogonal rows: ``L[i_c, c] = ε`` (``ε = psd_init·sqrt(s)``, ``psd_init`` default 0.1) on ``r``
  distinct coordinates ``i_c`` spread over ``0 … d−1`` and zero elsewhere, so
  ``LLᵀ = ε² Σ_c e_{i_c} e_{i_c}ᵀ`` is diagonal, and the diagonal is lowered there to
  ``softplus(p_{i_c}) = s − ε²``. Then ``P = s·I`` exactly (up to float rounding) while the
  gradient ``(G + Gᵀ)L`` is non-zero.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_float, check_int

PRECONDITIONERS = ("diag", "diag_lowrank", "diag_lowrank_psd")


def _softplus_inv(y: float) -> float:
    """``p`` with ``softplus(p) = y`` (y > 0)."""
    return math.log(math.expm1(y))


class Preconditioner(nn.Module):
    """Symmetric per-token map ``(…, d) -> (…, d)``, ``v ↦ P v`` (SPEC §3.5).

    Args:
        d_model: ``d``.
        kind: "diag", "diag_lowrank" or "diag_lowrank_psd".
        rank: ``r`` of the low-rank part (ignored for "diag"); ``1 ≤ r < d``.
        init_std: std of ``U`` for "diag_lowrank" (SPEC: 0.02).
        psd_init: relative size of the PSD init factor (see module docstring), in (0, 1).
        init_scale: ``s`` with ``P = s·I`` at init (> 0).

    Raises:
        ValueError: unknown ``kind``, ``rank < 1``, ``rank >= d_model`` for a low-rank kind, bad
            ``psd_init`` or ``init_scale``.
    """

    no_weight_decay = ("u", "v", "lr_factor")  # read by train.optim.param_groups

    def __init__(self, d_model: int, kind: str = "diag_lowrank", rank: int = 8, init_std: float = 0.02,
                 psd_init: float = 0.1, init_scale: float = 1.0):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_choice("preconditioner", kind, PRECONDITIONERS)
        check_int("preconditioner_rank", rank, 1)
        check_float("init_std", init_std, 0.0)
        check_float("psd_init", psd_init, 0.0, strict=True, maximum=0.999)
        check_float("init_scale", init_scale, 0.0, strict=True)
        if kind != "diag" and rank >= d_model:
            raise ValueError(f"preconditioner_rank={rank} must be < d_model={d_model}: the low-rank part is "
                             "meant to be lightweight (a rank >= d costs more than a full d×d matrix)")
        self.d_model, self.kind, self.rank = d_model, kind, rank
        self.init_std, self.psd_init, self.init_scale = init_std, psd_init, float(init_scale)
        self.p = nn.Parameter(torch.empty(d_model))
        if kind == "diag_lowrank":
            self.u = nn.Parameter(torch.empty(d_model, rank))
            self.v = nn.Parameter(torch.empty(d_model, rank))
        elif kind == "diag_lowrank_psd":
            self.lr_factor = nn.Parameter(torch.empty(d_model, rank))
        self.reset_parameters()

    def psd_rows(self) -> list[int]:
        """The ``r`` distinct coordinates ``i_c`` carrying the PSD init (spread evenly over ``d``)."""
        return [(c * self.d_model) // self.rank for c in range(self.rank)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Set ``P = s·I`` (see the module docstring for each kind)."""
        s = self.init_scale
        self.p.fill_(_softplus_inv(s))
        if self.kind == "diag_lowrank":
            self.u.normal_(0.0, self.init_std)
            self.v.zero_()
        elif self.kind == "diag_lowrank_psd":
            eps = self.psd_init * math.sqrt(s)
            self.lr_factor.zero_()
            rows = torch.tensor(self.psd_rows(), device=self.p.device)
            cols = torch.arange(self.rank, device=self.p.device)
            self.lr_factor[rows, cols] = eps
            self.p[rows] = _softplus_inv(s - eps * eps)

    def diagonal(self) -> torch.Tensor:
        """``softplus(p)`` (d,)."""
        return F.softplus(self.p)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """``P v`` per token, ``(…, d) -> (…, d)``, at ``O(d·r)`` cost (no d×d matrix)."""
        out = v * self.diagonal().to(v.dtype)
        if self.kind == "diag_lowrank":
            # UVᵀ + VUᵀ = [U V][V U]ᵀ: one (d, 2r) product pair instead of two (d, r) pairs
            left = torch.cat((self.v, self.u), dim=1).to(v.dtype)
            right = torch.cat((self.u, self.v), dim=1).to(v.dtype)
            out = out + (v @ left) @ right.t()
        elif self.kind == "diag_lowrank_psd":
            lf = self.lr_factor.to(v.dtype)
            out = out + (v @ lf) @ lf.t()
        return out

    def matrix(self) -> torch.Tensor:
        """The explicit symmetric ``P`` (d, d): for tests and inspection, never the hot path."""
        p = torch.diag(self.diagonal())
        if self.kind == "diag_lowrank":
            p = p + self.u @ self.v.t() + self.v @ self.u.t()
        elif self.kind == "diag_lowrank_psd":
            p = p + self.lr_factor @ self.lr_factor.t()
        return p

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, kind={self.kind!r}, rank={self.rank}, init_scale={self.init_scale:g}"
