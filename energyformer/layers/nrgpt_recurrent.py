"""NRGPT as a layer: one shared :class:`~energyformer.layers.nrgpt.NRGPTBlock` applied ``n_steps`` times.

docs/nrgpt.md §4 and §6::

    xᵗ⁺¹ = xᵗ − κ_t η(∂E_AT/∂g + s_ff ∂E_FF/∂g),  g = Norm(xᵗ)     (t = 0 … T−1)

:class:`NRGPTRecurrent` maps a residual stream ``(B, N, d)`` to the residual stream after the
``T`` descent steps (not a branch output to add: the steps already include the input). It owns
the recurrence's extras: ``n_steps`` at call time (more or fewer steps than trained), truncated
back-propagation through the last ``backprop_steps`` steps (:mod:`energyformer.layers.truncation`),
per-token early stopping (``stop_tol``), optional per-step scales κ_t, energy tracing
(:mod:`energyformer.layers.trace`) and cached decoding (docs/architecture.md §5). The NRGPT
language model (:class:`energyformer.models.nrgpt.NRGPT`) is this layer with token and position
embeddings and an LM head::

    from energyformer import NRGPTRecurrent
    nrgpt = NRGPTRecurrent(d_model=64, n_heads=4, n_steps=6)
    y = nrgpt(x)                           # (B, N, 64) -> (B, N, 64)
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from energyformer._validate import check_float, check_int
from energyformer.layers.exit import ExitState, ExitView, parse_exit, readout_logits
from energyformer.layers.kv_cache import cache_length
from energyformer.layers.monotone import DEFAULT_MAX_HALVINGS, accept_lower_energy_step
from energyformer.layers.nrgpt import NRGPTBlock
from energyformer.layers.truncation import first_graph_step, step_grad_mode

__all__ = ["NRGPTRecurrent"]


class NRGPTRecurrent(nn.Module):
    """``n_steps`` applications of one shared NRGPT block: residual stream ``(B, N, d) -> (B, N, d)``.

    Args:
        d_model, n_heads: width ``d`` and heads ``H`` of the block.
        n_steps: the depth ``T`` (default number of steps per call).
        per_step_scale: learnable per-step scalars κ_t (init 1) multiplying η; steps beyond
            ``n_steps`` reuse the last one.
        block: an :class:`~energyformer.layers.nrgpt.NRGPTBlock` to apply (then ``d_model``,
            ``n_heads`` and ``block_options`` must not be given).
        block_options: every keyword of :class:`~energyformer.layers.nrgpt.NRGPTBlock`
            (``attention``, ``ff``, ``eta_param``, ``norm``, ``mask``, ``dropout``, ...).

    Attributes: ``block`` (the shared block) and ``step_scales`` (``(T,)`` or ``None``).

    Raises:
        ValueError: ``n_steps < 1``, neither or both of ``block`` and ``d_model``, or an
            invalid block option (named by :class:`~energyformer.layers.nrgpt.NRGPTBlock`).
    """

    def __init__(self, d_model: int | None = None, n_heads: int | None = None, *, n_steps: int = 6,
                 per_step_scale: bool = False, block: NRGPTBlock | None = None, **block_options: Any):
        super().__init__()
        if block is None:
            if d_model is None or n_heads is None:
                raise ValueError("NRGPTRecurrent needs d_model and n_heads (or a block=NRGPTBlock(...))")
            block = NRGPTBlock(d_model, n_heads, **block_options)
        elif d_model is not None or n_heads is not None or block_options:
            raise ValueError("NRGPTRecurrent(block=...) takes no d_model, n_heads or block options")
        self.setup_recurrence(block, n_steps, per_step_scale)

    def setup_recurrence(self, block: NRGPTBlock, n_steps: int, per_step_scale: bool) -> None:
        """Register ``block`` and the optional ``step_scales`` (κ, init 1) under their names."""
        self.n_steps = check_int("n_steps", n_steps, 1)
        self.block = block
        self.step_scales = nn.Parameter(torch.ones(n_steps)) if per_step_scale else None

    def step_scale(self, t: int) -> torch.Tensor | None:
        """κ_t for step ``t`` (``None`` without per-step scales). Steps beyond the trained
        ``n_steps`` reuse the last κ (inference-time scaling)."""
        if self.step_scales is None:
            return None
        return self.step_scales[min(t, self.step_scales.numel() - 1)]

    #: ``(B, N)`` int64: the updates each token got in the last call with ``exit`` or ``stop_tol`` (else ``None``)
    exit_steps: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, *, n_steps: int | None = None, stop_tol: float | None = None,
                cache: Any = None, backprop_steps: int | None = None, exit: Any = None,
                accept_lower_energy: bool = False, max_halvings: int = DEFAULT_MAX_HALVINGS) -> torch.Tensor:
        """The states after the descent: :meth:`descend`."""
        return self.descend(x, n_steps=n_steps, stop_tol=stop_tol, cache=cache, backprop_steps=backprop_steps,
                            exit=exit, accept_lower_energy=accept_lower_energy, max_halvings=max_halvings)

    def descend(self, x: torch.Tensor, *, n_steps: int | None = None, stop_tol: float | None = None,
                cache: Any = None, backprop_steps: int | None = None, exit: Any = None,
                readout: Any = None, accept_lower_energy: bool = False,
                max_halvings: int = DEFAULT_MAX_HALVINGS) -> torch.Tensor:
        """Run the recurrent energy descent from ``x⁰ = x``.

        Args:
            x: residual stream ``(B, N, d)``.
            n_steps: number of descent steps T for this call (default ``self.n_steps``); may
                exceed the trained depth (extra steps reuse the last κ).
            stop_tol: per-token early stopping. After every step, token ``A`` of sequence ``b``
                is frozen (its state is no longer updated in later steps) once
                ``|E_A(xᵗ⁺¹) − E_A(xᵗ)| < stop_tol``, where ``E_A = E_AT + s_ff E_FF`` is its
                total energy. ``E_A`` depends only on positions ≤ A, so the rule is causal.
                The loop ends early when every token is frozen. ``None`` disables it.
            cache: a :class:`~energyformer.layers.kv_cache.KVCache` or ``transformers`` ``Cache``
                (docs/architecture.md §5): ``x`` follows the cached positions. A token's keys
                depend on its state at each step, so slot ``t`` holds every earlier token's keys
                at step ``t`` (and, with ``stop_tol``, slot ``T`` those of the final states, for
                the energies). The cached result equals the uncached one on the whole sequence,
                ``stop_tol`` included. A cache must be filled and reused with one ``n_steps`` and
                one ``stop_tol`` (a ``KVCache`` checks this). Not with tracing.
            backprop_steps: truncated back-propagation (training): the first ``T − k`` steps run
                under ``torch.no_grad()`` and only the last ``k`` keep a graph; ``None`` or
                ``k ≥ T``: every step (:mod:`energyformer.layers.truncation`). Not with a cache.
            exit: per-token adaptive exit (docs/inference_compute.md §2–§4): an
                :class:`~energyformer.layers.exit.ExitCriterion` or its spelling ``"name:threshold"``
                (``"kl:1e-3"``, ``"rel:0.03"``, ``"energy:1e-3"``, ``"grad:1e-2"``, ``"abs:1e-2"``, or a
                registered one); ``T`` is then the most steps a token gets. An exited token keeps its
                state; later tokens read that frozen state at every later step (cached or not).
                Not with ``stop_tol``. ``self.exit_steps`` ``(B, N)`` holds the steps each token got.
            readout: ``readout(x (B, N, d)) -> logits (B, N, V)`` for criteria needing logits (``kl``);
                the language model passes its LM head.
            accept_lower_energy: accept a token's step only if it does not raise its energy
                ``E_i`` (earlier tokens held at their step-``t`` states), halving the step up to
                ``max_halvings`` times, then rejecting it (:mod:`energyformer.layers.monotone`,
                docs/inference_compute.md §5).
            max_halvings: see ``accept_lower_energy`` (≥ 0).

        Returns:
            the residual stream after the descent ``xᵀ`` ``(B, N, d)`` (``x`` plus every step, not a
            branch). Under tracing (:func:`~energyformer.layers.trace.tracing`) one record per
            state ``x⁰ … x^S`` (``S ≤ T`` steps actually run) with the terms ``"attn"``, ``"ff"``
            (with ``s_ff``) and ``"total"``, and, with ``stop_tol``, ``trace.steps_taken``
            ``(B, N)``: the number of updates each token got.

        Raises:
            ValueError: ``n_steps < 1``, ``stop_tol < 0``, ``backprop_steps < 1`` or given with a
                cache, a cache filled with another ``n_steps``/``stop_tol``/``exit``, a cache while
                tracing, an unknown ``exit`` (names the known criteria), ``exit`` with ``stop_tol``,
                ``max_halvings < 0``.
        """
        T = self.n_steps if n_steps is None else check_int("n_steps", n_steps, 1)
        if stop_tol is not None:
            stop_tol = check_float("stop_tol", stop_tol, 0.0)
        crit = parse_exit(exit)
        if crit is not None and stop_tol is not None:
            raise ValueError(f"give exit={crit.spec()!r} or stop_tol={stop_tol}, not both "
                             "(stop_tol is an energy-change exit of its own)")
        check_int("max_halvings", max_halvings, 0)
        adaptive = crit is not None or bool(accept_lower_energy)
        first_graph = first_graph_step(T, backprop_steps)
        if self.exit_steps is not None:  # (no attribute write in the plain path: torch.compile)
            self.exit_steps = None
        if cache is not None:
            if backprop_steps is not None:
                raise ValueError(f"backprop_steps={backprop_steps} is for training; call without a cache")
            if adaptive:
                return self._descend_cached_adaptive(x, cache, T, crit, readout, bool(accept_lower_energy),
                                                     max_halvings)
            return self._descend_cached(x, cache, T, stop_tol)
        if adaptive:
            return self._descend_adaptive(x, T, crit, readout, bool(accept_lower_energy), max_halvings, first_graph)
        sink = self.block._trace
        track = sink is not None or stop_tol is not None
        e_prev = self._energies(x) if track else None
        active = steps = None
        if stop_tol is not None:
            active = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
            steps = torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        ran = 0
        for t in range(T):
            if sink is not None:
                with torch.no_grad():
                    sink.record(t, x, e_prev, self.block.force(x))
            with step_grad_mode(t, first_graph):  # the steps before the last backprop_steps: no graph
                x_new = self.block(x, self.step_scale(t))
                if stop_tol is not None:
                    x_new = torch.where(active.unsqueeze(-1), x_new, x)
            if stop_tol is not None:
                steps += active.long()
            x, ran = x_new, t + 1
            if track:
                e = self._energies(x)
                if stop_tol is not None:
                    active = active & ~((e["total"] - e_prev["total"]).abs() < stop_tol)
                e_prev = e
                if stop_tol is not None and not bool(active.any()):
                    break
        if sink is not None:
            sink.record(ran, x, e_prev)
            sink.trace.steps_taken = steps
        if steps is not None:
            self.exit_steps = steps
        return x

    # ------------------------------------------------------------------------------------------
    # adaptive exit and energy-safe steps (docs/inference_compute.md): the loop of descend, per token
    def _supports(self, readout: Any) -> frozenset[str]:
        return frozenset({"energy", "grad"} | ({"logits"} if readout is not None else set()))

    def _safe_step(self, x: torch.Tensor, force: torch.Tensor, t: int, monotone: bool, max_halvings: int,
                   energy: Any) -> torch.Tensor:
        """``x − κ_t η(force)``, or with ``monotone`` the energy-safe step (``energy(states) -> (B, N)``)."""
        x_full = self.block.step(x, force, self.step_scale(t))
        if not monotone:
            return x_full
        return accept_lower_energy_step(x, x_full, energy, max_halvings)

    def _descend_adaptive(self, x: torch.Tensor, T: int, crit: Any, readout: Any, monotone: bool,
                          max_halvings: int, first_graph: int) -> torch.Tensor:
        """:meth:`descend` with ``exit`` and/or ``accept_lower_energy`` on a whole sequence ``(B, N, d)``.

        The plain loop (``exit`` never firing, no ``monotone``) gives exactly the states of
        :meth:`descend` without them (tested): each step is ``block.step(x, block.force(x))``."""
        blk, sink = self.block, self.block._trace
        state = ExitState(crit, x, self._supports(readout), "NRGPT") if crit is not None else None
        needs = state.needs if state is not None else frozenset()
        e_prev = self._energies(x) if ("energy" in needs or sink is not None) else None
        lg_prev = readout_logits(readout, x) if "logits" in needs else None
        force, ran = None, 0
        for t in range(T):
            with step_grad_mode(t, first_graph):
                f = blk.force(x) if force is None else force
                if sink is not None:
                    with torch.no_grad():
                        sink.record(t, x, e_prev, f)
                context = x
                x_new = self._safe_step(x, f, t, monotone, max_halvings,
                                        lambda s, c=context: blk.energy_in_context(s, c))
                if state is not None:
                    x_new = state.apply(x, x_new)
            force, ran = None, t + 1
            go_on = True
            if state is not None and t + 1 < T:
                view = ExitView(t, x, x_new)
                if "energy" in needs or sink is not None:
                    e_new = self._energies(x_new)
                    if "energy" in needs:
                        view.energy_prev, view.energy_new = e_prev["total"], e_new["total"]
                    e_prev = e_new
                if "grad" in needs:
                    grad = blk.force(x_new)
                    view.grad_new = grad
                    force = None if torch.is_grad_enabled() else grad  # the next step's force, reused
                if "logits" in needs:
                    lg_new = readout_logits(readout, x_new)
                    view.logits_prev, view.logits_new = lg_prev, lg_new
                    lg_prev = lg_new
                go_on = state.update(view)
            elif sink is not None:
                e_prev = self._energies(x_new)
            x = x_new
            if not go_on:
                break
        if sink is not None:
            sink.record(ran, x, e_prev if e_prev is not None else self._energies(x))
            if state is not None:
                sink.trace.steps_taken = state.steps
        self.exit_steps = state.steps if state is not None else None
        return x

    def _check_cache_meta(self, cache: Any, want: dict[str, Any]) -> None:
        """Record what ``cache`` is filled with; refuse a reuse with other options."""
        meta = getattr(cache, "meta", None)
        if isinstance(meta, dict):
            have = {k: meta.get(k) for k in want}
            if cache_length(cache) and have != want:
                raise ValueError(f"this cache was filled with {have}; got {want} (start a new cache to change them)")
            meta.update(want)

    def _descend_cached_adaptive(self, x: torch.Tensor, cache: Any, T: int, crit: Any, readout: Any,
                                 monotone: bool, max_halvings: int) -> torch.Tensor:
        """:meth:`_descend_adaptive` for new positions ``x`` (B, N, d) after the cached ones.

        The cache rule (docs/inference_compute.md §4): slot ``t`` holds every token's keys at step
        ``t``; a token that exited at step ``s < t`` stores the keys of its state frozen at ``s``.
        The order of the uncached loop is kept: the criterion on the transition ``t−1 → t`` is
        evaluated at iteration ``t`` from slot ``t``'s keys, then step ``t`` is taken; once every new
        token has exited, the remaining slots get the keys of the (unchanged) states.
        """
        blk = self.block
        if blk._trace is not None:
            raise ValueError("tracing records whole sequences; call the model without a cache "
                             "(generate(..., use_cache=False)) while tracing")
        self._check_cache_meta(cache, {"n_steps": T, "stop_tol": None,
                                       "exit": None if crit is None else crit.spec(),
                                       "accept_lower_energy": monotone or None})
        state = ExitState(crit, x, self._supports(readout), "NRGPT") if crit is not None else None
        needs = state.needs if state is not None else frozenset()
        x_prev = e_prev = lg_prev = None
        for t in range(T):
            g = blk.normalize(x)
            keys = blk.cache_keys(g, cache, t)
            f = blk.force_from_keys(g, keys)
            e_t = lg_t = None
            if "energy" in needs:
                e = blk.energy_from_keys(g, keys)
                e_t = e["attn"] + e["ff"]
            if "logits" in needs:
                lg_t = readout_logits(readout, x)
            if state is not None and t > 0:
                view = ExitView(t - 1, x_prev, x, e_prev, e_t, f if "grad" in needs else None, lg_prev, lg_t)
                if not state.update(view):
                    for later in range(t + 1, T):  # exited: the same state, the same keys
                        blk.cache_keys(g, cache, later)
                    break

            def energy(s: torch.Tensor, keys: torch.Tensor = keys) -> torch.Tensor:
                e = blk.energy_from_keys(blk.normalize(s), keys)
                return e["attn"] + e["ff"]

            x_new = self._safe_step(x, f, t, monotone, max_halvings, energy)
            if state is not None:
                x_new = state.apply(x, x_new)
            x_prev, e_prev, lg_prev, x = x, e_t, lg_t, x_new
        self.exit_steps = state.steps if state is not None else None
        return x

    def _descend_cached(self, x: torch.Tensor, cache: Any, T: int, stop_tol: float | None) -> torch.Tensor:
        """:meth:`descend` for new positions ``x`` (B, N, d) after the cached ones.

        Slot ``t`` gets the keys of the states ``xᵗ`` (``t = 0 … T−1``; with ``stop_tol`` also
        ``t = T``, for the energy of the final state). The order of the uncached loop is kept:
        ``E(xᵗ)`` decides whether the token moves from ``xᵗ``; once every new token is frozen the
        remaining slots get the keys of the (unchanged) states.
        """
        blk = self.block
        if blk._trace is not None:
            raise ValueError("tracing records whole sequences; call the model without a cache "
                             "(generate(..., use_cache=False)) while tracing")
        offset = cache_length(cache)
        meta = getattr(cache, "meta", None)
        if isinstance(meta, dict):
            want = {"n_steps": T, "stop_tol": stop_tol}
            if meta.get("exit") is not None or meta.get("accept_lower_energy") is not None:
                raise ValueError(f"this cache was filled with exit={meta.get('exit')!r}, accept_lower_energy="
                                 f"{meta.get('accept_lower_energy')}; start a new cache to change them")
            have = {k: meta.get(k) for k in want}
            if offset and have != want:
                raise ValueError(f"this cache was filled with n_steps={have['n_steps']}, stop_tol={have['stop_tol']}; "
                                 f"got n_steps={T}, stop_tol={stop_tol} (start a new cache to change them)")
            meta.update(want)
        n_slots = T + 1 if stop_tol is not None else T
        active = e_prev = None
        for t in range(n_slots):
            g = blk.normalize(x)
            keys = blk.cache_keys(g, cache, t)
            if stop_tol is not None:
                e = blk.energy_from_keys(g, keys)
                total = e["attn"] + e["ff"]
                active = torch.ones_like(total, dtype=torch.bool) if active is None else \
                    active & ~((total - e_prev).abs() < stop_tol)
                e_prev = total
                if not bool(active.any()):
                    for later in range(t + 1, n_slots):  # frozen: the same state, the same keys
                        blk.cache_keys(g, cache, later)
                    break
            if t == T:
                break
            x_new = blk.step(x, blk.force_from_keys(g, keys), self.step_scale(t))
            x = x_new if active is None else torch.where(active.unsqueeze(-1), x_new, x)
        return x

    @torch.no_grad()
    def _energies(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.energy(x)

    def energy(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token energy terms of the state ``x`` ``(B, N, d)``: ``{"attn", "ff", "total"}``, each ``(B, N)``."""
        e = self.block.energy(x)
        e["total"] = e["attn"] + e["ff"]
        return e

    def extra_repr(self) -> str:
        return f"n_steps={self.n_steps}"
