"""GPT baseline, nanoGPT-style (SPEC §2.3): learned positions, pre-norm blocks, LayerNorm.

Defaults follow the NRGPT reference code's GPT (ReLU MLP, output-projection bias, untied LM
head with bias) so that parameter counts match SPEC §4.9; ``activation="gelu"`` and
``tie_embeddings=True`` give GPT-2's choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.layers.baseline import ACTIVATIONS, GPTBlock
from energyformer.models.base import CausalLM, ModelConfig


@dataclass
class GPTConfig(ModelConfig):
    """GPT hyper-parameters. ``d_ff`` defaults to ``4·d_model``."""

    arch: ClassVar[str] = "gpt"
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int | None = None
    dropout: float = 0.0
    activation: str = "relu"
    bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("d_model", self.d_model, 1)
        check_int("n_layers", self.n_layers, 1)
        check_int("n_heads", self.n_heads, 1)
        check_divides("n_heads", self.n_heads, "d_model", self.d_model)
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        check_int("d_ff", self.d_ff, 1)
        check_float("dropout", self.dropout, 0.0, maximum=0.999)
        check_choice("activation", self.activation, ACTIVATIONS)


class GPT(CausalLM):
    """nanoGPT-style decoder: ``idx (B, N) -> logits (B, N, V)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(c.d_model, c.n_heads, c.d_ff, c.activation, c.dropout, c.bias) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.bias)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.bias and not c.tie_embeddings)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layers))

    def embedding_params(self) -> list[nn.Parameter]:
        return [self.wte.weight, self.wpe.weight]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """``idx (B, N)`` int64 → ``(logits (B, N, V), loss or None)``. Raises ``ValueError`` on bad ids/length."""
        self.check_input(idx, targets)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, self.lm_loss(logits, targets)


def _init_weights(module: nn.Module) -> None:
    """N(0, 0.02) for Linear/Embedding weights, zero biases (nanoGPT / reference code)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
