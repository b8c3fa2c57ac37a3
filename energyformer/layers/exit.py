"""Per-token adaptive exit of the recurrent models (docs/inference_compute.md §2–§4).

A recurrent model (NRGPT, the recurrent GPTs, a CEM sub-block's steps) runs up to ``T`` steps
``x^{t+1} = step(x^t)``. With an exit criterion, every token ``i`` carries an *active* flag: after
step ``t`` the criterion looks at token ``i``'s transition ``x_i^t → x_i^{t+1}`` and, where it
*fires* (its score is below the threshold), the token exits: its state stays ``x_i^{t+1}`` for
every later step while the other tokens continue::

    x^{t+1} = where(active, step(x^t), x^t)          (B, N, d)
    steps  += active                                  (B, N)   the updates each token got
    active &= ~criterion.fires(transition t → t+1)    (B, N)

Every score of a token depends only on positions ``≤ i`` (its own states, its energy, its
next-token distribution), so exits keep the model causal. An exited token is still *read* by
later tokens: at every later step its state (and, in cached decoding, its cache entry for that
step) is its state frozen at its exit step (the cache rule, docs/inference_compute.md §4).

The criteria are a registry (:data:`EXIT_CRITERIA`, option ``exit``): a name → a class with a
``score(view) -> (B, N)``; :func:`parse_exit` reads the CLI spelling ``name:threshold``. A user's
own criterion is one ``@EXIT_CRITERIA.register("name")`` class; it then works everywhere a name
is accepted (``forward(exit=...)``, ``generate``, ``energyformer sample --exit``, the export)::

    from energyformer.layers.exit import EXIT_CRITERIA, ExitCriterion

    @EXIT_CRITERIA.register("top1_margin")
    class Top1Margin(ExitCriterion):
        '''Exit once the top-1 probability stops moving.'''
        needs = frozenset({"logits"})
        def score(self, view):
            return (view.logits_new.softmax(-1).amax(-1) - view.logits_prev.softmax(-1).amax(-1)).abs()
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from energyformer.utils.registry import Registry

__all__ = ["EXIT_CRITERIA", "ExitCriterion", "ExitView", "ExitState", "parse_exit", "KNOWN_NEEDS", "check_cache_exit"]

#: what a criterion may ask the model to compute per step (beyond the two states)
KNOWN_NEEDS = frozenset({"energy", "grad", "logits"})

EXIT_CRITERIA: Registry[type[ExitCriterion]] = Registry(
    "exit", "per-token exit criteria of the recurrent models (`forward(exit=...)`, `sample --exit`)",
    "docs/inference_compute.md §2")


@dataclass
class ExitView:
    """One step ``t → t+1`` of every token, as a criterion sees it (docs/inference_compute.md §2).

    Attributes:
        t: the step just taken (0-based); the state is now ``x^{t+1}``.
        x_prev, x_new: the residual streams ``x^t`` and ``x^{t+1}`` ``(B, N, d)``.
        energy_prev, energy_new: per-token total energies ``E_i(x^t)``, ``E_i(x^{t+1})`` ``(B, N)``
            (energy models, when the criterion ``needs`` ``"energy"``; else ``None``).
        grad_new: ``∂E_i/∂g_i`` at ``x^{t+1}`` ``(B, N, d)`` (``"grad"``; else ``None``).
        logits_prev, logits_new: next-token logits read out of ``x^t`` and ``x^{t+1}`` ``(B, N, V)``
            (``"logits"``; else ``None``).
    """

    t: int
    x_prev: torch.Tensor
    x_new: torch.Tensor
    energy_prev: torch.Tensor | None = None
    energy_new: torch.Tensor | None = None
    grad_new: torch.Tensor | None = None
    logits_prev: torch.Tensor | None = None
    logits_new: torch.Tensor | None = None


class ExitCriterion:
    """Base class of the exit criteria: a token exits after the step where ``score < threshold``.

    Subclasses set ``needs`` (a subset of ``{"energy", "grad", "logits"}``: what the model must
    compute per step), ``default_threshold``, and implement :meth:`score` ``(B, N)`` (≥ 0 for the
    built-in ones, so ``threshold = 0`` never fires).

    Args:
        threshold: the exit threshold (default ``default_threshold``), a finite number ≥ 0.

    Raises:
        ValueError: a negative or non-finite threshold (named ``exit threshold``).
    """

    needs: ClassVar[frozenset[str]] = frozenset()
    default_threshold: ClassVar[float] = 1e-3
    name: ClassVar[str] = ""
    section: ClassVar[str] = "docs/inference_compute.md §2"

    def __init__(self, threshold: float | None = None):
        value = self.default_threshold if threshold is None else threshold
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"exit threshold {threshold!r} of {self.name!r} is not a number") from None
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"exit threshold {threshold!r} of {self.name!r} must be a finite number >= 0")
        self.threshold = value

    def score(self, view: ExitView) -> torch.Tensor:  # pragma: no cover - abstract
        """The measured quantity per token ``(B, N)``."""
        raise NotImplementedError

    def fires(self, view: ExitView) -> torch.Tensor:
        """``score(view) < threshold``: ``(B, N)`` bool, True where the token exits after this step."""
        return self.score(view) < self.threshold

    def spec(self) -> str:
        """The ``name:threshold`` spelling (what :func:`parse_exit` reads back)."""
        return f"{self.name}:{self.threshold:g}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.threshold == self.threshold  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]


def _norm(v: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(v.float(), dim=-1)


@EXIT_CRITERIA.register("abs")
class AbsoluteChange(ExitCriterion):
    """Absolute state change `‖x_i^{t+1} − x_i^t‖₂` (L2 over the d features) below the threshold."""

    default_threshold = 1e-2

    def score(self, view: ExitView) -> torch.Tensor:
        return _norm(view.x_new - view.x_prev)


@EXIT_CRITERIA.register("rel")
class RelativeChange(ExitCriterion):
    """Relative state change `‖x_i^{t+1} − x_i^t‖₂ / ‖x_i^{t+1}‖₂` below the threshold (scale-free)."""

    default_threshold = 3e-2

    def score(self, view: ExitView) -> torch.Tensor:
        return _norm(view.x_new - view.x_prev) / _norm(view.x_new).clamp_min(1e-12)


@EXIT_CRITERIA.register("kl")
class KLChange(ExitCriterion):
    """`KL(p^{t+1} ‖ p^t)` (nats) between the next-token distributions read out of successive states."""

    needs = frozenset({"logits"})
    default_threshold = 1e-3

    def score(self, view: ExitView) -> torch.Tensor:
        new = torch.log_softmax(view.logits_new.float(), dim=-1)
        old = torch.log_softmax(view.logits_prev.float(), dim=-1)
        return (new.exp() * (new - old)).sum(-1).clamp_min(0.0)


@EXIT_CRITERIA.register("energy")
class EnergyChange(ExitCriterion):
    """Energy change `|E_i(x^{t+1}) − E_i(x^t)|` of the token's total energy (energy models only)."""

    needs = frozenset({"energy"})
    default_threshold = 1e-3

    def score(self, view: ExitView) -> torch.Tensor:
        return (view.energy_new.float() - view.energy_prev.float()).abs()


@EXIT_CRITERIA.register("grad")
class GradNorm(ExitCriterion):
    """Gradient norm `‖∂E_i/∂g_i‖₂` at the new state (energy models only): the token is near a stationary point."""

    needs = frozenset({"grad"})
    default_threshold = 1e-2

    def score(self, view: ExitView) -> torch.Tensor:
        return _norm(view.grad_new)


def parse_exit(spec: Any) -> ExitCriterion | None:
    """An exit criterion from ``None``, an :class:`ExitCriterion`, or the spelling ``"name"`` /
    ``"name:threshold"`` (e.g. ``"kl:1e-3"``; ``"none"`` or ``""`` is no exit).

    Raises:
        ValueError: an unknown name (the message lists the known criteria), a threshold that is not
            a number or is negative (the message names the bad value and the whole spec), or a
            value of another type.
    """
    if spec is None or isinstance(spec, ExitCriterion):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"exit={spec!r} must be a string 'name:threshold' (e.g. 'kl:1e-3') or an ExitCriterion")
    text = spec.strip()
    if text.lower() in ("", "none", "off"):
        return None
    name, sep, value = text.partition(":")
    name = name.strip()
    if name not in EXIT_CRITERIA:
        raise ValueError(f"exit={spec!r}: unknown exit criterion {name!r}; known criteria: "
                         f"{', '.join(EXIT_CRITERIA.names())} (spelled name:threshold, e.g. kl:1e-3)")
    cls = EXIT_CRITERIA.get(name)
    if not sep:
        return cls()
    try:
        threshold = float(value)
    except ValueError:
        raise ValueError(f"exit={spec!r}: the threshold {value.strip()!r} is not a number "
                         f"(spelled name:threshold, e.g. {name}:{cls.default_threshold:g})") from None
    if not threshold >= 0 or threshold == float("inf"):
        raise ValueError(f"exit={spec!r}: the threshold {value.strip()!r} must be a finite number >= 0")
    return cls(threshold)


class ExitState:
    """The per-token bookkeeping of one adaptive-exit run: the plain loop every model follows.

    Args:
        criterion: the criterion (or anything :func:`parse_exit` reads).
        x: the initial state ``(B, N, d)`` (fixes shape and device).
        supports: what the model can compute per step (a subset of ``KNOWN_NEEDS``); a criterion
            needing more raises.
        model: the model's name, for the error message.

    Attributes:
        active: ``(B, N)`` bool, tokens still stepping.
        steps: ``(B, N)`` int64, the updates each token got so far.

    Raises:
        ValueError: as :func:`parse_exit`; a criterion that needs what the model cannot compute
            (e.g. ``energy`` on a recurrent GPT, ``logits`` inside a CEM layer).
    """

    def __init__(self, criterion: Any, x: torch.Tensor, supports: frozenset[str] | set[str], model: str):
        crit = parse_exit(criterion)
        if crit is None:
            raise ValueError("ExitState needs a criterion")
        missing = set(crit.needs) - set(supports)
        if missing:
            usable = [n for n in EXIT_CRITERIA.names() if set(EXIT_CRITERIA.get(n).needs) <= set(supports)]
            raise ValueError(f"exit criterion {crit.name!r} needs {sorted(missing)}, which {model} does not "
                             f"compute; usable criteria here: {', '.join(usable)}")
        self.criterion = crit
        self.needs = frozenset(crit.needs)
        self.active = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        self.steps = torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)

    def apply(self, x_prev: torch.Tensor, x_new: torch.Tensor) -> torch.Tensor:
        """``where(active, x_new, x_prev)`` and count the step for the active tokens: ``(B, N, d)``."""
        self.steps += self.active.long()
        return torch.where(self.active.unsqueeze(-1), x_new, x_prev)

    def update(self, view: ExitView) -> bool:
        """Let the criterion see the step; mark the tokens that exit. Returns whether any token is still active."""
        self.active = self.active & ~self.criterion.fires(view)  # a new tensor: where() saved the old one
        return bool(self.active.any())


def check_cache_exit(cache: Any, offset: int, crit: ExitCriterion | None, **options: Any) -> None:
    """Record in ``cache.meta`` the exit (and ``options``) a cache is filled with; refuse a reuse with
    others (the cached states would mix two rules). A cache without ``meta`` (a ``transformers``
    ``Cache``) is not checked.

    Raises:
        ValueError: ``offset > 0`` cached positions filled with another exit or options.
    """
    meta = getattr(cache, "meta", None)
    if not isinstance(meta, dict):
        return
    want = {"exit": None if crit is None else crit.spec(), **options}
    have = {k: meta.get(k) for k in want}
    if offset and have != want:
        raise ValueError(f"this cache was filled with {have}; got {want} (start a new cache to change them)")
    meta.update(want)


def readout_logits(readout: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
    """``readout(x)`` (B, N, V); raises ``ValueError`` when the model gave no readout."""
    if readout is None:
        raise ValueError("this exit criterion needs next-token logits; call it through the language model")
    return readout(x)
