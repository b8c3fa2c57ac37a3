"""Rotary position embedding layer (docs/baselines.md §3 Llama baseline, docs/cem.md §2.1 CEM RoPE modes).

The math is in :mod:`energyformer.energies.heads` (re-exported here). :class:`RotaryEmbedding`
holds ``head_dim`` and ``theta`` and returns ``(cos, sin)`` tables of shape ``(N, head_dim)``
for positions ``0 … N−1`` (or ``start … start+N−1``); it has no parameters or buffers (the tables are cheap to rebuild
and this keeps ``state_dict`` free of derived tensors).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from energyformer._validate import check_float, check_int
from energyformer.energies.heads import apply_rope, rope_cos_sin, rope_matrices, rotate_half

__all__ = ["RotaryEmbedding", "apply_rope", "rope_cos_sin", "rope_matrices", "rotate_half"]


class RotaryEmbedding(nn.Module):
    """``(N, device, dtype) -> (cos, sin)``, each ``(N, head_dim)`` (Llama "rotate-half" layout).

    Raises:
        ValueError: ``head_dim`` odd or < 2, ``theta <= 0``.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        check_int("head_dim", head_dim, 1)
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even to use RoPE (features are rotated in pairs)")
        self.head_dim = head_dim
        self.theta = check_float("rope_theta", theta, 0.0, strict=True)

    def forward(self, n_positions: int, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions ``start … start + n_positions − 1`` (``start > 0`` in cached decoding)."""
        return rope_cos_sin(n_positions, self.head_dim, self.theta, device=device, dtype=dtype, start=start)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
