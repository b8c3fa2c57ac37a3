"""Optimizer and learning-rate schedule (docs/nrgpt.md §6, §7).

- AdamW with weight decay on every parameter with >= 2 dimensions (matrices, embeddings, the
  NRGPT ``J_h`` and ``eta`` matrices) and none on 1-D ones (biases, norm gains, scalars such as
  ``s_ff``); frozen parameters (``requires_grad=False``) are left out. Fused when available.
  A module can exempt its own >= 2-D parameters by listing their local names in a class attribute
  ``no_weight_decay`` (CEM's per-head diagonal and the preconditioner factors do: decaying them
  would pull a per-head diagonal to zero while the shared (1-D) diagonal is not decayed, and
  pull P towards its diagonal, which would bias the ablations).
- ``lr_at(step, cfg)``: linear warmup, then cosine (default) or exponential decay to ``min_lr``
  at ``lr_decay_steps``, then constant ``min_lr``; ``lr_schedule="constant"`` keeps the peak LR
  after warmup; ``lr_schedule="wsd"`` keeps it until a linear cooldown of ``cooldown_steps``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from energyformer.runs.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed (>= 2-D) and a non-decayed (< 2-D) group.

    Shared (tied) parameters appear once (``model.parameters()`` de-duplicates them).
    """
    exempt = {id(getattr(m, name)) for m in model.modules()
              for name in getattr(m, "no_weight_decay", ()) if getattr(m, name, None) is not None}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in exempt else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups(model, cfg.weight_decay)`` with ``betas=(beta1, beta2)``.

    Uses the fused kernel when the parameters' device supports it, else the foreach one. The
    learning rate is set by the loop at every step from :func:`lr_at`.

    Raises:
        ValueError: the model has no trainable parameters.
    """
    groups = param_groups(model, cfg.weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):  # device or dtype without a fused kernel
        return torch.optim.AdamW(groups, foreach=None, **kwargs)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based); a pure function of ``step`` and ``cfg``.

    - ``step < warmup_steps``: ``learning_rate * (step + 1) / (warmup_steps + 1)`` (nanoGPT),
    - ``warmup_steps <= step <= lr_decay_steps``: decay from ``learning_rate`` to ``min_lr`` over
      ``r = (step - warmup) / (lr_decay_steps - warmup)``: cosine ``min + (lr - min)(1 + cos(pi r)) / 2``
      or exponential ``lr * (min / lr) ** r``,
    - ``step > lr_decay_steps``: ``min_lr``.

    ``lr_schedule="wsd"`` (warmup-stable-decay): ``learning_rate`` after warmup until
    ``lr_decay_steps - cooldown_steps``, then a linear cooldown that reaches ``min_lr`` at
    ``lr_decay_steps``, then ``min_lr``.

    A run's steps are ``0 … max_steps - 1`` (the log's ``step s/S`` is ``lr_at(s - 1)``), so with the
    default ``lr_decay_steps = max_steps`` the last step is one short of ``min_lr`` (this convention is
    kept: the published runs were trained on it).
    """
    lr, min_lr = cfg.learning_rate, cfg.min_lr
    if step < cfg.warmup_steps:
        return lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return lr
    if step > cfg.lr_decay_steps:
        return min_lr
    if cfg.lr_schedule == "wsd":
        start = cfg.lr_decay_steps - cfg.cooldown_steps
        if step <= start:
            return lr
        return lr + (min_lr - lr) * (step - start) / cfg.cooldown_steps
    span = cfg.lr_decay_steps - cfg.warmup_steps
    ratio = 1.0 if span == 0 else (step - cfg.warmup_steps) / span
    if cfg.lr_schedule == "exponential":
        return lr * (min_lr / lr) ** ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
