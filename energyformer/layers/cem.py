"""CEM layers: attention and gated-MLP sub-blocks as explicit descent steps (docs/cem.md).

Each sub-block maps its input ``h`` (B, N, d) to ``x^T`` by ``T = n_steps`` steps
(docs/cem.md §6, pre-norm placement §7)::

    ĥ = Norm(h)                                   # context: computed ONCE (keys/values, MLP gate)
    x⁰ = h
    x^{t+1} = x^t − η_t · P · ∇_g ε(g | ĥ),  g = Norm(x^t)

The gradient is taken w.r.t. the normalized ``g`` and applied to the residual stream ``x``
(``grad_through_norm=True`` uses the true ``∇_x ε = J_Normᵀ ∇_g ε`` instead). At ``T = 1``,
``η = 1``, ``P = I`` the attention sub-block is Llama attention with ``v_proj = k_proj``,
``o_proj = q_projᵀ``, and the MLP sub-block is SwiGLU with ``down_proj = gate_projᵀ``
(``mlp_tie="gate"``) or ``down_proj = up_projᵀ`` (``mlp_tie="up"``).

The options plug in from registries: the interaction form from
:data:`~energyformer.layers.cem_options.INTERACTIONS`, the MLP tie from
:data:`~energyformer.layers.cem_options.MLP_TIES`, the preconditioner ``P`` from
:data:`~energyformer.layers.step_maps.STEP_MAPS` (the same maps NRGPT uses for its η).

Step size (docs/cem.md §6): one learnable scalar ``η`` per sub-block shared over steps (the
``step_size`` parameter), initialized to 1 for ``T = 1`` and ``1/T`` otherwise; with a
preconditioner ``η ≡ 1`` (a buffer) and ``P`` carries the scale: ``P = (1/T)·I`` at init
(``= I`` for ``T = 1``), so the preconditioned sub-block starts exactly as the plain one.
``P`` is linear, so the fast path folds it into the gradient's output weight once per call
(``P(−a W) = −a P(W)``; the shared diagonal's values ``P(d ⊙ ĥ)`` likewise) instead of applying it
to every token's gradient at every step; ``fold_preconditioner = False`` on a sub-block keeps the
plain path (``P`` applied to each gradient), the reference the fast path is tested against.
``per_step_scale=True`` adds learnable per-step factors ``c_t`` (init 1): ``η_t = η·c_t``. All
parameters are shared over the ``T`` steps.

At call time ``n_steps=K`` runs ``K`` steps instead of ``T`` (the same η; with per-step factors
at most ``T``), and ``backprop_steps=k`` (training) runs the first ``K − k`` steps of the
sub-block under ``torch.no_grad()`` and keeps a graph for its last ``k`` only
(:mod:`energyformer.layers.truncation`): the state entering step ``K − k`` is detached, while the
context (keys/values, the MLP gate) computed from the sub-block input keeps its graph.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.energies.cem import rms_norm_vjp
from energyformer.layers.cem_options import INTERACTIONS, MLP_TIES, ROPE_CHOICES
from energyformer.layers.exit import ExitState, ExitView, parse_exit
from energyformer.layers.monotone import DEFAULT_MAX_HALVINGS, accept_lower_energy_step
from energyformer.layers.norms import RMSNorm
from energyformer.layers.step_maps import STEP_MAPS, make_step_map
from energyformer.layers.trace import Traceable
from energyformer.layers.truncation import first_graph_step, step_grad_mode

NORM_CHOICES = ("rmsnorm", None)

__all__ = ["CEMAttention", "CEMGatedMLP", "CEMBlock", "ROPE_CHOICES", "NORM_CHOICES"]


class _FoldedBranch(NamedTuple):
    """An MLP sub-block's context with the preconditioner folded in: the fixed multiplicative
    ``branch`` (B, N, d_ff) and the output weight ``w_out = P(W)`` (d_ff, d)."""

    branch: torch.Tensor
    w_out: torch.Tensor


class _CEMSubBlock(Traceable, nn.Module):
    """Shared machinery: norm, step size, preconditioner and the descent loop."""

    #: recompute each descent step's activations in the backward pass (set by
    #: ``energyformer.train.parallelize.apply_activation_checkpointing``; training with gradients only)
    checkpoint_steps: bool = False
    #: fold the preconditioner into the gradient's output weights once per call (the fast path; exact
    #: up to rounding) where the option has a folded form; ``False``: apply it to each step's gradient
    fold_preconditioner: bool = True

    def _setup_common(self, d_model: int, n_steps: int, step_size: float | None, preconditioner: str | None,
                      preconditioner_rank: int, norm: str | None, norm_eps: float, grad_through_norm: bool,
                      learn_step_size: bool, per_step_scale: bool) -> None:
        check_int("d_model", d_model, 1)
        self.n_steps = check_int("n_steps", n_steps, 1)
        check_choice("norm", norm, NORM_CHOICES)
        if grad_through_norm and norm is None:
            raise ValueError("grad_through_norm=True needs a norm; got norm=None")
        self.d_model, self.grad_through_norm = d_model, bool(grad_through_norm)
        self.norm = RMSNorm(d_model, eps=norm_eps) if norm == "rmsnorm" else None
        if preconditioner is not None:
            STEP_MAPS.get(preconditioner, "preconditioner").check_options(
                d_model=d_model, rank=preconditioner_rank, rank_name="preconditioner_rank",
                has_norm_weight=self.norm is not None)
            if step_size is not None:
                raise ValueError(f"step_size={step_size} cannot be set with preconditioner={preconditioner!r}: "
                                 "η is fixed to 1 and the preconditioner carries the scale (docs/cem.md §6)")
            # P = (1/T)·I at init: the plain model's initial η (docs/choices.md: the paper's P = I and
            # "η ≡ 1 with P" agree at T = 1; this keeps "a preconditioned model starts as the plain
            # one" true for T > 1).
            self.preconditioner = make_step_map(preconditioner, d_model, 1.0 / n_steps, rank=preconditioner_rank,
                                                norm=self.norm, option="preconditioner")
            self.register_buffer("step_size", torch.tensor(1.0))
        else:
            self.preconditioner = None
            eta = (1.0 if n_steps == 1 else 1.0 / n_steps) if step_size is None else \
                check_float("step_size", step_size, 0.0, strict=True)
            if learn_step_size:
                self.step_size = nn.Parameter(torch.tensor(float(eta)))
            else:
                self.register_buffer("step_size", torch.tensor(float(eta)))
        self.step_scales = nn.Parameter(torch.ones(n_steps)) if per_step_scale else None

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.norm is None else self.norm(x)

    def step_size_at(self, t: int) -> torch.Tensor:
        """Step size ``η_t = η·c_t`` (0-dim) of step ``t`` (0-based) (docs/cem.md §6).

        (``eta`` names a step *map* module in NRGPT, ``NRGPTBlock.eta``; a CEM sub-block's scalar
        step is its ``step_size`` and this method.)
        """
        if self.step_scales is None:
            return self.step_size
        return self.step_size * self.step_scales[t]

    def _descend(self, x: torch.Tensor, grad_g: torch.Tensor, t: int, preconditioned: bool = False) -> torch.Tensor:
        """``x − η_t P ∇`` with ``∇ = ∇_g ε`` (or ``J_Normᵀ ∇_g ε`` if ``grad_through_norm``);
        ``preconditioned``: ``grad_g`` is already ``P ∇_g ε`` (from a folded context, :meth:`_folded`)."""
        grad = grad_g
        if self.grad_through_norm:
            grad = rms_norm_vjp(x, grad_g, self.norm.weight.to(x.dtype), self.norm.eps)
        if self.preconditioner is not None and not preconditioned:
            grad = self.preconditioner(grad)
        return torch.addcmul(x, self.step_size_at(t).to(x.dtype), grad, value=-1.0)  # x − η_t·grad, one kernel

    #: ``(B, N)`` int64: the steps each token got in the last call with ``exit`` (else ``None``)
    exit_steps: torch.Tensor | None = None

    def _run(self, x: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0, n_steps: int | None = None,
             backprop_steps: int | None = None, exit=None, accept_lower_energy: bool = False,
             max_halvings: int = DEFAULT_MAX_HALVINGS) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"{self.trace_sub} expects x of shape (B, N, d_model={self.d_model}); "
                             f"got {tuple(x.shape)}")
        T = self.n_steps if n_steps is None else check_int("n_steps", n_steps, 1)
        if self.step_scales is not None and T > self.step_scales.numel():
            raise ValueError(f"n_steps={T} exceeds the {self.step_scales.numel()} per-step factors of this "
                             "sub-block (per_step_scale: one factor per trained step)")
        first_graph = first_graph_step(T, backprop_steps)
        if cache is not None and backprop_steps is not None:
            raise ValueError(f"backprop_steps={backprop_steps} is for training; call without a cache")
        sink = self._trace
        if sink is not None and cache is not None:
            raise ValueError("tracing records whole sequences; call the model without a cache "
                             "(generate(..., use_cache=False)) while tracing")
        h_hat = self._normalize(x)
        ctx = self._context(h_hat) if cache is None else self._context(h_hat, cache, layer_idx, offset)
        g = h_hat
        crit = parse_exit(exit)
        if self.exit_steps is not None:  # (no attribute write in the plain path: torch.compile)
            self.exit_steps = None
        if crit is not None or accept_lower_energy:
            check_int("max_halvings", max_halvings, 0)
            return self._run_adaptive(x, h_hat, ctx, T, first_graph, crit, bool(accept_lower_energy), max_halvings,
                                      cache is not None)
        folded = None if sink is not None or cache is not None else self._folded(ctx)
        if folded is not None:  # P inside the gradient's output weights: no per-token P at each step
            ctx = folded
        if self.checkpoint_steps and sink is None and self.training and torch.is_grad_enabled():
            # per-step activation checkpointing: keep x and g per step, recompute the rest in backward
            for t in range(T):
                if t < first_graph:
                    with torch.no_grad():
                        x, g = self._step(x, g, h_hat, ctx, t, folded is not None)
                    continue
                if t == first_graph > 0:
                    g = self._normalize(x)  # the state is detached, its norm is this step's (with a graph)
                x, g = checkpoint(self._step, x, g, h_hat, ctx, t, folded is not None, use_reentrant=False)
            return x
        for t in range(T):
            if t == first_graph > 0:
                g = self._normalize(x)  # the state is detached, its norm is this step's (with a graph)
            with step_grad_mode(t, first_graph):  # the steps before the last backprop_steps: no graph
                grad = self._grad(g, h_hat, ctx)
                if sink is not None:
                    sink.record(t, x, {self.trace_sub: self._energy_or_none(g, h_hat)}, grad)
                x = self._descend(x, grad, t, folded is not None)
                if t + 1 < T or sink is not None:
                    g = self._normalize(x)
        if sink is not None:
            sink.record(T, x, {self.trace_sub: self._energy_or_none(g, h_hat)})
        return x

    def _run_adaptive(self, x: torch.Tensor, h_hat: torch.Tensor, ctx, T: int, first_graph: int, crit,
                      monotone: bool, max_halvings: int, cached: bool = False) -> torch.Tensor:
        """The steps with a per-token exit and/or energy-safe steps (docs/inference_compute.md §3, §5).

        The context ``ĥ`` (keys/values, the gate) is fixed, so a token's steps depend on itself only:
        an exit needs no cache rule here, and ``accept_lower_energy`` makes every token's energy
        ``ε(g_i | ĥ)`` non-increasing over the steps. The plain loop (a criterion that never fires,
        no ``monotone``) gives exactly :meth:`_run`'s states (tested).

        With a cache (``cached``) the attention energy is taken against the cached keys
        (:meth:`~energyformer.layers.cem_options.Interaction.energy_from_context`); an interaction
        without that method makes the ``energy`` criterion and ``accept_lower_energy`` raise there
        (decode with ``use_cache=False``)."""
        sink = self._trace
        has_energy = self._energy_at(h_hat[:, -1:], h_hat[:, -1:], ctx, cached) is not None
        if monotone and not has_energy:
            raise ValueError("accept_lower_energy needs the sub-block's energy: "
                             + ("this interaction has no energy of a cached context (decode with use_cache=False)"
                                if cached else "rope='llama' attention has none (use rope='exact' or None)"))
        state = None
        if crit is not None:
            state = ExitState(crit, x, frozenset({"grad"} | ({"energy"} if has_energy else set())),
                              f"a CEM {self.trace_sub} sub-block (no next-token readout inside a layer"
                              + ("; with a cache: decode with use_cache=False)" if cached else ")"))
        needs = state.needs if state is not None else frozenset()

        def energy(s: torch.Tensor) -> torch.Tensor:  # for decisions and criteria only: no graph
            with torch.no_grad():
                return self._energy_at(self._normalize(s), h_hat, ctx, cached)

        e_prev = energy(x) if ("energy" in needs or monotone) else None  # ε(x^t | ĥ): the context is fixed
        g, grad, ran = h_hat, None, 0
        for t in range(T):
            if t == first_graph > 0:
                g = self._normalize(x)
            with step_grad_mode(t, first_graph):
                if grad is None:
                    grad = self._grad(g, h_hat, ctx)
                if sink is not None:
                    sink.record(t, x, {self.trace_sub: self._energy_or_none(g, h_hat)}, grad)
                x_new, e_new = self._descend(x, grad, t), None
                if monotone:  # the energies of the accepted states come with them
                    x_new, e_new = accept_lower_energy_step(x, x_new, energy, max_halvings, e_old=e_prev,
                                                            return_energy=True)
                if state is not None:
                    x_new = state.apply(x, x_new)
                    if e_new is not None:
                        e_new = torch.where(state.active, e_new, e_prev)
                g_new = self._normalize(x_new)
            grad, ran, go_on = None, t + 1, True
            if monotone:
                e_prev_step, e_prev = e_prev, e_new
            if state is not None and t + 1 < T:
                view = ExitView(t, x, x_new)
                if "energy" in needs:
                    if e_new is None:
                        e_new = energy(x_new)
                        e_prev_step, e_prev = e_prev, e_new
                    view.energy_prev, view.energy_new = e_prev_step, e_new
                if "grad" in needs:
                    view.grad_new = self._grad(g_new, h_hat, ctx)
                    grad = None if torch.is_grad_enabled() else view.grad_new  # the next step's gradient
                go_on = state.update(view)
            x, g = x_new, g_new
            if not go_on:
                break
        if sink is not None:
            sink.record(ran, x, {self.trace_sub: self._energy_or_none(g, h_hat)})
        self.exit_steps = state.steps if state is not None else None
        return x

    def _energy_at(self, g: torch.Tensor, h_hat: torch.Tensor, ctx, cached: bool) -> torch.Tensor | None:
        """Per-token energy (B, N) of ``g`` for the exit and the energy-safe steps: ``ε(g | ĥ)``, or with
        a cache the energy against the cached context (:meth:`CEMAttention._energy_at`)."""
        return self._energy_or_none(g, h_hat)

    def _step(self, x: torch.Tensor, g: torch.Tensor, h_hat: torch.Tensor, ctx, t: int, preconditioned: bool = False):
        """One descent step ``(x, g = Norm(x)) -> (x', Norm(x'))`` (the unit of activation checkpointing)."""
        x = self._descend(x, self._grad(g, h_hat, ctx), t, preconditioned)
        return x, self._normalize(x)

    def _folded(self, ctx):
        """The context with the preconditioner folded in (:meth:`_fold`), or None where the plain path
        applies: no preconditioner, ``grad_through_norm`` (``P`` acts after the norm's Jacobian),
        ``fold_preconditioner = False``, or an option without a folded form."""
        if self.preconditioner is None or self.grad_through_norm or not self.fold_preconditioner:
            return None
        return self._fold(ctx)

    def _fold(self, ctx):  # pragma: no cover - abstract
        """``ctx`` with the linear map ``P`` folded in, so that :meth:`_grad` returns ``P ∇_g ε``; or None."""
        raise NotImplementedError

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

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by accounting group: the option's own groups, ``preconditioner``,
        ``step_size`` (η and the per-step factors) and ``norm``."""
        groups = self._option_groups()
        groups["preconditioner"] = [] if self.preconditioner is None else list(self.preconditioner.parameters())
        groups["step_size"] = [p for p in (self.step_size, self.step_scales) if isinstance(p, nn.Parameter)]
        groups["norm"] = [] if self.norm is None else list(self.norm.parameters())
        return groups


class CEMAttention(_CEMSubBlock):
    """CEM attention sub-block ``(B, N, d) -> (B, N, d)``: T descent steps on ``ε_att`` (docs/cem.md §2–§6).

    Returns the updated residual stream ``x^T`` (the input moved by the steps), not a branch
    output to add: a model calls ``x = attn(x)``, never ``x = x + attn(x)``.

    Parameters: the interaction's (``interaction.q_proj.weight``, ``interaction.k_proj.weight``
    (n_heads·head_dim, d_model) — no value or output projection: ``W_V = W_K``, ``W_O = W_Qᵀ`` —
    and the D+LR ``interaction.diag``, zero at init; ``q_proj``, ``k_proj`` and ``diag`` are also
    attributes of the layer), ``step_size`` η, optional ``step_scales`` (T,), optional
    ``preconditioner``, and the sub-block's own ``norm`` (RMSNorm).

    Args:
        d_model, n_heads: width ``d`` and heads ``H``.
        head_dim: ``d_h`` (default ``d_model // n_heads``); temperature ``τ = sqrt(d_h)``.
        n_steps: recursion ``T ≥ 1``.
        step_size: initial η (> 0); default 1 for T=1, 1/T otherwise. Not allowed with a preconditioner.
        interaction: a name registered in ``INTERACTIONS`` (default "lowrank", tied attention; the
            entries: the ``interaction`` table of docs/architecture.md, generated from the registry).
        rope: "exact" (true gradient of the rotated energy), "llama" (Llama's computation) or None.
        rope_theta: RoPE base.
        preconditioner: None or a name registered in ``STEP_MAPS`` (the ``step_map`` table of
            docs/architecture.md); ``preconditioner_rank`` r of its low-rank part.
        norm: "rmsnorm" or None (raw energy on x); ``norm_eps``.
        grad_through_norm: use ``J_Normᵀ ∇_g ε`` (docs/cem.md §7 alternative).
        learn_step_size: η is a Parameter (else a fixed buffer).
        per_step_scale: learnable per-step factors ``c_t``.

    Raises:
        ValueError: ``n_steps < 1``; ``n_heads`` not dividing ``d_model`` (when ``head_dim`` is
            None); step size ≤ 0; unknown option; odd ``head_dim`` with RoPE; RoPE with an
            interaction without a low-rank term; ``step_size`` given with a preconditioner.
    """

    trace_sub = "attn"

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
        interaction_cls = INTERACTIONS.get(interaction)
        interaction_cls.check_options(d_model=d_model, n_heads=n_heads, head_dim=head_dim, rope=rope)
        self._setup_common(d_model, n_steps, step_size, preconditioner, preconditioner_rank, norm, norm_eps,
                           grad_through_norm, learn_step_size, per_step_scale)
        self.interaction = interaction_cls(d_model, n_heads, head_dim, rope=rope, rope_theta=rope_theta)
        self.n_heads, self.head_dim, self.rope_mode = n_heads, head_dim, rope

    # the interaction's parameters, under the names users of attention layers look for
    q_proj = property(lambda self: self.interaction.q_proj)
    k_proj = property(lambda self: self.interaction.k_proj)
    diag = property(lambda self: self.interaction.diag)
    rotary = property(lambda self: self.interaction.rotary)
    tau = property(lambda self: self.interaction.tau)

    def _context(self, h_hat: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0):
        return self.interaction.context(h_hat, cache, layer_idx, offset)

    def _grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx) -> torch.Tensor:
        return self.interaction.grad(g, h_hat, ctx)

    def _fold(self, ctx):
        return self.interaction.fold_step_map(ctx, self.preconditioner)

    def _energy_or_none(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor | None:
        return self.interaction.energy(g, h_hat)

    @property
    def cached_energy(self) -> bool:
        """Whether the energy options (an ``energy`` exit, ``accept_lower_energy``) work in KV-cached
        decoding: the interaction computes its energy against cached keys (it overrides
        :meth:`~energyformer.layers.cem_options.Interaction.energy_from_context`; every built-in
        entry does, a plugin entry may not)."""
        from energyformer.layers.cem_options import Interaction

        return type(self.interaction).energy_from_context is not Interaction.energy_from_context

    def _energy_at(self, g: torch.Tensor, h_hat: torch.Tensor, ctx, cached: bool) -> torch.Tensor | None:
        if cached:  # the new tokens against every cached key (docs/inference_compute.md §4)
            return self.interaction.energy_from_context(g, ctx)
        return self._energy_or_none(g, h_hat)

    def _option_groups(self) -> dict[str, list[nn.Parameter]]:
        return self.interaction.param_groups()

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0, *,
                n_steps: int | None = None, backprop_steps: int | None = None, exit=None,
                accept_lower_energy: bool = False, max_halvings: int = DEFAULT_MAX_HALVINGS) -> torch.Tensor:
        """``x`` (B, N, d) -> ``x^T`` (B, N, d). Under :func:`~energyformer.layers.trace.tracing`
        it records every state ``t = 0 … T`` with its energy (term ``"attn"``; none for rope="llama").

        ``n_steps`` (default the layer's ``T``) and ``backprop_steps`` (training: a graph for the
        last ``k`` steps only): see the module docstring.

        With ``cache`` (docs/architecture.md §5) ``x`` holds the new tokens at positions
        ``offset … offset+N−1``: their keys/values (computed once from ``ĥ``, as without a cache)
        go to slot ``layer_idx`` and all ``T`` steps attend to every cached position.

        Raises:
            ValueError: ``x`` not (B, N, d_model); a cache while tracing; ``n_steps < 1`` or more steps
                than per-step factors; ``backprop_steps < 1`` or with a cache.
        """
        return self._run(x, cache, layer_idx, offset, n_steps, backprop_steps, exit, accept_lower_energy, max_halvings)

    def extra_repr(self) -> str:
        return (f"n_steps={self.n_steps}, interaction={self.interaction.name!r}, "
                f"grad_through_norm={self.grad_through_norm}")


class CEMGatedMLP(_CEMSubBlock):
    """CEM gated-MLP sub-block ``(B, N, d) -> (B, N, d)``: T descent steps on ``ε_mlp`` (docs/cem.md §3, §6).

    Returns the updated residual stream ``x^T``, not a branch output to add (``x = mlp(x)``).

    Parameters: ``gate_proj.weight`` and ``up_proj.weight`` (d_ff, d_model); the down projection
    is the transpose of the tied one (``gate_proj`` for ``mlp_tie="gate"``, ``up_proj`` for
    ``mlp_tie="up"``); the other projection feeds the fixed multiplicative branch from ``ĥ``.

    Args:
        d_model, d_ff: widths. n_steps, step_size, preconditioner, preconditioner_rank, norm,
        norm_eps, grad_through_norm, learn_step_size, per_step_scale: as in :class:`CEMAttention`.
        mlp_tie: a name registered in ``MLP_TIES`` (default "gate", variant A; the ``mlp_tie`` table
            of docs/architecture.md).

    Raises:
        ValueError: ``n_steps < 1``, ``d_ff < 1``, step size ≤ 0, unknown option.
    """

    trace_sub = "mlp"

    def __init__(self, d_model: int, d_ff: int, n_steps: int = 1, step_size: float | None = None, *,
                 mlp_tie: str = "gate", preconditioner: str | None = None, preconditioner_rank: int = 8,
                 norm: str | None = "rmsnorm", norm_eps: float = 1e-5, grad_through_norm: bool = False,
                 learn_step_size: bool = True, per_step_scale: bool = False):
        super().__init__()
        check_int("d_ff", d_ff, 1)
        self.tie = MLP_TIES.get(mlp_tie)
        self.mlp_tie = mlp_tie
        self._setup_common(d_model, n_steps, step_size, preconditioner, preconditioner_rank, norm, norm_eps,
                           grad_through_norm, learn_step_size, per_step_scale)
        self.d_ff = d_ff
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)

    def _context(self, h_hat: torch.Tensor) -> torch.Tensor:
        return self.tie.context(h_hat, self.gate_proj.weight, self.up_proj.weight)

    def _grad(self, g: torch.Tensor, h_hat: torch.Tensor, ctx) -> torch.Tensor:
        if isinstance(ctx, _FoldedBranch):
            return self.tie.grad(g, h_hat, self.gate_proj.weight, self.up_proj.weight, ctx.branch, w_out=ctx.w_out)
        return self.tie.grad(g, h_hat, self.gate_proj.weight, self.up_proj.weight, ctx)

    def _fold(self, ctx: torch.Tensor) -> _FoldedBranch | None:
        """The branch with ``P(W)``, ``W`` the tied projection's weight (the output weight of ``∇_g ε``),
        or None for a tie whose gradient takes no output weight (``MLPTie.folds_step_map()``)."""
        if not self.tie.folds_step_map():
            return None
        return _FoldedBranch(ctx, self.preconditioner(getattr(self, self.tie.tied).weight))

    def _energy_or_none(self, g: torch.Tensor, h_hat: torch.Tensor) -> torch.Tensor:
        return self.tie.energy(g, h_hat, self.gate_proj.weight, self.up_proj.weight)

    def _option_groups(self) -> dict[str, list[nn.Parameter]]:
        return {"projections": [self.gate_proj.weight, self.up_proj.weight]}

    def forward(self, x: torch.Tensor, *, n_steps: int | None = None, backprop_steps: int | None = None,
                exit=None, accept_lower_energy: bool = False, max_halvings: int = DEFAULT_MAX_HALVINGS
                ) -> torch.Tensor:
        """``x`` (B, N, d) -> ``x^T`` (B, N, d); traced as :meth:`CEMAttention.forward` (term ``"mlp"``);
        ``n_steps`` and ``backprop_steps`` as there.

        Raises:
            ValueError: ``x`` not (B, N, d_model); ``n_steps`` or ``backprop_steps`` as in
                :meth:`CEMAttention.forward`.
        """
        return self._run(x, n_steps=n_steps, backprop_steps=backprop_steps, exit=exit,
                         accept_lower_energy=accept_lower_energy, max_halvings=max_halvings)

    def extra_repr(self) -> str:
        return f"d_ff={self.d_ff}, n_steps={self.n_steps}, mlp_tie={self.mlp_tie!r}"


class CEMBlock(nn.Module):
    """One CEM layer ``(B, N, d) -> (B, N, d)``: attention sub-block, then MLP sub-block (docs/cem.md §1, §8).

    Returns the updated residual stream (``x = block(x)``), like each of its sub-blocks.

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

    #: ``(B, N)`` int64: the steps each token got in both sub-blocks in the last call with ``exit``
    exit_steps: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0, offset: int = 0, *,
                n_steps: int | None = None, backprop_steps: int | None = None, exit=None,
                accept_lower_energy: bool = False, max_halvings: int = DEFAULT_MAX_HALVINGS) -> torch.Tensor:
        """``x`` (B, N, d) -> (B, N, d): the attention sub-block's steps, then the MLP's.

        ``cache``/``layer_idx``/``offset`` go to the attention sub-block (docs/architecture.md §5);
        the MLP sub-block is per token and needs no cache. ``n_steps`` (the recursion ``T`` of both
        sub-blocks for this call; default each one's own) and ``backprop_steps`` (training: a graph
        for the last ``k`` steps of each sub-block only) go to both sub-blocks, and so do ``exit``
        (a per-token exit inside each sub-block: ``abs``, ``rel``, ``energy``, ``grad``; ``kl`` needs a
        next-token readout, which a layer has not), ``accept_lower_energy`` and ``max_halvings``
        (energy-safe steps; docs/inference_compute.md). ``self.exit_steps`` ``(B, N)``: the steps of
        both sub-blocks together, after a call with ``exit``.
        """
        steps = {} if n_steps is None and backprop_steps is None else \
            {"n_steps": n_steps, "backprop_steps": backprop_steps}
        if exit is not None or accept_lower_energy:  # docs/inference_compute.md: both sub-blocks
            steps.update(exit=exit, accept_lower_energy=accept_lower_energy, max_halvings=max_halvings)
        if cache is None:
            out = self.mlp(self.attn(x, **steps), **steps)
        else:
            out = self.mlp(self.attn(x, cache, layer_idx, offset, **steps), **steps)
        if exit is not None or self.exit_steps is not None:
            self.exit_steps = None if self.attn.exit_steps is None else self.attn.exit_steps + self.mlp.exit_steps
        return out
