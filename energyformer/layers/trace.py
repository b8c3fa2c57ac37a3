"""One energy-trace type for every energy model (CEM and NRGPT).

Tracing is switched on around a forward call; the forward's return value never changes::

    with tracing(model) as trace:          # or: with model.trace() as trace:
        logits, loss = model(idx)
    trace.energy("attn", layer=0)         # (S + 1, B, N): per step, per token
    trace.layers(), trace.terms(layer=0)

A :class:`Trace` holds one :class:`TraceRecord` per (layer, sub-block, step): the state ``x^t``
``(B, N, d)`` (detached), its per-token energy terms ``{term: (B, N)}``, its norm ``‖x^t‖``
``(B, N)``, and — for every state but the last — the gradient ``∇E`` ``(B, N, d)`` the step from it
used (before the step map). Step ``t = 0`` is the sub-block's input; a sub-block with ``T`` steps
gives ``T + 1`` records. CEM records ``sub="attn"``/``"mlp"`` per layer with terms ``"attn"`` /
``"mlp"``; NRGPT records ``layer=0, sub="block"`` with terms ``"attn"``, ``"ff"`` (with its scale
``s_ff``) and ``"total"``. Energies are evaluated under ``torch.no_grad`` (inspection, not
training). With tracing off, a traceable module holds ``_trace = None`` and its forward makes no
allocation for tracing.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Trace", "TraceRecord", "TraceSink", "tracing", "Traceable"]


@dataclass
class TraceRecord:
    """One state of one sub-block: see the module docstring for the shapes."""

    layer: int
    sub: str
    step: int
    x: torch.Tensor
    energies: dict[str, torch.Tensor]
    state_norm: torch.Tensor
    grad: torch.Tensor | None = None


@dataclass
class Trace:
    """The records of one traced forward, in the order they were made.

    ``steps_taken`` is ``(B, N)`` int64 when the model stops tokens early (NRGPT ``stop_tol``):
    the number of updates each token got; else None.
    """

    records: list[TraceRecord] = field(default_factory=list)
    steps_taken: torch.Tensor | None = None

    def select(self, layer: int | None = None, sub: str | None = None) -> list[TraceRecord]:
        """Records of ``layer`` and/or ``sub`` (all when None), in step order."""
        out = [r for r in self.records if (layer is None or r.layer == layer) and (sub is None or r.sub == sub)]
        return sorted(out, key=lambda r: (r.layer, r.sub, r.step)) if layer is None or sub is None else out

    def layers(self) -> list[int]:
        """Layer indices present, ascending."""
        return sorted({r.layer for r in self.records})

    def subs(self, layer: int) -> list[str]:
        """Sub-block names of ``layer`` in the order they ran."""
        seen: list[str] = []
        for r in self.records:
            if r.layer == layer and r.sub not in seen:
                seen.append(r.sub)
        return seen

    def terms(self, layer: int | None = None) -> list[str]:
        """Energy term names recorded (for ``layer``, or anywhere)."""
        seen: list[str] = []
        for r in self.records:
            if layer is None or r.layer == layer:
                seen += [k for k in r.energies if k not in seen]
        return seen

    def energy(self, term: str, layer: int = 0, sub: str | None = None) -> torch.Tensor:
        """Per-token energies of ``term`` stacked over steps: ``(S + 1, B, N)``.

        ``sub`` defaults to the sub-block that records ``term`` in ``layer``.

        Raises:
            KeyError: no record of ``term`` in that layer/sub-block (the message lists what exists).
        """
        recs = [r for r in self.records if r.layer == layer and (sub is None or r.sub == sub) and term in r.energies]
        if not recs:
            raise KeyError(f"no energy term {term!r} in layer {layer}" + (f", sub-block {sub!r}" if sub else "")
                           + f"; recorded terms: {self.terms(layer)}")
        return torch.stack([r.energies[term] for r in sorted(recs, key=lambda r: r.step)])

    def states(self, layer: int = 0, sub: str | None = None) -> torch.Tensor:
        """States ``x^t`` stacked over steps: ``(S + 1, B, N, d)`` (``sub`` as in :meth:`energy`)."""
        subs = self.subs(layer)
        sub = sub if sub is not None else (subs[0] if subs else None)
        recs = self.select(layer, sub)
        if not recs:
            raise KeyError(f"no records for layer {layer}, sub-block {sub!r}")
        return torch.stack([r.x for r in recs])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested lists: per record ``layer``, ``sub``, ``step``, ``energies``, ``state_norm``."""
        return {"records": [{"layer": r.layer, "sub": r.sub, "step": r.step,
                             "energies": {k: v.tolist() for k, v in r.energies.items()},
                             "state_norm": r.state_norm.tolist(),
                             "grad_norm": None if r.grad is None else r.grad.norm(dim=-1).tolist()}
                            for r in self.records],
                "steps_taken": None if self.steps_taken is None else self.steps_taken.tolist()}


class TraceSink:
    """Where one traceable module writes: the trace plus the module's ``layer`` and ``sub`` labels."""

    def __init__(self, trace: Trace, layer: int, sub: str):
        self.trace, self.layer, self.sub = trace, layer, sub

    @torch.no_grad()
    def record(self, step: int, x: torch.Tensor, energies: dict[str, torch.Tensor | None],
               grad: torch.Tensor | None = None) -> None:
        """Append the record of state ``x`` (B, N, d) at ``step`` (None energies are left out)."""
        x = x.detach()
        self.trace.records.append(TraceRecord(
            layer=self.layer, sub=self.sub, step=step, x=x,
            energies={k: v.detach() for k, v in energies.items() if v is not None},
            state_norm=x.float().norm(dim=-1), grad=None if grad is None else grad.detach()))


class Traceable:
    """Mixin of modules that record into a :class:`Trace`; ``trace_sub`` names their sub-block."""

    trace_sub: str = "block"
    _trace: TraceSink | None = None


def _layer_index(name: str) -> int:
    """The first integer component of a module path (``"blocks.3.attn"`` -> 3), else 0."""
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(m.group(1)) if m else 0


@contextlib.contextmanager
def tracing(model: nn.Module) -> Iterator[Trace]:
    """Record energies of every traceable module of ``model`` during the ``with`` body.

    Yields the :class:`Trace` that the forward calls inside the body fill. Nesting is not
    supported (an inner ``tracing`` of the same model replaces, then clears, the sinks).

    Raises:
        ValueError: ``model`` has no traceable module (no energies to record, e.g. GPT or Llama).
    """
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Traceable)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no energy layers to trace; tracing works for the "
                         "energy models (CEM, NRGPT)")
    trace = Trace()
    for name, m in targets:
        m._trace = TraceSink(trace, _layer_index(name), m.trace_sub)
    try:
        yield trace
    finally:
        for _, m in targets:
            m._trace = None
