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
from energyformer.layers.kv_cache import cache_length
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

    def forward(self, x: torch.Tensor, *, n_steps: int | None = None, stop_tol: float | None = None,
                cache: Any = None, backprop_steps: int | None = None) -> torch.Tensor:
        """The states after the descent: :meth:`descend`."""
        return self.descend(x, n_steps=n_steps, stop_tol=stop_tol, cache=cache, backprop_steps=backprop_steps)

    def descend(self, x: torch.Tensor, *, n_steps: int | None = None, stop_tol: float | None = None,
                cache: Any = None, backprop_steps: int | None = None) -> torch.Tensor:
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

        Returns:
            the residual stream after the descent ``xᵀ`` ``(B, N, d)`` (``x`` plus every step, not a
            branch). Under tracing (:func:`~energyformer.layers.trace.tracing`) one record per
            state ``x⁰ … x^S`` (``S ≤ T`` steps actually run) with the terms ``"attn"``, ``"ff"``
            (with ``s_ff``) and ``"total"``, and, with ``stop_tol``, ``trace.steps_taken``
            ``(B, N)``: the number of updates each token got.

        Raises:
            ValueError: ``n_steps < 1``, ``stop_tol < 0``, ``backprop_steps < 1`` or given with a
                cache, a cache filled with another ``n_steps``/``stop_tol``, a cache while tracing.
        """
        T = self.n_steps if n_steps is None else check_int("n_steps", n_steps, 1)
        if stop_tol is not None:
            stop_tol = check_float("stop_tol", stop_tol, 0.0)
        first_graph = first_graph_step(T, backprop_steps)
        if cache is not None:
            if backprop_steps is not None:
                raise ValueError(f"backprop_steps={backprop_steps} is for training; call without a cache")
            return self._descend_cached(x, cache, T, stop_tol)
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
