"""A sequence regressor for in-context regression (docs/cem.md §9): continuous values in, a value out.

The input is a batch of sequences of pairs ``xy`` ``(B, n, x_dim + 1)`` (``x_i`` then ``y_i``,
as :mod:`energyformer.data.gp` writes them). Each pair becomes two tokens through one linear
read-in of ``[x, y, is_x, is_y]`` (``x`` zero on a y-token, ``y`` zero on an x-token)::

    tokens = x_1, y_1, x_2, y_2, …, x_n, y_n              (B, 2n, d)
    h      = blocks(tokens)                                (CEM or Llama blocks, RoPE positions)
    ŷ_i    = w · RMSNorm(h)[x_i token] + b                 (B, n): y_i predicted from x_1, y_1, …, x_i

The loss is the mean squared error of ``ŷ`` against ``y`` over all positions. The blocks are
the library's own (:class:`~energyformer.layers.cem.CEMBlock` for ``backbone="cem"``,
:class:`~energyformer.layers.baseline.LlamaBlock` for ``"llama"``), with every option of the
language models; under ``with model.trace() as trace:`` a CEM backbone records its energies as
:class:`~energyformer.models.cem.CEMLlama` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_int
from energyformer.layers.baseline import LlamaBlock
from energyformer.layers.norms import RMSNorm
from energyformer.models.base import CausalLM, init_weights
from energyformer.models.cem import CEMConfig, cem_block

BACKBONES = ("cem", "llama")


@dataclass
class RegressorConfig(CEMConfig):
    """In-context regressor hyper-parameters: every field of :class:`~energyformer.models.cem.CEMConfig`
    (the CEM fields apply to ``backbone="cem"`` only and mean what they mean there), plus
    ``x_dim`` and ``backbone``.

    ``block_size`` counts tokens (two per pair: at most ``block_size // 2`` pairs);
    ``vocab_size`` is unused (there are no tokens) and kept for the shared config machinery.

    Raises:
        ValueError: an unknown backbone or option, ``x_dim < 1``, ``block_size < 2``, an odd
            ``head_dim`` (RoPE), or any invalid shared field.
    """

    arch: ClassVar[str] = "regressor"
    vocab_size: int = 1
    block_size: int = 64
    x_dim: int = 2
    backbone: str = "cem"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("x_dim", self.x_dim, 1)
        check_int("block_size", self.block_size, 2)
        check_choice("backbone", self.backbone, BACKBONES)
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")


class SequenceRegressor(CausalLM):
    """In-context regressor ``xy (B, n, x_dim + 1) -> (ŷ (B, n), loss or None)`` (module docstring)."""

    def __init__(self, config: RegressorConfig):
        super().__init__()
        self.config = c = config
        self.read_in = nn.Linear(c.x_dim + 3, c.d_model)
        if c.backbone == "cem":
            blocks = [cem_block(c) for _ in range(c.n_layers)]
        else:
            blocks = [LlamaBlock(c.d_model, c.n_heads, c.n_heads, c.head_dim, c.d_ff, c.rope_theta,
                                 c.norm_eps) for _ in range(c.n_layers)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(c.d_model, eps=c.norm_eps)
        self.head = nn.Linear(c.d_model, 1)
        init_weights(self, c.init_std)

    def check_input(self, xy: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Validate ``xy`` ``(B, n, x_dim + 1)`` (floating point, ``2n ≤ block_size``) and ``targets`` ``(B, n)``.

        Raises:
            ValueError: wrong type, dtype, rank, feature size, length or targets shape (named).
        """
        c = self.config
        if not isinstance(xy, torch.Tensor) or not xy.is_floating_point():
            raise ValueError(f"xy must be a floating-point tensor (B, n, x_dim + 1 = {c.x_dim + 1}); got "
                             f"{xy.dtype if isinstance(xy, torch.Tensor) else type(xy).__name__}")
        if xy.dim() != 3 or xy.shape[-1] != c.x_dim + 1 or xy.shape[1] == 0:
            raise ValueError(f"xy must have shape (B, n >= 1, x_dim + 1 = {c.x_dim + 1}); got {tuple(xy.shape)}")
        if 2 * xy.shape[1] > c.block_size:
            raise ValueError(f"{xy.shape[1]} pairs need {2 * xy.shape[1]} tokens, more than block_size={c.block_size}")
        if targets is not None and (not isinstance(targets, torch.Tensor) or targets.shape != xy.shape[:2]):
            got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
            raise ValueError(f"targets must have shape (B, n) = {tuple(xy.shape[:2])}; got {got}")

    def tokens(self, xy: torch.Tensor) -> torch.Tensor:
        """The read-in ``(B, 2n, d)``: x-tokens at even positions, y-tokens at odd ones."""
        B, n, _ = xy.shape
        x, y = xy[..., :-1], xy[..., -1:]
        zeros_x, zeros_y, ones = x.new_zeros(B, n, x.shape[-1]), y.new_zeros(B, n, 1), y.new_ones(B, n, 1)
        x_tok = torch.cat([x, zeros_y, ones, zeros_y], dim=-1)
        y_tok = torch.cat([zeros_x, y, zeros_y, ones], dim=-1)
        return self.read_in(torch.stack([x_tok, y_tok], dim=2).reshape(B, 2 * n, -1))

    def forward(self, xy: torch.Tensor, targets: torch.Tensor | None = None):
        """``xy`` (B, n, x_dim + 1) -> ``(ŷ (B, n), loss or None)``; ``ŷ_i`` sees ``x_1, y_1, …, x_i`` only.

        ``targets`` (B, n) are the values to predict (usually ``xy[..., -1]``); the loss is their
        mean squared error.

        Raises:
            ValueError: see :meth:`check_input`.
        """
        self.check_input(xy, targets)
        h = self.tokens(xy)
        for block in self.blocks:
            h = block(h)
        pred = self.head(self.norm(h[:, 0::2])).squeeze(-1)
        loss = None if targets is None else F.mse_loss(pred.float(), targets.float())
        return pred, loss

    def generate(self, *args, **kwargs):  # pragma: no cover - there are no tokens to sample
        raise ValueError("a SequenceRegressor predicts values; it does not generate tokens")
