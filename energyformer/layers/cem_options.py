"""CEM option families as registries: interactions (docs/cem.md §2–§4) and MLP ties (docs/cem.md §3).

:data:`INTERACTIONS` — the interaction energy of the attention sub-block, by default the form of
the interaction matrices ``A_k(i, j)`` of ``ε_att(g_i | ĥ) = −Σ_k τ log Σ_{j≤i} exp(g_iᵀ A_k(i, j) ĥ_j / τ)``.
:data:`MLP_TIES` — the gated-MLP energy variant (which projection the down projection is tied to).
The entries and what each is: ``python -m energyformer.utils.registry`` (the tables of
docs/architecture.md are generated from the registries).

Each entry implements a small protocol and owns its math (it calls the pure functions of its own
form in :mod:`energyformer.energies.cem`; nothing below the registry dispatches on its name):

* an interaction: ``context(h_hat, cache=None, layer_idx=0, offset=0)`` (what it computes once
  from ``ĥ``, and what its cache slot holds: :meth:`Interaction.cache_entry` /
  :meth:`Interaction.context_from_cache`), ``grad(g, h_hat, ctx)``, ``energy(g, h_hat)`` and
  ``param_groups()`` (its parameters by accounting group);
* an MLP tie: ``context``, ``grad``, ``energy`` (both ties use the sub-block's ``gate_proj`` and
  ``up_proj``, so a tie owns no parameters).

Adding an entry: subclass :class:`Interaction` (or :class:`MLPTie`), decorate it with
``@INTERACTIONS.register("name")`` and every config, recipe and CLI flag accepts ``"name"``;
``tests/layers/test_registries.py`` then checks it (causality, autograd identity, gradcheck w.r.t. every
parameter) automatically. A module outside the package is loaded by
:func:`energyformer.utils.plugins.load_plugins` (``imports:`` of a run config).
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_int
from energyformer.energies import cem as E
from energyformer.energies.cem import InteractionContext
from energyformer.energies.heads import merge_heads, split_heads
from energyformer.layers.rope import RotaryEmbedding
from energyformer.utils.registry import Registry

__all__ = ["INTERACTIONS", "MLP_TIES", "ROPE_CHOICES", "Interaction", "MLPTie", "LowRankInteraction",
           "DiagSharedInteraction", "DiagPerHeadInteraction", "DiagOnlyInteraction"]

INTERACTIONS: Registry[type[Interaction]] = Registry(
    "interaction", "CEM attention interaction energies (model option `interaction`)", "docs/cem.md §4")
MLP_TIES: Registry[type[MLPTie]] = Registry(
    "mlp_tie", "CEM gated-MLP energies (model option `mlp_tie`)", "docs/cem.md §3")
ROPE_CHOICES = ("exact", "llama", None)


class Interaction(nn.Module):
    """Base class of a CEM interaction: the parameters of its energy, its context, gradient and energy.

    The base class builds ``q_proj``/``k_proj`` (when :attr:`has_lowrank`), the RoPE tables and the
    low-rank keys/values context with its cache layout; a subclass gives :meth:`grad` and
    :meth:`energy` (and overrides the rest when its energy needs another context).

    Args:
        d_model, n_heads, head_dim: ``d``, ``H``, ``d_h``; temperature ``τ = sqrt(d_h)``.
        rope: ``"exact"``, ``"llama"`` or ``None`` (docs/cem.md §3); ``rope_theta`` its base.

    Raises:
        ValueError: see :meth:`check_options`.
    """

    name: ClassVar[str] = ""
    #: the entry has the low-rank term (``q_proj``, ``k_proj``)
    has_lowrank: ClassVar[bool] = True
    #: local parameter names exempt from weight decay
    no_weight_decay: ClassVar[tuple[str, ...]] = ()

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, rope: str | None = None,
                 rope_theta: float = 10000.0):
        super().__init__()
        self.check_options(d_model=d_model, n_heads=n_heads, head_dim=head_dim, rope=rope)
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.tau = math.sqrt(head_dim)
        self.rope_mode = rope
        self.exact_rope = rope != "llama"
        self.rotary = RotaryEmbedding(head_dim, rope_theta) if rope is not None else None
        if self.has_lowrank:
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
            self.k_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        else:
            self.q_proj = self.k_proj = None
        self.diag = self._make_diag(d_model, n_heads)

    @classmethod
    def check_options(cls, *, d_model: int, n_heads: int, head_dim: int, rope: str | None) -> None:
        """Validate the options (used by model configs and by the constructor).

        Raises:
            ValueError: sizes < 1, unknown ``rope``, odd ``head_dim`` with RoPE, RoPE on an entry
                without a low-rank term.
        """
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        check_int("head_dim", head_dim, 1)
        check_choice("rope", rope, ROPE_CHOICES)
        if rope is not None and not cls.has_lowrank:
            raise ValueError(f"rope rotates the low-rank term; interaction={cls.name!r} has none, so set rope=None")
        if rope is not None and head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even with rope={rope!r} (features are rotated in pairs)")

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter | None:
        """The D+LR diagonal (zero at init, so the entry starts as plain tied attention), or None."""
        return None

    def weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(W_Q, W_K)``, each ``(H·d_h, d)``, or ``(None, None)`` without a low-rank term."""
        if self.q_proj is None:
            return None, None
        return self.q_proj.weight, self.k_proj.weight

    def rope_tables(self, h_hat: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE ``(cos, sin)`` for the positions ``offset …`` of ``h_hat`` (B, N, d), or None without RoPE."""
        if self.rotary is None:
            return None
        return self.rotary(h_hat.shape[1], device=h_hat.device, dtype=h_hat.dtype, start=offset)

    # -------------------------------------------------------------------------- the protocol
    def context(self, h_hat: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0) -> InteractionContext:
        """What the sub-block computes once from ``ĥ`` (B, N, d) and reuses at every step.

        With ``cache`` (docs/architecture.md §5) ``h_hat`` holds the new tokens at positions
        ``offset …``; :meth:`cache_entry` of their context goes to slot ``layer_idx`` and the
        returned context (:meth:`context_from_cache`) covers every cached position, its ``rope``
        holding the tables of the new positions (for the queries).
        """
        w_k = self.weights()[1]
        ctx = E.interaction_context(h_hat, w_k, self.n_heads, rope=self.rope_tables(h_hat, offset),
                                    exact_rope=self.exact_rope)
        if cache is None:
            return ctx
        keys, values = cache.update(*self.cache_entry(ctx), layer_idx)
        return self.context_from_cache(keys, values, ctx)

    def cache_entry(self, ctx: InteractionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, value)`` ``(B, H, N, e)`` that the cache slot holds for the new tokens of ``ctx``:
        the keys ``R_j W_K ĥ_j`` and a value tensor that is empty when the values are the keys (no
        RoPE or exact RoPE), else the un-rotated keys."""
        value = ctx.v if ctx.v is not ctx.k else ctx.k.new_empty(*ctx.k.shape[:-1], 0)
        return ctx.k, value

    def context_from_cache(self, keys: torch.Tensor, values: torch.Tensor,
                           new: InteractionContext) -> InteractionContext:
        """The context over every cached position from the slot's ``keys``/``values`` ``(B, H, S, e)``
        (inverse of :meth:`cache_entry`); ``new`` is the context of the new tokens (its ``rope``)."""
        return InteractionContext(None, keys, values if values.shape[-1] else keys, new.rope, new.exact_rope)

    def grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:  # pragma: no cover
        """``∇_g ε_att`` (B, N, d) at ``g`` (B, N, d) with context ``ĥ`` held fixed (``ctx`` from :meth:`context`)."""
        raise NotImplementedError

    def energy(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor | None:  # pragma: no cover
        """Per-token ``ε_att`` (B, N) of ``g`` given ``ĥ``, or None when the update is not a gradient."""
        raise NotImplementedError

    def fold_step_map(self, ctx: InteractionContext, step_map) -> InteractionContext | None:
        """``ctx`` with the linear step map ``M`` (the preconditioner) folded in, so that
        :meth:`grad` returns ``M(∇_g ε_att)`` with no per-token work for ``M`` at each step
        (:func:`energyformer.energies.cem.fold_step_map`), or None when the entry has no folded form
        (the default: the sub-block then applies ``M`` to each step's gradient, the plain path)."""
        return None

    def energy_from_context(self, g: torch.Tensor, ctx: InteractionContext) -> torch.Tensor | None:
        """Per-token ``ε_att`` (B, N) of ``g`` (the last ``N`` positions) against ``ctx`` (from
        :meth:`context`, cached or not), or None when the entry has none (then an energy-based exit
        or ``accept_lower_energy`` needs ``use_cache=False``; docs/inference_compute.md §4)."""
        return None

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by accounting group: ``projections`` (W_Q, W_K) and ``diag`` (the D+LR diagonal)."""
        w_q, w_k = self.weights()
        return {"projections": [w for w in (w_q, w_k) if w is not None],
                "diag": [] if self.diag is None else [self.diag]}

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, rope={self.rope_mode!r}"


@INTERACTIONS.register("lowrank")
class LowRankInteraction(Interaction):
    """Weight-tied attention ``A_k(i, j) = (R_i W^Q_k)ᵀ R_j W^K_k`` (values = keys, output = queryᵀ)."""

    section = "docs/cem.md §2"

    def grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:
        return E.lowrank_grad(g, ctx, self.q_proj.weight, self.n_heads, self.tau)

    def fold_step_map(self, ctx: InteractionContext, step_map) -> InteractionContext | None:
        """The output weight ``M(W_Q)`` (see :meth:`Interaction.fold_step_map`); None for a subclass
        that overrides :meth:`grad` (its gradient need not read ``ctx.w_out``)."""
        if type(self).grad is not LowRankInteraction.grad:
            return None
        return E.fold_step_map(ctx, step_map, self.q_proj.weight)

    def energy(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor | None:
        """Per-token ``ε_att`` (B, N), or None for ``rope="llama"`` (not the gradient of an energy)."""
        if not self.exact_rope:
            return None
        w_q, w_k = self.weights()
        return E.interaction_energy(g, h_hat, w_q, w_k, self.n_heads, diag=self.diag, rope=self.rope_tables(h_hat),
                                    tau=self.tau)

    def energy_from_context(self, g: torch.Tensor, ctx: InteractionContext) -> torch.Tensor | None:
        """:meth:`energy` from the context (its cached keys): the energy in cached decoding."""
        if not self.exact_rope:
            return None
        return E.interaction_energy_from_context(g, ctx, self.weights()[0], self.n_heads, diag=self.diag, tau=self.tau)


class _DiagInteraction(LowRankInteraction):
    """A D+LR interaction: its cache slot also holds ``ĥ`` (its diagonal term attends to ``ĥ``)."""

    def fold_step_map(self, ctx: InteractionContext, step_map) -> InteractionContext | None:
        """None: a per-head diagonal's values would differ per head (the shared one overrides this)."""
        return None

    def _h_to_heads(self, h: torch.Tensor) -> torch.Tensor:
        """ĥ (B, N, d) as a per-head tensor for the cache: split (B, H, N, d/H) or repeated (B, H, N, d)."""
        if self.d_model % self.n_heads == 0:
            return split_heads(h, self.n_heads)
        return h[:, None].expand(-1, self.n_heads, -1, -1)

    def _h_from_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_h_to_heads`: (B, N, d)."""
        return merge_heads(t) if self.d_model % self.n_heads == 0 else t[:, 0]

    def cache_entry(self, ctx: InteractionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[R_j W_K ĥ_j ; ĥ_j]`` per head (only ``ĥ`` without a low-rank term) and the values
        as in :meth:`Interaction.cache_entry`."""
        h = self._h_to_heads(ctx.h)
        if ctx.k is None:
            return h, h.new_empty(*h.shape[:-1], 0)
        return torch.cat((ctx.k, h), dim=-1), super().cache_entry(ctx)[1]

    def context_from_cache(self, keys: torch.Tensor, values: torch.Tensor,
                           new: InteractionContext) -> InteractionContext:
        dk = 0 if new.k is None else self.head_dim
        k = None if new.k is None else keys[..., :dk]
        v = values if values.shape[-1] else k
        return InteractionContext(self._h_from_heads(keys[..., dk:]), k, v, new.rope, new.exact_rope)


@INTERACTIONS.register("diag_shared")
class DiagSharedInteraction(_DiagInteraction):
    """D+LR with one diagonal shared by all heads: ``A_k = low rank + diag(d)``, ``d`` (d,) zero at init.

    The gradient's path is chosen by device (:func:`energyformer.energies.cem.diag_shared_grad`):
    augmented heads through SDPA off the CPU (no (B, H, N, N) scores), the dense scores on the
    CPU; both are fast paths, exact, and ``force_attention_path("sdpa" | "scores")``
    (:mod:`energyformer.energies.heads`) forces one, as for every energy attention (docs/cem.md §4).
    The attribute ``sdpa`` that forced it for one entry is deprecated (a ``DeprecationWarning``;
    it still forces the path); it never selected the plain reference, which is
    ``interaction_grad_reference``.
    """

    section = "docs/cem.md §4"
    _sdpa: bool | None = None  # the deprecated per-entry override of the path (None: by device)

    @property
    def sdpa(self) -> bool | None:
        """Deprecated: use ``energyformer.energies.heads.force_attention_path("sdpa" | "scores")``."""
        _warn_sdpa()
        return self._sdpa

    @sdpa.setter
    def sdpa(self, value: bool | None) -> None:
        _warn_sdpa()
        self._sdpa = value

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.zeros(d_model))

    def grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:
        return E.diag_shared_grad(g, ctx, self.q_proj.weight, self.diag, self.n_heads, self.tau, sdpa=self._sdpa)

    def fold_step_map(self, ctx: InteractionContext, step_map) -> InteractionContext | None:
        """``M(W_Q)`` and the diagonal's values ``M(d ⊙ ĥ)`` (see :meth:`Interaction.fold_step_map`);
        None for a cached context (no ``ĥ`` of every position) and for a subclass that overrides
        :meth:`grad`."""
        if ctx.h is None or type(self).grad is not DiagSharedInteraction.grad:
            return None
        return E.fold_step_map(ctx, step_map, self.q_proj.weight, self.diag)


def _warn_sdpa() -> None:
    warnings.warn("DiagSharedInteraction.sdpa is deprecated: force the attention path with "
                  "energyformer.energies.heads.force_attention_path('sdpa' | 'scores') (sdpa=True is 'sdpa', "
                  "False is 'scores')", DeprecationWarning, stacklevel=3)


@INTERACTIONS.register("diag_per_head")
class DiagPerHeadInteraction(_DiagInteraction):
    """D+LR with one diagonal per head: ``A_k = low rank + diag(d_k)``, ``d`` (H, d) zero at init.

    Not weight-decayed (a decayed per-head diagonal would be pulled to zero while the 1-D shared
    one is not, which would bias the ablation).
    """

    section = "docs/cem.md §4"
    no_weight_decay = ("diag",)

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.zeros(n_heads, d_model))

    def grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:
        return E.diag_per_head_grad(g, ctx, self.q_proj.weight, self.diag, self.n_heads, self.tau)


@INTERACTIONS.register("diag_only")
class DiagOnlyInteraction(DiagPerHeadInteraction):
    """Ablation: per-head diagonals only, ``A_k = diag(d_k)`` (no ``q_proj``/``k_proj``, no RoPE).

    Per head, because one shared diagonal would make every head identical. The diagonals start at
    ``N(0, 0.02²)``, not 0: with equal (zero) diagonals every head gets the same gradient and the
    heads stay identical for ever (there is no low-rank term to break the symmetry).
    """

    has_lowrank = False
    init_std: ClassVar[float] = 0.02

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.randn(n_heads, d_model) * self.init_std)

    def grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:
        return E.diag_only_grad(g, ctx, self.diag, self.tau)


class MLPTie:
    """Base class of an MLP tie: one gated-MLP energy variant (docs/cem.md §3).

    Both variants use ``w_gate`` and ``w_up`` (``(d_ff, d)``, owned by the sub-block); they differ in
    which one the down projection is tied to (:attr:`tied`). An entry names its pure functions
    (``context_fn``, ``energy_fn``, ``grad_fn`` of :mod:`energyformer.energies.cem`).
    """

    name: ClassVar[str] = ""
    section: ClassVar[str] = "docs/cem.md §3"
    #: the projection whose transpose is the down projection ("gate_proj" or "up_proj")
    tied: ClassVar[str] = ""

    @classmethod
    def context(cls, h_hat: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        """The fixed multiplicative branch (B, N, d_ff) from ``ĥ`` (B, N, d)."""
        return cls.context_fn(h_hat, w_gate, w_up)

    @classmethod
    def folds_step_map(cls) -> bool:
        """Whether :meth:`grad` takes ``w_out`` (the output weight in place of the :attr:`tied` one), so
        that a linear preconditioner folds into it (``M(∇) = −a M(W)``): the base :meth:`grad` with a
        ``grad_fn`` that has a ``w_out`` parameter, or an overriding :meth:`grad` that has one. A tie
        written for the earlier signature gets the preconditioner applied to each gradient instead.
        Read once per class (a sub-block asks at every call)."""
        return _takes_w_out(cls)

    @classmethod
    def grad(cls, g: torch.Tensor, h_hat: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
             ctx: torch.Tensor, w_out: torch.Tensor | None = None) -> torch.Tensor:
        """``∇_g ε_mlp`` (B, N, d); ``M(∇_g ε_mlp)`` with ``w_out = M(W)``, ``W`` the :attr:`tied`
        projection's weight and ``M`` a linear step map (docs/cem.md §5)."""
        if w_out is None:
            return cls.grad_fn(g, h_hat, w_gate, w_up, context=ctx)
        return cls.grad_fn(g, h_hat, w_gate, w_up, context=ctx, w_out=w_out)

    @classmethod
    def energy(cls, g: torch.Tensor, h_hat: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        """Per-token ``ε_mlp`` (B, N)."""
        return cls.energy_fn(g, h_hat, w_gate, w_up)


@functools.cache
def _takes_w_out(tie: type[MLPTie]) -> bool:
    """:meth:`MLPTie.folds_step_map` of ``tie``, cached per class (``inspect.signature`` is not free)."""
    grad = tie.grad.__func__
    fn = tie.grad_fn if grad is MLPTie.grad.__func__ else grad
    try:
        return "w_out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@MLP_TIES.register("gate")
class GateTie(MLPTie):
    """Variant A: ``ε = −Σ_m (W_U ĥ)_m F(w^gate_m·g)``, ``F = ∫SiLU``; down projection = ``gate_projᵀ``."""

    tied = "gate_proj"
    context_fn = staticmethod(E.gate_tie_context)
    energy_fn, grad_fn = staticmethod(E.gate_tie_energy), staticmethod(E.gate_tie_grad)


@MLP_TIES.register("up")
class UpTie(MLPTie):
    """Variant B: ``ε = −½ Σ_m SiLU(w^gate_m·ĥ) (w^up_m·g)²``; down projection = ``up_projᵀ``."""

    tied = "up_proj"
    context_fn = staticmethod(E.up_tie_context)
    energy_fn, grad_fn = staticmethod(E.up_tie_energy), staticmethod(E.up_tie_grad)
