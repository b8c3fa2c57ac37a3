"""Recurrent GPT baselines of the NRGPT paper (docs/baselines.md §3): one shared GPT block applied ``n_steps`` times.

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

from energyformer._validate import check_int
from energyformer.layers.baseline import GPTBlock
from energyformer.layers.exit import ExitState, ExitView, check_cache_exit, parse_exit
from energyformer.layers.kv_cache import cache_length
from energyformer.layers.truncation import first_graph_step, step_grad_mode
from energyformer.models.base import LearnedPositionLM, init_weights
from energyformer.models.config import GPTShapeConfig


@dataclass
class RecurrentGPTConfig(GPTShapeConfig):
    """GPT_Rec / GPT_Rec_parallel hyper-parameters: the shared GPT fields (:class:`GPTShapeConfig`) plus

    ``n_steps``, the number of applications of the one shared block (the reference code's
    ``n_layer``), and ``parallel`` (GPT_Rec_parallel).

    Raises:
        ValueError: ``n_steps < 1``, ``n_heads`` not dividing ``d_model``, bad activation, ...
    """

    arch: ClassVar[str] = "gpt_rec"
    positive_ints: ClassVar[tuple[str, ...]] = ("n_steps",)
    n_steps: int = 6
    parallel: bool = False


class RecurrentGPT(LearnedPositionLM):
    """GPT with one weight-shared block applied ``n_steps`` times: ``idx (B, N) -> logits (B, N, V)``."""

    def __init__(self, config: RecurrentGPTConfig):
        super().__init__()
        self.config = c = config
        self.make_embeddings(c, c.d_model)
        self.block = GPTBlock(c.d_model, c.n_heads, c.d_ff, activation=c.activation, dropout=c.dropout,
                              bias=c.bias, parallel=c.parallel)
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.bias)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.bias)
        init_weights(self, 0.02)

    #: ``(B, N)`` int64: the block applications each token got in the last call with ``exit`` (else ``None``)
    exit_steps: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, n_steps: int | None = None,
                cache=None, backprop_steps: int | None = None, exit=None):
        """``idx (B, N)`` → ``(logits (B, N, V), loss or None)``.

        ``n_steps`` overrides the number of block applications for this call (default
        ``config.n_steps``). ``backprop_steps=k`` (training) runs the first ``T − k`` applications
        under ``torch.no_grad()`` and back-propagates through the last ``k`` only
        (:mod:`energyformer.layers.truncation`; ``None`` or ``k ≥ T``: all of them; with ``k < T``
        the embeddings get no gradient from that call). ``cache`` (docs/architecture.md §5): ``idx`` follows the cached
        positions; the keys depend on the state at each step, so slot ``t`` is step ``t`` (a
        cache must be filled and used with one ``n_steps``).

        ``exit`` (docs/inference_compute.md): per-token adaptive exit, an
        :class:`~energyformer.layers.exit.ExitCriterion` or ``"name:threshold"`` needing no energy
        (``abs``, ``rel``, ``kl``); ``n_steps`` is then the most applications a token gets. An exited
        token keeps its state, which later tokens read at every later step (its cache entries for
        later slots are the keys/values of that frozen state). ``self.exit_steps`` ``(B, N)`` holds the
        applications each token got.

        Raises:
            ValueError: bad ids / length (``check_input``), ``n_steps < 1``, ``backprop_steps < 1``
                or ``backprop_steps`` with a cache, an unknown ``exit`` or one needing an energy.
        """
        offset = cache_length(cache)
        self.check_input(idx, targets, offset)
        T = self.config.n_steps if n_steps is None else check_int("n_steps", n_steps, 1)
        first_graph = first_graph_step(T, backprop_steps)
        if cache is not None and backprop_steps is not None:
            raise ValueError(f"backprop_steps={backprop_steps} is for training; call without a cache")
        x = self.embed(idx, offset)
        crit = parse_exit(exit)
        if cache is not None:
            check_cache_exit(cache, offset, crit, n_steps=T)
        if self.exit_steps is not None:  # (no attribute write in the plain path: torch.compile)
            self.exit_steps = None
        if crit is not None:
            x = self._run_with_exit(x, T, crit, cache, first_graph)
        else:
            for t in range(T):
                with step_grad_mode(t, first_graph):  # the steps before the last backprop_steps: no graph
                    x = self.block(x) if cache is None else self.block(x, cache, t)
        logits = self.readout(x)
        return logits, self.lm_loss(logits, targets)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits of states ``x`` ``(B, N, d)``: ``lm_head(ln_f(x))`` ``(B, N, V)``."""
        return self.lm_head(self.ln_f(x))

    def _run_with_exit(self, x: torch.Tensor, T: int, crit, cache, first_graph: int) -> torch.Tensor:
        """The block applications with a per-token exit (docs/inference_compute.md §3–§4); the
        plain loop when the criterion never fires (tested equal)."""
        state = ExitState(crit, x, frozenset({"logits"}), "the recurrent GPT (no energy)")
        lg_prev = self.readout(x) if "logits" in state.needs else None
        for t in range(T):
            with step_grad_mode(t, first_graph):
                x_new = state.apply(x, self.block(x) if cache is None else self.block(x, cache, t))
            if t + 1 == T:
                x = x_new
                break
            view = ExitView(t, x, x_new)
            if lg_prev is not None:
                view.logits_prev, view.logits_new = lg_prev, self.readout(x_new)
                lg_prev = view.logits_new
            x = x_new
            if not state.update(view):
                if cache is not None:  # exited: the later slots get the frozen states' keys/values
                    for later in range(t + 1, T):
                        self.block(x, cache, later)
                break
        self.exit_steps = state.steps
        return x
