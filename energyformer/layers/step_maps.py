"""Step maps: the learnable linear map ``M`` applied to an energy gradient before the step.

CEM's preconditioner ``P`` (``x ← x − η P ∇ε``, docs/cem.md §5) and NRGPT's inference-rate
matrix ``η`` (``x ← x − η ∂E/∂g``, docs/nrgpt.md §4) are one idea: a per-token linear map
``v ↦ M v`` (row form ``v @ Mᵀ``) of the gradient. Both models choose it from one registry,
:data:`STEP_MAPS`; CEM's ``preconditioner:`` and NRGPT's ``eta_param:`` take the same names.

Every map is built as ``cls(d_model, scale=s, rank=r, norm=norm)`` and starts near ``s·I``
(exactly ``s·I`` for all but ``full`` and ``psd_plus_skew``, which add small random parts). The
entries, their ``M`` and where each is defined: ``python -m energyformer.utils.registry`` (the
``step_map`` table of docs/architecture.md is generated from :data:`STEP_MAPS`).

A map owns its parameters, its validation (:meth:`StepMap.check_options`), its defaults
(``default_scale``, ``scale_positive``) and its weight-decay exemptions (``no_weight_decay``).
:meth:`StepMap.matrix` builds the dense ``d×d`` matrix for tests and inspection; ``forward`` never
forms it for the structured maps.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_int
from energyformer.utils.registry import Registry

__all__ = ["STEP_MAPS", "StepMap", "preconditioner", "inv_softplus", "make_step_map"]

STEP_MAPS: Registry[type[StepMap]] = Registry(
    "step_map", "step maps: CEM `preconditioner` and NRGPT `eta_param`", "docs/cem.md §5")


def inv_softplus(y: float) -> float:
    """``x`` with ``softplus(x) = y`` (``y > 0``), computed stably for small and large ``y``."""
    return y + math.log(-math.expm1(-y))


class StepMap(nn.Module):
    """Base class of a step map ``(…, d) -> (…, d)``, ``v ↦ M v``.

    Args:
        d_model: ``d``.
        scale: ``s``; the map starts near ``s·I`` (default: the entry's ``default_scale``).
        rank: ``r`` of a low-rank part (used by the low-rank entries only).
        norm: the norm whose weight γ the map may use (``c_diag_gamma``); else ignored.

    Raises:
        ValueError: see :meth:`check_options`.
    """

    name: ClassVar[str] = ""
    section: ClassVar[str] = "docs/cem.md §5"
    #: default ``s`` when a model gives none (NRGPT's ``c_init``)
    default_scale: ClassVar[float] = 0.1
    #: ``s`` must be > 0 (``True``) or only >= 0
    scale_positive: ClassVar[bool] = True
    #: local parameter names exempt from weight decay (read by the optimizer)
    no_weight_decay: ClassVar[tuple[str, ...]] = ()
    #: the map needs ``norm.weight`` (γ)
    needs_norm_weight: ClassVar[bool] = False
    uses_rank: ClassVar[bool] = False

    #: the map's parameters as ``(name, dims)``, dims from ``"d"`` (d_model) and ``"r"`` (rank);
    #: created (uninitialised) by the base class, then set by :meth:`reset_parameters`
    param_shapes: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, d_model: int, scale: float | None = None, *, rank: int = 8,
                 norm: nn.Module | None = None):
        super().__init__()
        scale = self.default_scale if scale is None else scale
        self.check_options(d_model=d_model, scale=scale, rank=rank, has_norm_weight=norm is not None
                           and getattr(norm, "weight", None) is not None)
        self.d_model, self.scale, self.rank = d_model, float(scale), rank
        # a plain reference, not a sub-module: the norm's parameters belong to the caller
        object.__setattr__(self, "_norm", norm)
        size = {"d": d_model, "r": rank}
        for name, dims in self.param_shapes:
            setattr(self, name, nn.Parameter(torch.empty(tuple(size[c] for c in dims))))
        self.reset_parameters()

    @classmethod
    def check_options(cls, *, d_model: int, scale: float | None = None, rank: int = 8,
                      has_norm_weight: bool = True, rank_name: str = "rank", scale_name: str = "scale") -> None:
        """Validate the options a model passes (used by configs and by the constructor).

        Raises:
            ValueError: ``d_model < 1``; ``scale`` not finite, negative, or 0 where the entry needs
                ``scale > 0``; ``rank < 1`` or ``rank >= d_model`` for a low-rank entry; a map that
                uses γ without a norm that has one.
        """
        check_int("d_model", d_model, 1)
        if scale is not None:
            if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
                    and (scale > 0 or (scale == 0 and not cls.scale_positive))):
                need = "> 0" if cls.scale_positive else ">= 0"
                raise ValueError(f"{scale_name}={scale!r} must be a finite number {need} for step map {cls.name!r} "
                                 f"(the map starts near {scale_name}·I)")
        if cls.uses_rank:
            check_int(rank_name, rank, 1)
            if rank >= d_model:
                raise ValueError(f"{rank_name}={rank} must be < d_model={d_model} for step map {cls.name!r}: "
                                 "the low-rank part is meant to be lightweight (a rank >= d costs more than a "
                                 "full d×d matrix)")
        if cls.needs_norm_weight and not has_norm_weight:
            raise ValueError(f"step map {cls.name!r} needs a norm with a scale γ; with norm=None (or a norm "
                             "without weight) use 'c_identity' or 'psd_plus_skew'")

    def forward(self, v: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def matrix(self) -> torch.Tensor:  # pragma: no cover - abstract
        """The dense ``M`` (d, d), for tests and inspection (never the hot path)."""
        raise NotImplementedError

    @torch.no_grad()
    def reset_parameters(self) -> None:  # pragma: no cover - abstract
        """Set the init (near ``scale·I``)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, scale={self.scale:g}" + (f", rank={self.rank}" if self.uses_rank else "")


# ------------------------------------------------------------------------------- diagonal family

@STEP_MAPS.register("diag")
class DiagMap(StepMap):
    """``M = diag(softplus(p))`` (positive definite); ``p = softplus⁻¹(s)`` at init, so ``M = s·I``."""

    param_shapes = (("p", "d"),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.p.fill_(inv_softplus(self.scale))

    def diagonal(self) -> torch.Tensor:
        """``softplus(p)`` (d,)."""
        return F.softplus(self.p)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.diagonal().to(v.dtype)

    def matrix(self) -> torch.Tensor:
        return torch.diag(self.diagonal())


@STEP_MAPS.register("diag_lowrank")
class DiagLowRankMap(DiagMap):
    """``M = diag(softplus(p)) + U Vᵀ + V Uᵀ`` (the CEM paper's preconditioner).

    Symmetric but **indefinite** in general: ``UVᵀ + VUᵀ = ½[(U+V)(U+V)ᵀ − (U−V)(U−V)ᵀ]``.
    Init: ``U ~ N(0, 0.02²)``, ``V = 0``, so ``M = s·I``; ``∂M/∂V ≠ 0`` at ``V = 0`` and the
    low-rank part learns at once. Cost ``O(d·r)`` per token.
    """

    no_weight_decay = ("u", "v")
    uses_rank = True
    init_std: ClassVar[float] = 0.02
    param_shapes = (("p", "d"), ("u", "dr"), ("v", "dr"))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.p.fill_(inv_softplus(self.scale))
        self.u.normal_(0.0, self.init_std)
        self.v.zero_()

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        # UVᵀ + VUᵀ = [U V][V U]ᵀ: one (d, 2r) product pair instead of two (d, r) pairs
        left = torch.cat((self.v, self.u), dim=1).to(v.dtype)
        right = torch.cat((self.u, self.v), dim=1).to(v.dtype)
        return v * self.diagonal().to(v.dtype) + (v @ left) @ right.t()

    def matrix(self) -> torch.Tensor:
        return torch.diag(self.diagonal()) + self.u @ self.v.t() + self.v @ self.u.t()


@STEP_MAPS.register("diag_lowrank_psd")
class DiagLowRankPSDMap(DiagMap):
    """``M = diag(softplus(p)) + L Lᵀ`` (positive definite).

    ``L = 0`` would be a dead init (``L ↦ LLᵀ`` has zero derivative at 0), so ``L`` starts with
    orthogonal columns: ``L[i_c, c] = ε`` (``ε = 0.1·sqrt(s)``) on ``r`` distinct coordinates
    ``i_c`` spread over ``0 … d−1`` (:meth:`psd_rows`), and the diagonal is lowered there to
    ``s − ε²``. Then ``M = s·I`` exactly (up to rounding) while ``∂/∂L`` is non-zero.
    """

    no_weight_decay = ("lr_factor",)
    uses_rank = True
    psd_init: ClassVar[float] = 0.1
    param_shapes = (("p", "d"), ("lr_factor", "dr"))

    def psd_rows(self) -> list[int]:
        """The ``r`` distinct coordinates ``i_c`` carrying the init of ``L``."""
        return [(c * self.d_model) // self.rank for c in range(self.rank)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        s = self.scale
        eps = self.psd_init * math.sqrt(s)
        self.p.fill_(inv_softplus(s))
        self.lr_factor.zero_()
        rows = torch.tensor(self.psd_rows(), device=self.p.device)
        cols = torch.arange(self.rank, device=self.p.device)
        self.lr_factor[rows, cols] = eps
        self.p[rows] = inv_softplus(s - eps * eps)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        lf = self.lr_factor.to(v.dtype)
        return v * self.diagonal().to(v.dtype) + (v @ lf) @ lf.t()

    def matrix(self) -> torch.Tensor:
        return torch.diag(self.diagonal()) + self.lr_factor @ self.lr_factor.t()


# ------------------------------------------------------------------------------- NRGPT family

@STEP_MAPS.register("full")
class FullMap(StepMap):
    """A free ``d×d`` matrix ``weight``: ``M = s·I + W₀`` with ``W₀ ~ N(0, 0.02²)`` (a bias-free linear map).

    With ``s = 0`` (its default) this is exactly the NRGPT reference code's ``eta`` init.
    Neither symmetric nor definite: no descent guarantee (docs/nrgpt.md §5).
    """

    section = "docs/nrgpt.md §5"

    default_scale = 0.0
    scale_positive = False
    init_std: ClassVar[float] = 0.02
    param_shapes = (("weight", "dd"),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.scale:
            self.weight.add_(self.scale * torch.eye(self.d_model, dtype=self.weight.dtype, device=self.weight.device))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return F.linear(v, self.weight.to(v.dtype))

    def matrix(self) -> torch.Tensor:
        return self.weight


class _ScalarMap(StepMap):
    """``c = softplus(c_raw)``, ``c = s`` at init."""

    section = "docs/nrgpt.md §5"

    param_shapes = (("c_raw", ""),)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.c_raw.fill_(inv_softplus(self.scale))

    @property
    def c(self) -> torch.Tensor:
        """``c = softplus(c_raw)`` (0-dim)."""
        return F.softplus(self.c_raw)


@STEP_MAPS.register("c_identity")
class CIdentityMap(_ScalarMap):
    """``M = c·I`` (``c = softplus(c_raw) > 0``): descent for a small enough ``c`` (docs/nrgpt.md §5)."""

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return self.c.to(v.dtype) * v

    def matrix(self) -> torch.Tensor:
        return self.c * torch.eye(self.d_model, dtype=self.c_raw.dtype, device=self.c_raw.device)


@STEP_MAPS.register("c_diag_gamma")
class CDiagGammaMap(_ScalarMap):
    """``M = c·diag(γ)`` with γ the weight of the norm ``g = Norm(x)``: NRGPT's provable-descent
    choice (docs/nrgpt.md §5). γ is read from ``norm`` at every call (not a copy)."""

    needs_norm_weight = True

    def gamma(self) -> torch.Tensor:
        return self._norm.weight

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return v * (self.c * self.gamma()).to(v.dtype)

    def matrix(self) -> torch.Tensor:
        return torch.diag(self.c * self.gamma())


@STEP_MAPS.register("psd_plus_skew")
class PSDPlusSkewMap(StepMap):
    """``M = L Lᵀ + S − Sᵀ`` (``L, S`` free ``d×d``): a PSD symmetric part plus a skew part
    (docs/nrgpt.md §5, the no-norm descent condition). Init ``L ~ N(0, s/d)`` so ``E[LLᵀ] = s·I``,
    ``S ~ N(0, 0.02²)``."""

    section = "docs/nrgpt.md §5"

    init_std: ClassVar[float] = 0.02
    param_shapes = (("L", "dd"), ("S", "dd"))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.L, mean=0.0, std=math.sqrt(self.scale / self.d_model))
        nn.init.normal_(self.S, mean=0.0, std=self.init_std)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        L, S = self.L.to(v.dtype), self.S.to(v.dtype)
        return (v @ L) @ L.T + v @ S.T - v @ S  # v (L Lᵀ)ᵀ + v (S − Sᵀ)ᵀ

    def matrix(self) -> torch.Tensor:
        return self.L @ self.L.T + self.S - self.S.T


# ------------------------------------------------------------------------------- factories

def make_step_map(kind: str, d_model: int, scale: float | None = None, *, rank: int = 8,
                  norm: nn.Module | None = None, option: str = "step_map") -> StepMap:
    """Build the step map registered as ``kind`` (see the module docstring).

    ``option`` is the name the caller's users know the choice by (``"preconditioner"``,
    ``"eta_param"``), used in error messages.

    Raises:
        ValueError: unknown ``kind`` (the message lists the registered ones), invalid options.
    """
    return STEP_MAPS.get(kind, option)(d_model, scale, rank=rank, norm=norm)


def preconditioner(d_model: int, kind: str = "diag_lowrank", rank: int = 8, init_scale: float = 1.0) -> StepMap:
    """CEM's preconditioner ``P`` (docs/cem.md §5): :func:`make_step_map` with ``P = init_scale·I`` at init.

    Any registered step map works (``kind``); ``rank`` is ``preconditioner_rank``.

    Raises:
        ValueError: unknown ``kind``, invalid ``rank`` or ``init_scale`` (the option names are the
            model config's: ``preconditioner``, ``preconditioner_rank``).
    """
    STEP_MAPS.get(kind, "preconditioner").check_options(d_model=d_model, scale=init_scale, rank=rank,
                                                       rank_name="preconditioner_rank")
    return make_step_map(kind, d_model, init_scale, rank=rank, option="preconditioner")

