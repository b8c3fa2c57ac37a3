"""CEM option families as registries: interactions (docs/cem.md §2–§4) and MLP ties (docs/cem.md §3).

:data:`INTERACTIONS` — the form of the interaction matrices ``A_k(i, j)`` of the attention energy
``ε_att(g_i | ĥ) = −Σ_k τ log Σ_{j≤i} exp(g_iᵀ A_k(i, j) ĥ_j / τ)``. Each entry is an
``nn.Module`` that owns its parameters, checks its options, computes the keys/values context, the
analytic gradient and the energy through the pure functions of :mod:`energyformer.energies.cem`,
and reports its parameters by group for accounting:

* ``lowrank``        ``A_k = (R_i W^Q_k)ᵀ R_j W^K_k``: weight-tied attention (``q_proj``, ``k_proj``).
* ``diag_shared``    low rank + one diagonal ``diag(d)`` shared by the heads (``diag`` (d,)).
* ``diag_per_head``  low rank + one diagonal per head (``diag`` (H, d)).
* ``diag_only``      per-head diagonals only (ablation; no projections, no RoPE).

:data:`MLP_TIES` — which projection the down projection is tied to in the gated-MLP energy. Both
entries use the same two parameters (``gate_proj``, ``up_proj``, owned by the sub-block), so an
entry owns no parameters: it is the energy/gradient pair of its variant.

Adding an entry: subclass :class:`Interaction` (or :class:`MLPTie`), decorate it with
``@INTERACTIONS.register("name")`` and every config, recipe and CLI flag accepts ``"name"``;
``tests/test_registries.py`` then checks it (causality, autograd identity) automatically.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_int
from energyformer.energies.cem import (InteractionContext, gated_mlp_context, gated_mlp_energy, gated_mlp_grad,
                                       interaction_context, interaction_energy, interaction_grad)
from energyformer.energies.heads import merge_heads, split_heads
from energyformer.layers.rope import RotaryEmbedding
from energyformer.utils.registry import Registry

__all__ = ["INTERACTIONS", "MLP_TIES", "ROPE_CHOICES", "Interaction", "MLPTie"]

INTERACTIONS: Registry[type["Interaction"]] = Registry("interaction")
MLP_TIES: Registry[type["MLPTie"]] = Registry("mlp_tie")
ROPE_CHOICES = ("exact", "llama", None)


class Interaction(nn.Module):
    """Base class of a CEM interaction: the parameters of ``A_k(i, j)`` and their energy/gradient.

    Args:
        d_model, n_heads, head_dim: ``d``, ``H``, ``d_h``; temperature ``τ = sqrt(d_h)``.
        rope: ``"exact"``, ``"llama"`` or ``None`` (docs/cem.md §3); ``rope_theta`` its base.

    Raises:
        ValueError: see :meth:`check_options`.
    """

    name: ClassVar[str] = ""
    #: the D+LR form passed to the pure functions ("none", "shared", "per_head")
    diag_mode: ClassVar[str] = "none"
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

    def rope_tables(self, h_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE ``(cos, sin)`` for ``h_hat`` (B, N, d), or None without RoPE."""
        if self.rotary is None:
            return None
        return self.rotary(h_hat.shape[1], device=h_hat.device, dtype=h_hat.dtype)

    def context(self, h_hat: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0) -> InteractionContext:
        """Keys and values from the fixed context ``ĥ`` (B, N, d), computed once per sub-block.

        With ``cache`` (docs/architecture.md §5) ``h_hat`` holds the new tokens at positions
        ``offset …``; their keys go to slot ``layer_idx`` as one key tensor
        ``[R_j W_K ĥ_j ; ĥ_j]`` per head (the ``ĥ`` part only with a diagonal term; ``ĥ`` split
        over the heads when ``H`` divides ``d``, else repeated) and a value tensor that is empty
        when the values are the keys (no RoPE or exact RoPE) and the un-rotated keys in llama
        mode. The returned context covers every cached position; its ``rope`` holds the tables
        of the new positions (for the queries).
        """
        _, w_k = self.weights()
        mode = self.rope_mode or "exact"
        if cache is None:
            return interaction_context(h_hat, w_k, self.n_heads, rope=self.rope_tables(h_hat), rope_mode=mode)
        rope = None if self.rotary is None else self.rotary(h_hat.shape[1], device=h_hat.device,
                                                            dtype=h_hat.dtype, start=offset)
        new = interaction_context(h_hat, w_k, self.n_heads, rope=rope, rope_mode=mode)
        keep_h = new.k is None or self.diag_mode != "none"
        parts = [t for t in (new.k, self._h_to_heads(h_hat) if keep_h else None) if t is not None]
        key = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        value = new.v if new.v is not new.k else key.new_empty(*key.shape[:-1], 0)
        keys, values = cache.update(key, value, layer_idx)
        dk = 0 if new.k is None else self.head_dim
        k = None if new.k is None else keys[..., :dk]
        h = self._h_from_heads(keys[..., dk:]) if keep_h else None
        v = values if values.shape[-1] else k
        return InteractionContext(h, k, v, rope, mode)

    def _h_to_heads(self, h: torch.Tensor) -> torch.Tensor:
        """ĥ (B, N, d) as a per-head tensor for the cache: split (B, H, N, d/H) or repeated (B, H, N, d)."""
        if self.d_model % self.n_heads == 0:
            return split_heads(h, self.n_heads)
        return h[:, None].expand(-1, self.n_heads, -1, -1)

    def _h_from_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_h_to_heads`: (B, N, d)."""
        return merge_heads(t) if self.d_model % self.n_heads == 0 else t[:, 0]

    def grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:
        """``∇_g ε_att`` (B, N, d) at ``g`` (B, N, d) with context ``ĥ`` held fixed."""
        w_q, w_k = self.weights()
        return interaction_grad(g, h_hat, w_q, w_k, self.n_heads, diag=self.diag, rope=ctx.rope,
                                rope_mode=ctx.rope_mode, tau=self.tau, context=ctx, diag_mode=self.diag_mode)

    def energy(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor | None:
        """Per-token ``ε_att`` (B, N), or None for ``rope="llama"`` (not the gradient of an energy)."""
        if self.rope_mode == "llama":
            return None
        w_q, w_k = self.weights()
        return interaction_energy(g, h_hat, w_q, w_k, self.n_heads, diag=self.diag, rope=self.rope_tables(h_hat),
                                  tau=self.tau, diag_mode=self.diag_mode)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by accounting group: ``projections`` (W_Q, W_K) and ``diag`` (the D+LR diagonal)."""
        w_q, w_k = self.weights()
        return {"projections": [w for w in (w_q, w_k) if w is not None],
                "diag": [] if self.diag is None else [self.diag]}

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, head_dim={self.head_dim}, rope={self.rope_mode!r}"


@INTERACTIONS.register("lowrank")
class LowRankInteraction(Interaction):
    """Weight-tied attention: ``A_k(i, j) = (R_i W^Q_k)ᵀ R_j W^K_k`` (values = keys, output = queryᵀ)."""


@INTERACTIONS.register("diag_shared")
class DiagSharedInteraction(Interaction):
    """D+LR with one diagonal shared by all heads: ``A_k = low rank + diag(d)``, ``d`` (d,) zero at init."""

    diag_mode = "shared"

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.zeros(d_model))


@INTERACTIONS.register("diag_per_head")
class DiagPerHeadInteraction(Interaction):
    """D+LR with one diagonal per head: ``A_k = low rank + diag(d_k)``, ``d`` (H, d) zero at init.

    Not weight-decayed (a decayed per-head diagonal would be pulled to zero while the 1-D shared
    one is not, which would bias the ablation).
    """

    diag_mode = "per_head"
    no_weight_decay = ("diag",)

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.zeros(n_heads, d_model))


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


class MLPTie:
    """Base class of an MLP tie: the gated-MLP energy variant (docs/cem.md §3).

    Both variants use ``w_gate`` and ``w_up`` (``(d_ff, d)``, owned by the sub-block); they differ in
    which one the down projection is tied to (:attr:`tied`).
    """

    name: ClassVar[str] = ""
    #: the projection whose transpose is the down projection ("gate_proj" or "up_proj")
    tied: ClassVar[str] = ""

    @classmethod
    def context(cls, h_hat: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        """The fixed multiplicative branch (B, N, d_ff) from ``ĥ`` (B, N, d)."""
        return gated_mlp_context(h_hat, w_gate, w_up, cls.name)

    @classmethod
    def grad(cls, g: torch.Tensor, h_hat: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
             ctx: torch.Tensor) -> torch.Tensor:
        """``∇_g ε_mlp`` (B, N, d)."""
        return gated_mlp_grad(g, h_hat, w_gate, w_up, cls.name, context=ctx)

    @classmethod
    def energy(cls, g: torch.Tensor, h_hat: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
        """Per-token ``ε_mlp`` (B, N)."""
        return gated_mlp_energy(g, h_hat, w_gate, w_up, cls.name)


@MLP_TIES.register("gate")
class GateTie(MLPTie):
    """Variant A: ``ε = −Σ_m (W_U ĥ)_m F(w^gate_m·g)``, ``F = ∫SiLU``; down projection = ``gate_projᵀ``."""

    tied = "gate_proj"


@MLP_TIES.register("up")
class UpTie(MLPTie):
    """Variant B: ``ε = −½ Σ_m SiLU(w^gate_m·ĥ) (w^up_m·g)²``; down projection = ``up_projᵀ``."""

    tied = "up_proj"
