"""CEM layers: attention and gated-MLP sub-blocks as explicit descent steps (SPEC §3).

Each sub-block maps its input ``h`` (B, N, d) to ``x^T`` by ``T = n_steps`` steps
(SPEC §3.6, pre-norm placement §3.7)::

    ĥ = Norm(h)                                   # context: computed ONCE (keys/values, MLP gate)
    x⁰ = h
    x^{t+1} = x^t − η_t · P · ∇_g ε(g | ĥ),  g = Norm(x^t)

The gradient is taken w.r.t. the normalized ``g`` and applied to the residual stream ``x``
(``grad_through_norm=True`` uses the true ``∇_x ε = J_Normᵀ ∇_g ε`` instead). At ``T = 1``,
``η = 1``, ``P = I`` the attention sub-block is Llama attention with ``v_proj = k_proj``,
``o_proj = q_projᵀ``, and the MLP sub-block is SwiGLU with ``down_proj = gate_projᵀ``
(``mlp_tie="gate"``) or ``down_proj = up_projᵀ`` (``mlp_tie="up"``).

Step size (SPEC §3.6): one learnable scalar ``η`` per sub-block shared over steps, initialized
to 1 for ``T = 1`` and ``1/T`` otherwise; with a preconditioner ``η ≡ 1`` (a buffer) and
``diag(softplus(p))`` carries the scale: ``P = (1/T)·I`` at init (``= I`` for ``T = 1``), so the
preconditioned sub-block starts exactly as the plain one. ``per_step_scale=True`` adds learnable per-step factors
``c_t`` (init 1): ``η_t = η·c_t``. All parameters are shared over the ``T`` steps.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.energies.cem import (MLP_TIES, gated_mlp_context, gated_mlp_energy, gated_mlp_grad,
                                       interaction_context, interaction_energy, interaction_grad,
                                       rms_norm_vjp)
from energyformer.layers.norms import RMSNorm
from energyformer.layers.preconditioner import PRECONDITIONERS, Preconditioner
from energyformer.layers.rope import RotaryEmbedding

INTERACTIONS = ("lowrank", "diag_shared", "diag_per_head", "diag_only")
ROPE_CHOICES = ("exact", "llama", None)
NORM_CHOICES = ("rmsnorm", None)

__all__ = ["CEMAttention", "CEMGatedMLP", "CEMBlock", "INTERACTIONS", "ROPE_CHOICES", "NORM_CHOICES"]


class _CEMSubBlock(nn.Module):
    """Shared machinery: norm, step sizes, preconditioner and the descent loop."""

    def _setup_common(self, d_model: int, n_steps: int, step_size: float | None, preconditioner: str | None,
                      preconditioner_rank: int, norm: str | None, norm_eps: float, grad_through_norm: bool,
                      learn_step_size: bool, per_step_scale: bool) -> None:
        check_int("d_model", d_model, 1)
        self.n_steps = check_int("n_steps", n_steps, 1)
        check_choice("preconditioner", preconditioner, (None,) + PRECONDITIONERS)
        check_choice("norm", norm, NORM_CHOICES)
        if grad_through_norm and norm is None:
            raise ValueError("grad_through_norm=True needs a norm; got norm=None")
        self.d_model, self.grad_through_norm = d_model, bool(grad_through_norm)
        self.norm = RMSNorm(d_model, eps=norm_eps) if norm == "rmsnorm" else None
        if preconditioner is not None:
            if step_size is not None:
                raise ValueError(f"step_size={step_size} cannot be set with preconditioner={preconditioner!r}: "
                                 "η is fixed to 1 and diag(softplus(p)) carries the scale (SPEC §3.6)")
            # P = (1/T)·I at init: the plain model's initial η (SPEC §3.5 says P = I, §3.6 says
            # η ≡ 1 with P and diag(softplus p) carries the scale; both agree at T = 1, and
            # this keeps "a preconditioned model starts as the plain one" true for T > 1).
            self.precond = Preconditioner(d_model, preconditioner, preconditioner_rank, init_scale=1.0 / n_steps)
            self.register_buffer("step_size", torch.tensor(1.0))
        else:
            self.precond = None
            eta = (1.0 if n_steps == 1 else 1.0 / n_steps) if step_size is None else \
                check_float("step_size", step_size, 0.0, strict=True)
            if learn_step_size:
                self.step_size = nn.Parameter(torch.tensor(float(eta)))
            else:
                self.register_buffer("step_size", torch.tensor(float(eta)))
        self.step_scales = nn.Parameter(torch.ones(n_steps)) if per_step_scale else None

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.norm is None else self.norm(x)

    def eta(self, t: int) -> torch.Tensor:
        """Step size ``η_t`` (0-dim) of step ``t`` (0-based)."""
        if self.step_scales is None:
            return self.step_size
        return self.step_size * self.step_scales[t]

    def _descend(self, x: torch.Tensor, grad_g: torch.Tensor, t: int) -> torch.Tensor:
        """``x − η_t P ∇`` with ``∇ = ∇_g ε`` (or ``J_Normᵀ ∇_g ε`` if ``grad_through_norm``)."""
        grad = grad_g
        if self.grad_through_norm:
            grad = rms_norm_vjp(x, grad_g, self.norm.weight.to(x.dtype), self.norm.eps)
        if self.precond is not None:
            grad = self.precond(grad)
        return torch.addcmul(x, self.eta(t).to(x.dtype), grad, value=-1.0)  # x − η_t·grad, one kernel

    def _run(self, x: torch.Tensor, trace: list[dict[str, Any]] | None, name: str) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{name} expects x of shape (B, N, d_model={self.d_model}); got {tuple(x.shape)}")
        h_hat = self._normalize(x)
        ctx = self._context(h_hat)
        g = h_hat
        for t in range(self.n_steps):
            if trace is not None:
                trace.append(self._trace_entry(name, t, x, g, h_hat))
            x = self._descend(x, self._grad(g, h_hat, ctx), t)
            if t + 1 < self.n_steps or trace is not None:
                g = self._normalize(x)
        if trace is not None:
            trace.append(self._trace_entry(name, self.n_steps, x, g, h_hat))
        return x

    @torch.no_grad()
    def _trace_entry(self, name: str, t: int, x: torch.Tensor, g: torch.Tensor, h_hat: torch.Tensor) -> dict[str, Any]:
        return {"sub": name, "step": t, "x": x.detach(), "energy": self._energy_or_none(g, h_hat)}

    def energy(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Per-token energy (B, N) of the state ``x`` given the sub-block input ``h`` (both (B, N, d)).

        Evaluates ``ε(Norm(x) | Norm(h))`` (or ``ε(x | h)`` with ``norm=None``); for monitoring and tests.

        Raises:
            ValueError: the layer computes no energy (attention with ``rope="llama"``).
        """
        e = self._energy_or_none(self._normalize(x), self._normalize(h))
        if e is None:
            raise ValueError("rope='llama' attention is not the gradient of an energy; use rope='exact' or None")
        return e


class CEMAttention(_CEMSubBlock):
    """CEM attention sub-block ``(B, N, d) -> (B, N, d)``: T descent steps on ``ε_att`` (SPEC §3.2–§3.6).

    Parameters: ``q_proj.weight``, ``k_proj.weight`` (n_heads·head_dim, d_model) (no value or
    output projection: ``W_V = W_K``, ``W_O = W_Qᵀ``), the D+LR diagonal ``diag`` ((d,) shared
    or (n_heads, d) per head; zero at init), ``step_size`` η, optional ``step_scales`` (T,),
    optional ``precond``, and the sub-block's own ``norm`` (RMSNorm).

    Args:
        d_model, n_heads: width ``d`` and heads ``H``.
        head_dim: ``d_h`` (default ``d_model // n_heads``); temperature ``τ = sqrt(d_h)``.
        n_steps: recursion ``T ≥ 1``.
        step_size: initial η (> 0); default 1 for T=1, 1/T otherwise. Not allowed with a preconditioner.
        interaction: "lowrank" (tied attention), "diag_shared" (D+LR, one diagonal),
            "diag_per_head" (D+LR, one diagonal per head), "diag_only" (ablation: per-head
            diagonals, no low-rank term and no q/k projections).
        rope: "exact" (true gradient of the rotated energy), "llama" (Llama's computation) or None.
        rope_theta: RoPE base.
        preconditioner: None, "diag", "diag_lowrank", "diag_lowrank_psd"; ``preconditioner_rank`` r.
        norm: "rmsnorm" or None (raw energy on x; for tests of §3.9); ``norm_eps``.
        grad_through_norm: use ``J_Normᵀ ∇_g ε`` (SPEC §3.7 alternative).
        learn_step_size: η is a Parameter (else a fixed buffer).
        per_step_scale: learnable per-step factors ``c_t``.

    Raises:
        ValueError: ``n_steps < 1``; ``n_heads`` not dividing ``d_model`` (when ``head_dim`` is
            None); step size ≤ 0; unknown option; odd ``head_dim`` with RoPE; RoPE with
            "diag_only"; ``step_size`` given with a preconditioner.
    """

    no_weight_decay = ("diag",)  # read by train.optim.param_groups

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None, n_steps: int = 1,
                 step_size: float | None = None, *, interaction: str = "lowrank", rope: str | None = None,
                 rope_theta: float = 10000.0, preconditioner: str | None = None, preconditioner_rank: int = 8,
                 norm: str | None = "rmsnorm", norm_eps: float = 1e-5, grad_through_norm: bool = False,
                 learn_step_size: bool = True, per_step_scale: bool = False):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        if head_dim is None:
            check_divides("n_heads", n_heads, "d_model", d_model)
            head_dim = d_model // n_heads
        check_int("head_dim", head_dim, 1)
        check_choice("interaction", interaction, INTERACTIONS)
        check_choice("rope", rope, ROPE_CHOICES)
        if rope is not None and interaction == "diag_only":
            raise ValueError("rope rotates the low-rank term; interaction='diag_only' has none, so set rope=None")
        self._setup_common(d_model, n_steps, step_size, preconditioner, preconditioner_rank, norm, norm_eps,
                           grad_through_norm, learn_step_size, per_step_scale)
        self.n_heads, self.head_dim, self.interaction = n_heads, head_dim, interaction
        self.tau = math.sqrt(head_dim)
        self.rope_mode = rope
        self.rotary = RotaryEmbedding(head_dim, rope_theta) if rope is not None else None
        if interaction != "diag_only":
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
            self.k_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        else:
            self.q_proj = self.k_proj = None
        if interaction == "diag_shared":
            self.diag = nn.Parameter(torch.zeros(d_model))
        elif interaction in ("diag_per_head", "diag_only"):
            self.diag = nn.Parameter(torch.zeros(n_heads, d_model))
        else:
            self.diag = None

    def _weights(self):
        if self.q_proj is None:
            return None, None
        return self.q_proj.weight, self.k_proj.weight

    def _rope(self, h_hat: torch.Tensor):
        if self.rotary is None:
            return None
        return self.rotary(h_hat.shape[1], device=h_hat.device, dtype=h_hat.dtype)

    def _context(self, h_hat: torch.Tensor):
        w_q, w_k = self._weights()
        rope = self._rope(h_hat)
        return interaction_context(h_hat, w_k, self.n_heads, rope=rope, rope_mode=self.rope_mode or "exact")

    def _grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx) -> torch.Tensor:
        w_q, w_k = self._weights()
        return interaction_grad(g, h_hat, w_q, w_k, self.n_heads, diag=self.diag, rope=ctx.rope,
                                rope_mode=ctx.rope_mode, tau=self.tau, context=ctx)

    def _energy_or_none(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor | None:
        if self.rope_mode == "llama":
            return None
        w_q, w_k = self._weights()
        return interaction_energy(g, h_hat, w_q, w_k, self.n_heads, diag=self.diag, rope=self._rope(h_hat),
                                  tau=self.tau)

    def forward(self, x: torch.Tensor, trace: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """``x`` (B, N, d) -> ``x^T`` (B, N, d).

        ``trace``: if a list is given, one dict per state ``t = 0 … T`` is appended:
        ``{"sub": "attn", "step": t, "x": x^t, "energy": ε_att(Norm(x^t) | ĥ) (B, N) or None}``
        (detached; for inspection, not the hot path).

        Raises:
            ValueError: ``x`` not (B, N, d_model).
        """
        return self._run(x, trace, "attn")

    def extra_repr(self) -> str:
        return (f"n_heads={self.n_heads}, head_dim={self.head_dim}, n_steps={self.n_steps}, "
                f"interaction={self.interaction!r}, rope={self.rope_mode!r}, "
                f"grad_through_norm={self.grad_through_norm}")


class CEMGatedMLP(_CEMSubBlock):
    """CEM gated-MLP sub-block ``(B, N, d) -> (B, N, d)``: T descent steps on ``ε_mlp`` (SPEC §3.3, §3.6).

    Parameters: ``gate_proj.weight`` and ``up_proj.weight`` (d_ff, d_model); the down projection
    is the transpose of the tied one (``gate_proj`` for ``mlp_tie="gate"``, ``up_proj`` for
    ``mlp_tie="up"``); the other projection feeds the fixed multiplicative branch from ``ĥ``.

    Args:
        d_model, d_ff: widths. n_steps, step_size, preconditioner, preconditioner_rank, norm,
        norm_eps, grad_through_norm, learn_step_size, per_step_scale: as in :class:`CEMAttention`.
        mlp_tie: "gate" (variant A, default) or "up" (variant B).

    Raises:
        ValueError: ``n_steps < 1``, ``d_ff < 1``, step size ≤ 0, unknown option.
    """

    def __init__(self, d_model: int, d_ff: int, n_steps: int = 1, step_size: float | None = None, *,
                 mlp_tie: str = "gate", preconditioner: str | None = None, preconditioner_rank: int = 8,
                 norm: str | None = "rmsnorm", norm_eps: float = 1e-5, grad_through_norm: bool = False,
                 learn_step_size: bool = True, per_step_scale: bool = False):
        super().__init__()
        check_int("d_ff", d_ff, 1)
        self.mlp_tie = check_choice("mlp_tie", mlp_tie, MLP_TIES)
        self._setup_common(d_model, n_steps, step_size, preconditioner, preconditioner_rank, norm, norm_eps,
                           grad_through_norm, learn_step_size, per_step_scale)
        self.d_ff = d_ff
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)

    def _context(self, h_hat: torch.Tensor) -> torch.Tensor:
        return gated_mlp_context(h_hat, self.gate_proj.weight, self.up_proj.weight, self.mlp_tie)

    def _grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return gated_mlp_grad(g, h_hat, self.gate_proj.weight, self.up_proj.weight, self.mlp_tie, context=ctx)

    def _energy_or_none(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor:
        return gated_mlp_energy(g, h_hat, self.gate_proj.weight, self.up_proj.weight, self.mlp_tie)

    def forward(self, x: torch.Tensor, trace: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """``x`` (B, N, d) -> ``x^T`` (B, N, d); ``trace`` as in :meth:`CEMAttention.forward` (``"sub": "mlp"``).

        Raises:
            ValueError: ``x`` not (B, N, d_model).
        """
        return self._run(x, trace, "mlp")

    def extra_repr(self) -> str:
        return f"d_ff={self.d_ff}, n_steps={self.n_steps}, mlp_tie={self.mlp_tie!r}"


class CEMBlock(nn.Module):
    """One CEM layer ``(B, N, d) -> (B, N, d)``: attention sub-block, then MLP sub-block (SPEC §3.1, §3.8).

    Keyword arguments are passed to :class:`CEMAttention` (``interaction``, ``rope``,
    ``rope_theta``, ``head_dim``) and :class:`CEMGatedMLP` (``mlp_tie``); the shared ones
    (``preconditioner``, ``preconditioner_rank``, ``norm``, ``norm_eps``, ``grad_through_norm``,
    ``learn_step_size``, ``per_step_scale``) go to both. ``attn_n_steps``/``mlp_n_steps`` and
    ``attn_step_size``/``mlp_step_size`` are per sub-block.

    Raises:
        ValueError: any invalid option (see the sub-blocks).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, head_dim: int | None = None,
                 attn_n_steps: int = 1, mlp_n_steps: int = 1, attn_step_size: float | None = None,
                 mlp_step_size: float | None = None, interaction: str = "lowrank", rope: str | None = None,
                 rope_theta: float = 10000.0, mlp_tie: str = "gate", preconditioner: str | None = None,
                 preconditioner_rank: int = 8, norm: str | None = "rmsnorm", norm_eps: float = 1e-5,
                 grad_through_norm: bool = False, learn_step_size: bool = True, per_step_scale: bool = False):
        super().__init__()
        shared = dict(preconditioner=preconditioner, preconditioner_rank=preconditioner_rank, norm=norm,
                      norm_eps=norm_eps, grad_through_norm=grad_through_norm, learn_step_size=learn_step_size,
                      per_step_scale=per_step_scale)
        self.attn = CEMAttention(d_model, n_heads, head_dim, attn_n_steps, attn_step_size, interaction=interaction,
                                 rope=rope, rope_theta=rope_theta, **shared)
        self.mlp = CEMGatedMLP(d_model, d_ff, mlp_n_steps, mlp_step_size, mlp_tie=mlp_tie, **shared)

    def forward(self, x: torch.Tensor, trace: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """``x`` (B, N, d) -> (B, N, d); ``trace`` collects both sub-blocks' states (see :class:`CEMAttention`)."""
        return self.mlp(self.attn(x, trace), trace)
