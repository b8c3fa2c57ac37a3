"""Recurrent GPT baselines of the NRGPT paper (SPEC §2.3): one shared GPT block applied ``n_steps`` times.

* ``parallel=False`` — **GPT_Rec**: the sequential pre-norm block
  ``x ← x + Attn(LN₁x); x ← x + MLP(LN₂x)``.
* ``parallel=True`` — **GPT_Rec_parallel**: the GPT-J-style block
  ``x ← x + Attn(LN₁x) + MLP(LN₂x)`` (the baseline NRGPT is compared with on ListOps / OWT).

As in the reference code: learned absolute positions, no embedding dropout, ReLU MLP
(``activation="gelu"`` available), attention output projection with bias, untied LM head with
bias, all Linear/Embedding weights ``N(0, 0.02²)`` and biases 0 (no scaled residual init).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.layers.baseline import ACTIVATIONS, GPTBlock
from energyformer.models.base import CausalLM, ModelConfig


@dataclass
class RecurrentGPTConfig(ModelConfig):
    """GPT_Rec / GPT_Rec_parallel hyper-parameters.

    ``n_steps`` is the number of applications of the one shared block (the reference code's
    ``n_layer``); ``d_ff`` defaults to ``4·d_model``.

    Raises:
        ValueError: ``n_steps < 1``, ``n_heads`` not dividing ``d_model``, bad activation, ...
    """

    arch: ClassVar[str] = "gpt_rec"
    d_model: int = 128
    n_heads: int = 4
    n_steps: int = 6
    d_ff: int | None = None
    dropout: float = 0.0
    activation: str = "relu"
    bias: bool = True
    parallel: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("d_model", self.d_model, 1)
        check_int("n_heads", self.n_heads, 1)
        check_divides("n_heads", self.n_heads, "d_model", self.d_model)
        check_int("n_steps", self.n_steps, 1)
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        check_int("d_ff", self.d_ff, 1)
        check_float("dropout", self.dropout, 0.0, maximum=0.999)
        check_choice("activation", self.activation, ACTIVATIONS)
        for name in ("bias", "parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")


class RecurrentGPT(CausalLM):
    """GPT with one weight-shared block applied ``n_steps`` times: ``idx (B, N) -> logits (B, N, V)``."""

    def __init__(self, config: RecurrentGPTConfig):
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = nn.Embedding(c.block_size, c.d_model)
        self.block = GPTBlock(c.d_model, c.n_heads, c.d_ff, activation=c.activation, dropout=c.dropout,
                              bias=c.bias, parallel=c.parallel)
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.bias)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.bias)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def embedding_params(self) -> list[nn.Parameter]:
        return [self.wte.weight, self.wpe.weight]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, n_steps: int | None = None):
        """``idx (B, N)`` → ``(logits (B, N, V), loss or None)``.

        ``n_steps`` overrides the number of block applications for this call (default
        ``config.n_steps``).

        Raises:
            ValueError: bad ids / length (``check_input``) or ``n_steps < 1``.
        """
        self.check_input(idx, targets)
        T = self.config.n_steps if n_steps is None else check_int("n_steps", n_steps, 1)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for _ in range(T):
            x = self.block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, self.lm_loss(logits, targets)
