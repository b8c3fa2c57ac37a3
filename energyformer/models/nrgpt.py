"""NRGPT (eNeRgy-GPT) language model (docs/nrgpt.md §6): one shared energy block applied ``n_steps`` times.

::

    x⁰ = E_tok[idx] + E_pos[0:N]                       (B, N, d)
    xᵗ⁺¹ = xᵗ − κ_t η(∂E_AT/∂g + s_ff ∂E_FF/∂g),  g = Norm(xᵗ)   (t = 0 … T−1, one shared block)
    logits = lm_head(LayerNorm(xᵀ))                     (B, N, V), untied head with bias

Extras beyond the reference code:

* energy traces (``with model.trace() as trace:``) — per-step, per-term, per-token energies;
* inference-time scaling (``n_steps=K`` at call time, more or fewer steps than trained) and
  per-token early stopping (``stop_tol``);
* every option of :class:`energyformer.layers.nrgpt.NRGPTBlock`, and a reference preset
  (:meth:`NRGPTConfig.reference`, or ``preset: reference`` in a YAML recipe) that reproduces
  the released code's model exactly (docs/nrgpt.md §2–§6).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_choice, check_float, check_int, check_width
from energyformer.layers.kv_cache import cache_length
from energyformer.layers.monotone import DEFAULT_MAX_HALVINGS
from energyformer.layers.norms import LayerNorm, canonical_norm
from energyformer.layers.nrgpt import NRGPTBlock
from energyformer.layers.nrgpt_options import FF_ENERGIES, MASKS, NRGPT_ATTENTIONS
from energyformer.layers.nrgpt_recurrent import NRGPTRecurrent
from energyformer.layers.step_maps import STEP_MAPS
from energyformer.models.base import LearnedPositionLM
from energyformer.models.config import ModelConfig
from energyformer.utils.derived import Rule

PRESETS = (None, "reference", "reference_listops")


@dataclass
class NRGPTConfig(ModelConfig):
    """NRGPT hyper-parameters (docs/nrgpt.md, defaults per docs/choices.md).

    Derived fields (``derived``, filled in one step by ``ModelConfig.__post_init__``) hold the
    concrete value afterwards (so ``to_dict``/``from_dict`` round-trip):

    * ``d_ff``: ``None`` → ``4·d_model``; ``head_dim``: ``None`` → ``d_model // n_heads``.
    * ``mask``: ``None`` → ``"strict"`` (paper); ``"inclusive"`` for ``preset="reference"``.
    * ``norm``: ``"auto"`` → ``"layernorm"``; ``"layernorm_frozen"`` for the reference presets.
      ``None`` or ``"none"`` means *no* normalization (``g = x``).
    * ``learn_alpha``: ``None`` → ``True``; ``False`` (α ≡ 1) for the reference presets.
    * ``beta``: ``None`` → the attention entry's default: 1 (full J) or ``1/sqrt(head_dim)`` (factored).
    * ``c_init``: ``None`` → the η map's default scale (0.1; 0 for ``full``, whose init is the
      reference code's ``N(0, 0.02²)``).

    ``attention``, ``ff``, ``eta_param`` and ``norm`` name entries of the registries
    ``NRGPT_ATTENTIONS``, ``FF_ENERGIES``, ``STEP_MAPS`` and ``NORMS``; a registered entry is
    accepted without any change here. ``eta_param`` was called ``step_size`` before 0.2 (still
    read, with a warning); ``step_size`` now always means the value of a scalar η.

    ``preset``: ``None``; ``"reference"`` (the released code on language modelling: full J,
    α = β = 1 fixed, inclusive mask, frozen-γ LayerNorm, η a bias-free linear map); or
    ``"reference_listops"`` (the same with the strict mask). Explicitly given fields override.

    ``n_steps`` is the depth T: the number of applications of the one shared block.
    ``per_step_scale=True`` adds learnable per-step scalars κ_t (init 1) multiplying η.

    Raises:
        ValueError: any invalid field (``n_steps < 1``, ``n_heads`` not dividing ``d_model``,
            ``c_init <= 0``, unknown choices, ...).
    """

    arch: ClassVar[str] = "nrgpt"
    renamed_keys: ClassVar[dict[str, str]] = {"step_size": "eta_param"}
    derived: ClassVar[dict[str, Rule]] = {
        "d_ff": lambda c: 4 * c.d_model,
        "head_dim": lambda c: c.d_model // c.n_heads,
        "beta": lambda c: NRGPT_ATTENTIONS.get(c.attention).default_beta(c.head_dim),
        "learn_alpha": lambda c: c.preset is None,
        "mask": lambda c: "inclusive" if c.preset == "reference" else "strict",
        "norm": lambda c: "layernorm_frozen" if c.preset is not None else "layernorm",  # sentinel "auto"
        "c_init": lambda c: STEP_MAPS.get(c.eta_param, "eta_param").default_scale,
    }
    d_model: int = 128
    n_heads: int = 4
    n_steps: int = 6
    ff: str = "ff2w"
    d_ff: int | None = None
    dropout: float = 0.0
    attention: str = "full"
    head_dim: int | None = None
    beta: float | None = None
    learn_alpha: bool | None = None
    mask: str | None = None
    norm: str | None = "auto"
    eta_param: str = "full"
    c_init: float | None = None
    eta_rank: int = 8
    per_step_scale: bool = False
    preset: str | None = None

    def check_inputs(self) -> None:
        super().check_inputs()
        check_choice("preset", self.preset, PRESETS)
        check_width(self.d_model, self.n_heads)
        if self.head_dim is not None:  # read by beta's rule
            check_int("head_dim", self.head_dim, 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_steps", self.n_steps, 1)
        FF_ENERGIES.check(self.ff)
        check_int("d_ff", self.d_ff, 1)
        check_float("dropout", self.dropout, 0.0, maximum=0.999)
        self.beta = check_float("beta", self.beta, 0.0, strict=True)
        if not isinstance(self.learn_alpha, bool):
            raise ValueError(f"learn_alpha={self.learn_alpha!r} must be true or false")
        check_choice("mask", self.mask, MASKS)
        canonical_norm(self.norm)
        STEP_MAPS.get(self.eta_param, "eta_param").check_options(
            d_model=self.d_model, scale=self.c_init, rank=self.eta_rank, rank_name="eta_rank", scale_name="c_init",
            has_norm_weight=self.norm not in (None, "none"))

    @classmethod
    def reference(cls, task: str = "lm", **overrides: Any) -> NRGPTConfig:
        """Config reproducing the released NRGPT code (docs/nrgpt.md §2–§6).

        ``task="lm"`` (OWT / Shakespeare runs): inclusive mask. ``task="listops"``: strict mask.
        Full ``J`` per head, α = β = 1 fixed, frozen-γ LayerNorm, η a bias-free ``Linear(d, d)``,
        learnable ``s_ff``, GELU FF with biases, learned positions, untied LM head with bias.
        ``overrides`` set any other field (e.g. ``d_model``, ``ff="ff1"``, ``dropout``).

        Raises:
            ValueError: ``task`` not in ``("lm", "listops")``, or an invalid override.
        """
        check_choice("task", task, ("lm", "listops"))
        overrides.setdefault("attention", "full")
        overrides.setdefault("eta_param", "full")
        return cls(preset="reference" if task == "lm" else "reference_listops", **overrides)


class NRGPT(NRGPTRecurrent, LearnedPositionLM):
    """NRGPT language model ``idx (B, N) -> (logits (B, N, V), loss or None)`` (docs/nrgpt.md §6).

    The model is the :class:`~energyformer.layers.nrgpt_recurrent.NRGPTRecurrent` layer (the
    shared ``block``, ``step_scales``, the descent) with token and position embeddings and an LM
    head; it inherits the layer rather than holding it so that its weight names stay ``block.*``
    and ``step_scales``.
    """

    legacy_renames = ((r"^block\.(J|alpha|q_proj\.weight|k_proj\.weight)$", r"block.attention.\1"),  # version 0.1
                      (r"^block\.(up_proj|down_proj|in_proj)\.", r"block.ff.\1."),
                      (r"^block\.eta_proj\.weight$", "block.eta.weight"),
                      (r"^block\.c_raw$", "block.eta.c_raw"),
                      (r"^block\.eta_([LS])$", r"block.eta.\1"))

    def __init__(self, config: NRGPTConfig):
        LearnedPositionLM.__init__(self)  # the embeddings are drawn first, as in every earlier version
        self.config = c = config
        self.make_embeddings(c, c.d_model)
        self.setup_recurrence(NRGPTBlock(
            c.d_model, c.n_heads, attention=c.attention, head_dim=c.head_dim, beta=c.beta,
            learn_alpha=c.learn_alpha, mask=c.mask, ff=c.ff, d_ff=c.d_ff, eta_param=c.eta_param,
            c_init=c.c_init, eta_rank=c.eta_rank, norm=c.norm, dropout=c.dropout), c.n_steps, c.per_step_scale)
        self.ln_f = LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=True)
        for m in (self.wte, self.wpe, self.lm_head):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.lm_head.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                n_steps: int | None = None, stop_tol: float | None = None, cache=None,
                backprop_steps: int | None = None, exit=None, accept_lower_energy: bool = False,
                max_halvings: int = DEFAULT_MAX_HALVINGS):
        """Embed, run the recurrent energy descent (:meth:`NRGPTRecurrent.descend
        <energyformer.layers.nrgpt_recurrent.NRGPTRecurrent.descend>`), apply the LM head.

        Args:
            idx: token ids ``(B, N)``.
            targets: ``(B, N)`` next-token ids (``-1`` ignored) or ``None``.
            n_steps, stop_tol, cache, backprop_steps: as in
                :meth:`~energyformer.layers.nrgpt_recurrent.NRGPTRecurrent.descend` (``n_steps``
                defaults to ``config.n_steps``; with a cache ``idx`` follows the cached positions;
                ``backprop_steps=k`` back-propagates through the last ``k`` steps only, so with
                ``k < n_steps`` the embeddings get no gradient from that call).
            exit, accept_lower_energy, max_halvings: per-token adaptive exit (``"kl:1e-3"``, ...;
                ``n_steps`` is then the most steps a token gets) and energy-safe steps, as in
                :meth:`~energyformer.layers.nrgpt_recurrent.NRGPTRecurrent.descend`
                (docs/inference_compute.md). The readout of ``kl`` is this model's LM head. After
                the call ``model.exit_steps`` ``(B, N)`` int64 holds the updates each token got.

        Returns:
            ``(logits (B, N, V), loss or None)``. Under ``with model.trace() as trace:`` the trace
            gets one record per state ``x⁰ … x^S`` (``S`` = steps actually run, ``S ≤ T``) with the
            terms ``"attn"``, ``"ff"`` (with ``s_ff``) and ``"total"``, and, with ``stop_tol``,
            ``trace.steps_taken`` ``(B, N)``: the number of updates each token got.

        Raises:
            ValueError: bad ``idx``/``targets`` (see ``check_input``), ``n_steps < 1``,
                ``stop_tol < 0``, ``backprop_steps < 1`` or with a cache, a cache filled with another
                ``n_steps``/``stop_tol``, a cache while tracing.

        With ``mask="strict"`` token 0 has no context: its attention energy and force are 0, so
        its state moves by the FF force only (and a length-1 sequence gives FF-only logits).
        """
        offset = cache_length(cache)
        self.check_input(idx, targets, offset)
        x = self.descend(self.embed(idx, offset), n_steps=n_steps, stop_tol=stop_tol, cache=cache,
                         backprop_steps=backprop_steps, exit=exit, readout=self.readout,
                         accept_lower_energy=accept_lower_energy, max_halvings=max_halvings)
        logits = self.readout(x)
        return logits, self.lm_loss(logits, targets)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits of states ``x`` ``(B, N, d)``: ``lm_head(ln_f(x))`` ``(B, N, V)``."""
        return self.lm_head(self.ln_f(x))
