"""NRGPT option families as registries: attention energies (docs/nrgpt.md §2) and feed-forward
energies (docs/nrgpt.md §3).

:data:`NRGPT_ATTENTIONS` — how the per-head interaction ``J_h`` of
``E_A = −(1/β) Σ_h α_h log Σ_{B∈ctx(A)} exp(β g_Bᵀ J_h g_A)`` is parameterized. Each entry owns
``J``'s parameters, the head weights α (``learn_alpha``), the β default, the mask, its keys and
queries (what a cache slot holds) and the energy / analytic gradient through
:mod:`energyformer.energies.nrgpt`.

:data:`FF_ENERGIES` — the feed-forward energy ``E_FF`` (σ = exact GELU; biases as in the
reference code); an entry lists its projections and names its pure energy/gradient functions.

The entries and what each is: the ``attention`` and ``ff`` tables of docs/architecture.md,
generated from the registries (``python -m energyformer.utils.registry``).

Adding an entry: subclass :class:`NRGPTAttention` / :class:`FFEnergy` and register it;
``tests/layers/test_registries.py`` checks every registered entry (causality, autograd identity,
gradcheck w.r.t. every parameter).
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_float, check_int
from energyformer.energies import nrgpt as E
from energyformer.utils.registry import Registry

__all__ = ["NRGPT_ATTENTIONS", "FF_ENERGIES", "MASKS", "NRGPTAttention", "FFEnergy"]

#: the attention masks (model option ``mask``): ``"strict"`` B < A (the paper), ``"inclusive"`` B ≤ A
MASKS = ("strict", "inclusive")

NRGPT_ATTENTIONS: Registry[type[NRGPTAttention]] = Registry(
    "attention", "NRGPT attention energies (model option `attention`)", "docs/nrgpt.md §2")
FF_ENERGIES: Registry[type[FFEnergy]] = Registry(
    "ff", "NRGPT feed-forward energies (model option `ff`)", "docs/nrgpt.md §3")


class _OneGroup(nn.Module):
    """An entry whose parameters form one accounting group, named :attr:`group`."""

    group: ClassVar[str] = ""

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by accounting group: ``{group: every parameter of the entry}``."""
        return {self.group: list(self.parameters())}


class NRGPTAttention(_OneGroup):
    """Base class of an NRGPT attention energy (per-token energy and partial gradient).

    Args:
        d_model, n_heads: ``d``, ``H``. head_dim: ``d_h`` (entries that factor ``J``).
        beta: inverse temperature (default :meth:`default_beta`). learn_alpha: α is a Parameter
            (init 1) or a fixed buffer of ones. mask: ``"strict"`` (B < A) or ``"inclusive"`` (B ≤ A).

    Attributes:
        use_reference: ``False`` (default): :meth:`grad` and :meth:`energy` take the fast path (SDPA
            with ``is_causal=True``; the strict mask as a shifted inclusive one, docs/nrgpt.md §2);
            ``True``: the plain ``*_reference`` functions (explicit masked softmax over ``N × N``),
            equal to rounding (tests only; not saved with the weights).

    Raises:
        ValueError: bad sizes, ``beta <= 0``, unknown mask.
    """

    name: ClassVar[str] = ""
    section: ClassVar[str] = "docs/nrgpt.md §2"
    group = "attention"  # J (or its factors) and α
    use_reference: bool = False

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, beta: float | None = None,
                 learn_alpha: bool = True, mask: str = "strict"):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        check_int("head_dim", head_dim, 1)
        self.mask = check_choice("mask", mask, MASKS)
        self.strict = mask == "strict"  # what the pure functions take
        if not isinstance(learn_alpha, bool):
            raise ValueError(f"learn_alpha={learn_alpha!r} must be a bool")
        self.beta = check_float("beta", self.default_beta(head_dim) if beta is None else beta, 0.0, strict=True)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self._make_params(d_model, n_heads, head_dim)
        if learn_alpha:
            self.alpha = nn.Parameter(torch.ones(n_heads))
        else:
            self.register_buffer("alpha", torch.ones(n_heads), persistent=False)

    @classmethod
    def default_beta(cls, head_dim: int) -> float:
        """β when none is given."""
        return 1.0

    def _make_params(self, d_model: int, n_heads: int, head_dim: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def grad(self, g: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:  # pragma: no cover
        """``∂E_AT/∂g`` per token, ``(B, N, d)`` (dropout on the attention weights when > 0)."""
        raise NotImplementedError

    def energy(self, g: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover
        """Per-token ``E_AT`` ``(B, N)`` with queries from ``g`` and keys from ``context`` (default ``g``);
        ``grad`` is its derivative w.r.t. ``g`` at ``context = g`` with the context held fixed."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Reference-code init of parameters that are not ``nn.Linear`` weights (``N(0, 0.02²)``)."""

    # cached decoding (docs/architecture.md §5): the keys of a step are cached, the queries are new
    def keys(self, g: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Keys (= values) of the tokens ``g`` ``(B, N, d)``: ``(B, H, N, e)``, what a step's cache slot holds."""
        raise NotImplementedError

    def queries(self, g: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Queries ``(B, H, N, e)`` of ``g`` ``(B, N, d)``, scored against :meth:`keys` (score ``β q·k``)."""
        raise NotImplementedError

    def out_weight(self) -> torch.Tensor | None:
        """``(H, e, d)`` map of the attended keys back to ``d`` (factored ``W^Q``), or None (``e = d``)."""
        return None

    def grad_from_keys(self, g: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``∂E_AT/∂g`` ``(B, N, d)`` of the last ``N`` positions given every position's ``keys``
        ``(B, H, S, e)``; equals :meth:`grad` on the whole sequence (no dropout)."""
        return E.attention_force_from_keys(self.queries(g), keys, self.alpha, self.beta, self.strict, self.out_weight())

    def energy_from_keys(self, g: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Per-token ``E_AT`` ``(B, N)`` of the last ``N`` positions given every position's ``keys``."""
        return E.attention_energy_from_keys(self.queries(g), keys, self.alpha, self.beta, self.strict)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, beta={self.beta:.4g}, mask={self.mask!r}"


@NRGPT_ATTENTIONS.register("full")
class FullAttention(NRGPTAttention):
    """One free ``J_h ∈ R^{d×d}`` per head (``J`` (H, d, d)); keys ``k_{hB} = J_hᵀ g_B``."""

    def _make_params(self, d_model: int, n_heads: int, head_dim: int) -> None:
        self.J = nn.Parameter(torch.empty(n_heads, d_model, d_model))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.J, mean=0.0, std=0.02)

    def grad(self, g: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        fn = E.attention_grad_reference if self.use_reference else E.attention_grad
        return fn(g, self.J, self.alpha, self.beta, self.strict, dropout_p=dropout_p)

    def energy(self, g: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        fn = E.attention_energy_reference if self.use_reference else E.attention_energy
        return fn(g, self.J, self.alpha, self.beta, self.strict, context=context)

    def keys(self, g: torch.Tensor) -> torch.Tensor:
        return E.attention_keys(g, self.J)

    def queries(self, g: torch.Tensor) -> torch.Tensor:
        return g.unsqueeze(1).expand(-1, self.n_heads, -1, -1)


@NRGPT_ATTENTIONS.register("factored")
class FactoredAttention(NRGPTAttention):
    """``J_h = W^K_hᵀ W^Q_h`` with ``q_proj``, ``k_proj`` (H·d_h, d); ``β = 1/sqrt(d_h)`` by default."""

    @classmethod
    def default_beta(cls, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)

    def _make_params(self, d_model: int, n_heads: int, head_dim: int) -> None:
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)

    def _qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        H, dh, d = self.n_heads, self.head_dim, self.d_model
        return self.q_proj.weight.view(H, dh, d), self.k_proj.weight.view(H, dh, d)

    def grad(self, g: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        fn = E.attention_grad_factored_reference if self.use_reference else E.attention_grad_factored
        return fn(g, *self._qk(), self.alpha, self.beta, self.strict, dropout_p=dropout_p)

    def energy(self, g: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        fn = E.attention_energy_factored_reference if self.use_reference else E.attention_energy_factored
        return fn(g, *self._qk(), self.alpha, self.beta, self.strict, context=context)

    def keys(self, g: torch.Tensor) -> torch.Tensor:
        return E.head_projection(g, self._qk()[1])

    def queries(self, g: torch.Tensor) -> torch.Tensor:
        return E.head_projection(g, self._qk()[0])

    def out_weight(self) -> torch.Tensor:
        return self._qk()[0]


class FFEnergy(_OneGroup):
    """Base class of an NRGPT feed-forward energy (per token; no context).

    An entry lists its projections in :attr:`projections` as ``(name, in, out)`` with sizes
    ``"d"`` (``d_model``) or ``"M"`` (``d_ff``); each is an ``nn.Linear`` with bias (reference
    code), and :meth:`weights` passes ``(W, b)`` of each, in that order, to the entry's pure
    ``energy_fn`` / ``grad_fn``.

    Args:
        d_model: ``d``. d_ff: hidden size ``M``.
    """

    name: ClassVar[str] = ""
    section: ClassVar[str] = "docs/nrgpt.md §3"
    group = "ff"  # every projection's weight and bias
    projections: ClassVar[tuple[tuple[str, str, str], ...]] = ()

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("d_ff", d_ff, 1)
        self.d_model, self.d_ff = d_model, d_ff
        size = {"d": d_model, "M": d_ff}
        for proj, n_in, n_out in self.projections:
            setattr(self, proj, nn.Linear(size[n_in], size[n_out]))

    def weights(self) -> tuple:
        """``(W, b)`` of every projection, flattened in :attr:`projections` order."""
        return tuple(t for proj, _, _ in self.projections for t in (getattr(self, proj).weight,
                                                                     getattr(self, proj).bias))

    def energy(self, g: torch.Tensor) -> torch.Tensor:
        """Per-token ``E_FF`` ``(B, N)`` at ``g`` ``(B, N, d)``."""
        return self.energy_fn(g, *self.weights())

    def grad(self, g: torch.Tensor) -> torch.Tensor:
        """``∂E_FF/∂g`` ``(B, N, d)`` (analytic)."""
        return self.grad_fn(g, *self.weights())

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"


@FF_ENERGIES.register("ff1")
class FF1(FFEnergy):
    """``E = −‖σ(W g + b)‖²``, ``∂E/∂g = −2 Wᵀ(σ(z) ⊙ σ'(z))`` (``up_proj`` = W)."""

    projections = (("up_proj", "d", "M"),)
    energy_fn, grad_fn = staticmethod(E.ff1_energy), staticmethod(E.ff1_grad)


@FF_ENERGIES.register("ff2w")
class FF2W(FFEnergy):
    """``E = −gᵀ(W² σ(W¹ g + b¹) + b²)``, ``∂E/∂g = −(W² σ(z) + b²) − W¹ᵀ(σ'(z) ⊙ W²ᵀ g)``
    (``up_proj`` = W¹, ``down_proj`` = W²)."""

    projections = (("up_proj", "d", "M"), ("down_proj", "M", "d"))
    energy_fn, grad_fn = staticmethod(E.ff2w_energy), staticmethod(E.ff2w_grad)


@FF_ENERGIES.register("ff2")
class FF2(FFEnergy):
    """``E = −‖σ(W^b σ(W^a g + a) + b)‖²`` with ``W^a`` (d, d) = ``in_proj`` and ``W^b`` (M, d) =
    ``up_proj`` (reference ``GradFeedForward_2Lay``)."""

    projections = (("in_proj", "d", "d"), ("up_proj", "d", "M"))
    energy_fn, grad_fn = staticmethod(E.ff2_energy), staticmethod(E.ff2_grad)
