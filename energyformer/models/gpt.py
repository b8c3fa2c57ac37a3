"""GPT baseline, nanoGPT-style (docs/baselines.md §3): learned positions, pre-norm blocks, LayerNorm.

Defaults follow the NRGPT reference code's GPT (ReLU MLP, output-projection bias, untied LM
head with bias) so that parameter counts match docs/nrgpt.md §9; ``activation="gelu"`` and
``tie_embeddings=True`` give GPT-2's choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer.layers.baseline import GPTBlock
from energyformer.layers.kv_cache import cache_length
from energyformer.models.base import LearnedPositionLM, init_weights
from energyformer.models.config import GPTShapeConfig


@dataclass
class GPTConfig(GPTShapeConfig):
    """GPT hyper-parameters: the shared GPT fields (:class:`GPTShapeConfig`) plus depth and the embedding tie."""

    arch: ClassVar[str] = "gpt"
    positive_ints: ClassVar[tuple[str, ...]] = ("n_layers",)
    n_layers: int = 4
    tie_embeddings: bool = False


class GPT(LearnedPositionLM):
    """nanoGPT-style decoder: ``idx (B, N) -> logits (B, N, V)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        self.make_embeddings(c, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(c.d_model, c.n_heads, c.d_ff, c.activation, c.dropout, c.bias) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.bias)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.bias and not c.tie_embeddings)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        init_weights(self, 0.02)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layers))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache=None):
        """``idx (B, N)`` int64 → ``(logits (B, N, V), loss or None)``. Raises ``ValueError`` on bad ids/length.

        ``cache`` (docs/architecture.md §5): ``idx`` follows the cached positions; slot ``i`` is block ``i``.
        """
        offset = cache_length(cache)
        self.check_input(idx, targets, offset)
        x = self.drop(self.embed(idx, offset))
        for i, block in enumerate(self.blocks):
            x = block(x) if cache is None else block(x, cache, i)
        logits = self.lm_head(self.ln_f(x))
        return logits, self.lm_loss(logits, targets)
