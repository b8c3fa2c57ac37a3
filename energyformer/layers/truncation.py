"""Truncated back-propagation through recurrent steps: the one rule every recurrent layer follows.

A recurrence of ``T`` steps called with ``backprop_steps=k`` runs its first ``T − k`` steps under
``torch.no_grad()`` (their output state carries no graph: it is detached) and only its last ``k``
steps with a graph, so the activations kept for the backward are those of ``k`` steps whatever
``T`` is. ``k = None`` or ``k ≥ T`` is full back-propagation, on the very same code path.
NRGPT's :class:`~energyformer.layers.nrgpt_recurrent.NRGPTRecurrent`, the recurrent GPT
(:class:`~energyformer.models.recurrent_gpt.RecurrentGPT`) and every CEM sub-block
(:mod:`energyformer.layers.cem`, the steps inside a layer) use the two functions below; the
training loop draws ``T`` and passes ``k`` (``train.backprop_steps``, :mod:`energyformer.train.depth`).
"""
from __future__ import annotations

import contextlib

import torch

from energyformer._validate import check_int

__all__ = ["first_graph_step", "step_grad_mode"]


def first_graph_step(n_steps: int, backprop_steps: int | None) -> int:
    """The index of the first step that runs with a graph: ``max(0, T − k)`` (``0`` for ``k = None``).

    Raises:
        ValueError: ``backprop_steps`` not an integer ``>= 1`` (named ``backprop_steps``).
    """
    if backprop_steps is None:
        return 0
    return max(0, n_steps - check_int("backprop_steps", backprop_steps, 1))


def step_grad_mode(t: int, first_graph: int) -> contextlib.AbstractContextManager:
    """``torch.no_grad()`` for a step ``t`` before ``first_graph``, else a context that changes nothing."""
    return torch.no_grad() if t < first_graph else contextlib.nullcontext()
