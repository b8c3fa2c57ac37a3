"""CEM-Llama: a Llama-shaped language model whose layers are CEM descent steps (docs/cem.md §8).

Token embedding → ``n_layers`` :class:`~energyformer.layers.cem.CEMBlock` (attention energy
step(s), then gated-MLP energy step(s), each with its own RMSNorm, RoPE in attention, no
biases) → final RMSNorm → LM head. Init N(0, 0.02) for every matrix; the D+LR diagonal starts
at 0 and the preconditioner at ``P = I``, so every extension starts as plain tied CEM.

With ``n_steps=1``, step size 1, ``rope="llama"``, ``interaction="lowrank"`` and no
preconditioner the model equals a Hugging Face Llama whose weights are tied
(``v_proj = k_proj``, ``o_proj = q_projᵀ``, ``down_proj = gate_projᵀ``); ``tests/models/test_llama.py``
checks it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from energyformer._validate import check_float, check_int
from energyformer.layers.cem import CEMBlock
from energyformer.layers.cem_options import INTERACTIONS, MLP_TIES
from energyformer.layers.exit import check_cache_exit, parse_exit
from energyformer.layers.kv_cache import cache_length
from energyformer.layers.monotone import DEFAULT_MAX_HALVINGS
from energyformer.layers.step_maps import STEP_MAPS
from energyformer.models.base import LlamaStyleLM
from energyformer.models.config import LlamaShapeConfig
from energyformer.utils.derived import Rule


@dataclass
class CEMConfig(LlamaShapeConfig):
    """CEM-Llama hyper-parameters (docs/cem.md, defaults from docs/choices.md).

    ``interaction``, ``mlp_tie`` and ``preconditioner`` name entries of the registries
    ``INTERACTIONS``, ``MLP_TIES`` and ``STEP_MAPS`` (:mod:`energyformer.layers.cem_options`,
    :mod:`energyformer.layers.step_maps`); a registered entry is accepted without any change here.

    ``n_steps`` sets the recursion ``T`` of both sub-blocks; ``attn_n_steps`` / ``mlp_n_steps``
    override it per sub-block when given. ``attn_step_size`` / ``mlp_step_size`` are the initial
    η (None: 1 for T=1, 1/T otherwise; must stay None with a preconditioner, where η ≡ 1).
    Shape fields (``d_model``, ``n_layers``, ``n_heads``, ``head_dim``, ``d_ff``, ``norm_eps``,
    ``tie_embeddings``, ``init_std``) are shared with Llama (:class:`LlamaShapeConfig`).
    """

    arch: ClassVar[str] = "cem"
    derived: ClassVar[dict[str, Rule]] = {"attn_n_steps": lambda c: c.n_steps, "mlp_n_steps": lambda c: c.n_steps}
    n_steps: int = 1
    attn_n_steps: int | None = None
    mlp_n_steps: int | None = None
    attn_step_size: float | None = None
    mlp_step_size: float | None = None
    learn_step_size: bool = True
    per_step_scale: bool = False
    interaction: str = "lowrank"
    rope: str | None = "exact"
    rope_theta: float = 10000.0
    mlp_tie: str = "gate"
    preconditioner: str | None = None
    preconditioner_rank: int = 8
    grad_through_norm: bool = False

    def check_inputs(self) -> None:
        super().check_inputs()
        check_int("n_steps", self.n_steps, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("attn_n_steps", "mlp_n_steps"):
            check_int(name, getattr(self, name), 1)
        for name in ("attn_step_size", "mlp_step_size"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), 0.0, strict=True)
        INTERACTIONS.get(self.interaction).check_options(d_model=self.d_model, n_heads=self.n_heads,
                                                         head_dim=self.head_dim, rope=self.rope)
        check_float("rope_theta", self.rope_theta, 0.0, strict=True)
        MLP_TIES.check(self.mlp_tie)
        check_int("preconditioner_rank", self.preconditioner_rank, 1)
        if self.preconditioner is not None:
            STEP_MAPS.get(self.preconditioner, "preconditioner").check_options(
                d_model=self.d_model, rank=self.preconditioner_rank, rank_name="preconditioner_rank")
        if self.preconditioner is not None and (self.attn_step_size is not None or self.mlp_step_size is not None):
            raise ValueError("attn_step_size/mlp_step_size must be None with a preconditioner (η ≡ 1, docs/cem.md §6)")


class CEMLlama(LlamaStyleLM):
    """CEM language model ``idx (B, N) -> (logits (B, N, V), loss or None)`` (docs/cem.md §8).

    Under ``with model.trace() as trace:`` every layer's sub-blocks record their states and
    energies per step (terms ``"attn"``, ``"mlp"``; see :mod:`energyformer.layers.trace`).
    """

    embed_name, layers_name = "embed", "blocks"
    legacy_renames = ((r"\.attn\.(q_proj|k_proj|diag)", r".attn.interaction.\1"),  # version 0.1 names
                      (r"\.precond\.", ".preconditioner."))

    def make_layer(self, c: CEMConfig) -> CEMBlock:
        return cem_block(c)

    #: ``(B, N)`` int64: the descent steps each token got in every sub-block of every layer together,
    #: after a call with ``exit`` (else ``None``)
    exit_steps: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, n_steps: int | None = None,
                backprop_steps: int | None = None, cache=None, exit=None, accept_lower_energy: bool = False,
                max_halvings: int = DEFAULT_MAX_HALVINGS):
        """``idx (B, N)`` int64 → ``(logits (B, N, V), loss or None)``.

        ``n_steps=K`` runs ``K`` descent steps in both sub-blocks of every layer for this call
        (default each sub-block's configured ``T``; with ``per_step_scale`` at most ``T``);
        ``backprop_steps=k`` (training) keeps a graph for the last ``k`` steps of each sub-block
        only, the earlier ones run under ``torch.no_grad()`` (docs/models.md, randomized depth).
        ``cache``: as in :meth:`LlamaStyleLM.forward <energyformer.models.base.LlamaStyleLM.forward>`
        (the keys/values are computed once per sub-block, so any ``n_steps`` decodes with one cache).
        ``exit`` (``"rel:0.03"``, ``"energy:1e-3"``, ``"grad:1e-2"``, ``"abs:1e-2"``; not ``kl``) stops each
        token's descent inside every sub-block separately, ``accept_lower_energy`` makes every
        accepted step lower the token's sub-block energy (docs/inference_compute.md §3, §5); the
        context of a sub-block is its input, so neither changes what the cache holds.

        Raises:
            ValueError: bad ids, shape or length; ``n_steps < 1`` (or above the per-step factors);
                ``backprop_steps < 1`` or with a cache; an unknown ``exit`` or ``kl`` (no readout
                inside a layer); ``accept_lower_energy`` with ``rope="llama"`` (no energy).
        """
        steps = {} if n_steps is None and backprop_steps is None else \
            {"n_steps": n_steps, "backprop_steps": backprop_steps}
        crit = parse_exit(exit)
        if cache is not None:  # one exit per cache: later layers' keys depend on earlier layers' exits
            check_cache_exit(cache, cache_length(cache), crit)
        if crit is not None or accept_lower_energy:
            steps.update(exit=crit, accept_lower_energy=accept_lower_energy, max_halvings=max_halvings)
        if self.exit_steps is not None:
            self.exit_steps = None
        out = self.run_layers(idx, targets, cache, **steps)
        if crit is not None:
            self.exit_steps = sum(b.exit_steps for b in getattr(self, self.layers_name))
        return out


def cem_block(c: CEMConfig) -> CEMBlock:
    """One CEM layer (attention then gated-MLP descent steps) with every option of ``c``."""
    return CEMBlock(c.d_model, c.n_heads, c.d_ff, head_dim=c.head_dim,
                    attn_n_steps=c.attn_n_steps, mlp_n_steps=c.mlp_n_steps,
                    attn_step_size=c.attn_step_size, mlp_step_size=c.mlp_step_size,
                    interaction=c.interaction, rope=c.rope, rope_theta=c.rope_theta, mlp_tie=c.mlp_tie,
                    preconditioner=c.preconditioner, preconditioner_rank=c.preconditioner_rank,
                    norm="rmsnorm", norm_eps=c.norm_eps, grad_through_norm=c.grad_through_norm,
                    learn_step_size=c.learn_step_size, per_step_scale=c.per_step_scale)
