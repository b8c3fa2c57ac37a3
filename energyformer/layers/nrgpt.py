"""The NRGPT block: one explicit descent step on the causal energy ``E = E_AT + s_ff E_FF``.

docs/nrgpt.md §4 (code form)::

    g = Norm(x)                                   (B, N, d)
    x ← x − κ · η( ∂E_AT/∂g + s_ff ∂E_FF/∂g )     (row form: F @ ηᵀ)

with partial gradients per token (each token descends its own energy, earlier tokens fixed;
docs/nrgpt.md §2). Energies and analytic gradients live in :mod:`energyformer.energies.nrgpt`.

Every option plugs in from a registry (docs/nrgpt.md §2–§5, docs/choices.md); the entries of
each are the generated tables of docs/architecture.md (``python -m energyformer.utils.registry``):

* ``attention`` from :data:`~energyformer.layers.nrgpt_options.NRGPT_ATTENTIONS`; the entry owns α
  (``learn_alpha``), β (its default) and the ``mask`` (``"strict"``: B < A, the paper;
  ``"inclusive"``: B ≤ A, the reference code on LM tasks).
* ``ff`` from :data:`~energyformer.layers.nrgpt_options.FF_ENERGIES`; ``s_ff`` is the learnable
  ``ff_scale`` (init 1).
* ``eta_param`` (the η parameterization) from :data:`~energyformer.layers.step_maps.STEP_MAPS`,
  the step maps CEM's preconditioner uses too. ``NRGPTBlock.eta`` is that step map (a module);
  η is never a scalar step here (CEM's scalar step is ``step_size``).
* ``norm`` from :data:`~energyformer.layers.norms.NORMS` (``None`` is ``"none"``: ``g = x``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from energyformer._validate import check_divides, check_float, check_int
from energyformer.layers.norms import canonical_norm, make_norm
from energyformer.layers.nrgpt_options import FF_ENERGIES, NRGPT_ATTENTIONS
from energyformer.layers.step_maps import STEP_MAPS, make_step_map
from energyformer.layers.trace import Traceable

__all__ = ["NRGPTBlock"]


class NRGPTBlock(Traceable, nn.Module):
    """One NRGPT descent step ``(B, N, d) -> (B, N, d)`` (docs/nrgpt.md §4), applied recurrently by
    :class:`~energyformer.layers.nrgpt_recurrent.NRGPTRecurrent`. Returns the updated residual
    stream ``x − κ η(force)``, not a branch output to add.

    Args:
        d_model: width ``d``.
        n_heads: number of heads ``H`` (must divide ``d_model``).
        attention: a name in ``NRGPT_ATTENTIONS`` (default ``"full"``).
        head_dim: ``d_h`` for ``"factored"`` (default ``d_model // n_heads``; unused for full).
        beta: inverse temperature (default: the attention entry's ``default_beta``).
        learn_alpha: learn the head weights α (init 1); ``False`` fixes α = 1 (reference code).
        mask: ``"strict"`` | ``"inclusive"``.
        ff: a name in ``FF_ENERGIES`` (default ``"ff2w"``).
        d_ff: FF hidden size ``M`` (default ``4·d_model``).
        eta_param: the η parameterization, a name in ``STEP_MAPS`` (see the module docstring).
        c_init: initial scale ``s`` of η (η starts near ``s·I``: ``c = s`` for ``c_*``,
            ``E[L Lᵀ] = s·I`` for ``psd_plus_skew``); default: the map's (0.1; 0 for ``full``,
            whose init is the reference code's ``N(0, 0.02²)``).
        eta_rank: rank of a low-rank η (``diag_lowrank*`` maps only).
        norm: a name in ``NORMS`` or ``None``/``"none"``.
        norm_eps: norm epsilon.
        dropout: attention-weight dropout and dropout on the attention force (reference code).

    Raises:
        ValueError: any invalid option (names the value and the allowed ones), e.g.
            ``n_heads`` not dividing ``d_model``, ``c_init <= 0`` for a ``c_*`` map,
            ``eta_param="c_diag_gamma"`` with ``norm=None`` (no γ exists).
    """

    trace_sub = "block"

    def __init__(self, d_model: int, n_heads: int, *, attention: str = "full", head_dim: int | None = None,
                 beta: float | None = None, learn_alpha: bool = True, mask: str = "strict",
                 ff: str = "ff2w", d_ff: int | None = None, eta_param: str = "full", c_init: float | None = None,
                 eta_rank: int = 8, norm: str | None = "layernorm", norm_eps: float = 1e-5, dropout: float = 0.0):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        check_divides("n_heads", n_heads, "d_model", d_model)
        attention_cls, ff_cls = NRGPT_ATTENTIONS.get(attention), FF_ENERGIES.get(ff)
        eta_cls = STEP_MAPS.get(eta_param, "eta_param")
        norm = canonical_norm(norm)
        check_float("dropout", dropout, 0.0, maximum=0.999)
        head_dim = d_model // n_heads if head_dim is None else check_int("head_dim", head_dim, 1)
        d_ff = 4 * d_model if d_ff is None else check_int("d_ff", d_ff, 1)
        eta_cls.check_options(d_model=d_model, scale=c_init, rank=eta_rank, rank_name="eta_rank", scale_name="c_init",
                              has_norm_weight=norm != "none")

        self.d_model, self.n_heads, self.head_dim, self.d_ff = d_model, n_heads, head_dim, d_ff
        self.norm_kind = None if norm == "none" else norm
        self.dropout_p = dropout

        self.norm = make_norm(norm, d_model, eps=norm_eps)  # g = Norm(x), None for "none"
        self.attention = attention_cls(d_model, n_heads, head_dim, beta=beta, learn_alpha=learn_alpha, mask=mask)
        self.attn_dropout = nn.Dropout(dropout)
        self.ff = ff_cls(d_model, d_ff)
        self.ff_scale = nn.Parameter(torch.ones(()))  # s_ff
        self.eta = make_step_map(eta_param, d_model, c_init, rank=eta_rank, norm=self.norm, option="eta_param")
        self.reset_parameters()

    # names of the options, as configs spell them
    mask = property(lambda self: self.attention.mask)
    beta = property(lambda self: self.attention.beta)
    alpha = property(lambda self: self.attention.alpha)
    eta_param = property(lambda self: self.eta.name)

    # ------------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Reference-code init: weights ``N(0, 0.02²)``, biases 0, α = s_ff = 1; η as its step map."""
        inside_eta = set(self.eta.modules())
        for m in self.modules():
            if isinstance(m, nn.Linear) and m not in inside_eta:
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.attention.reset_parameters()
        self.eta.reset_parameters()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``g = Norm(x)`` (or ``x`` itself without a norm): ``(B, N, d)``."""
        return x if self.norm is None else self.norm(x)

    def eta_matrix(self) -> torch.Tensor:
        """The inference-rate matrix η ``(d, d)`` as a dense tensor (for tests / inspection)."""
        return self.eta.matrix()

    def apply_eta(self, v: torch.Tensor) -> torch.Tensor:
        """``η v`` per token (row form ``v @ ηᵀ``): ``(B, N, d) -> (B, N, d)``."""
        return self.eta(v)

    # ------------------------------------------------------------------------------------------
    def attn_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``∂E_AT/∂g`` per token ``(B, N, d)`` (with attention dropout in training mode)."""
        return self.attention.grad(g, dropout_p=self.dropout_p if self.training else 0.0)

    def ff_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``∂E_FF/∂g`` per token ``(B, N, d)`` (without the ``s_ff`` scale)."""
        return self.ff.grad(g)

    def force(self, x: torch.Tensor) -> torch.Tensor:
        """``∂E_AT/∂g + s_ff ∂E_FF/∂g`` at ``g = Norm(x)``: ``(B, N, d)``."""
        g = self.normalize(x)
        return self.attn_dropout(self.attn_grad(g)) + self.ff_scale.to(g.dtype) * self.ff_grad(g)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """One step ``x − κ η(∂E_AT/∂g + s_ff ∂E_FF/∂g)``; ``scale`` is the optional per-step κ.

        Args:
            x: residual stream ``(B, N, d)``.
            scale: scalar κ_t (tensor or float) or ``None`` (κ = 1).

        Returns:
            ``(B, N, d)``, causal: output at position A depends on inputs at positions ≤ A only.
        """
        return self.step(x, self.force(x), scale)

    # ------------------------------------------------------------------------------------------
    # cached decoding (docs/architecture.md §5): one cache slot per recurrent step
    def cache_keys(self, g: torch.Tensor, cache, layer_idx: int) -> torch.Tensor:
        """Append the keys of ``g`` ``(B, N, d)`` to slot ``layer_idx`` of ``cache`` (the values are
        the keys: an empty value tensor is stored); return every cached key ``(B, H, S, e)``."""
        k = self.attention.keys(g)
        return cache.update(k, k.new_empty(*k.shape[:-1], 0), layer_idx)[0]

    def force_from_keys(self, g: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """:meth:`force` of the last ``N`` positions at ``g = Norm(x)`` ``(B, N, d)`` given every
        position's ``keys`` ``(B, H, S, e)`` (no dropout: for inference)."""
        return self.attention.grad_from_keys(g, keys) + self.ff_scale.to(g.dtype) * self.ff_grad(g)

    def energy_from_keys(self, g: torch.Tensor, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """:meth:`energy` ``{"attn", "ff"}`` ``(B, N)`` of the last ``N`` positions at ``g`` given ``keys``."""
        return {"attn": self.attention.energy_from_keys(g, keys),
                "ff": self.ff_scale.to(g.dtype) * self.ff.energy(g)}

    def step(self, x: torch.Tensor, force: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """``x − κ η(force)``: ``(B, N, d)``."""
        step = self.eta(force)
        if scale is not None:
            step = scale * step
        return x - step

    # ------------------------------------------------------------------------------------------
    def energy(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-token energy terms at ``g = Norm(x)``: ``{"attn": (B, N), "ff": (B, N)}``.

        ``"ff"`` includes the learned scale ``s_ff`` so that ``attn + ff`` is exactly the energy
        whose partial gradient :meth:`forward` descends (α and β are inside ``"attn"``).
        """
        g = self.normalize(x)
        return {"attn": self.attention.energy(g), "ff": self.ff_scale.to(g.dtype) * self.ff.energy(g)}

    def energy_in_context(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Per-token total energy ``E_AT + s_ff E_FF`` ``(B, N)`` of the states ``x`` ``(B, N, d)`` with
        the keys taken from the states ``context`` ``(B, N, d)`` (the context held fixed, as the step
        sees it; docs/inference_compute.md §5). ``energy_in_context(x, x)`` is the total of :meth:`energy`."""
        g = self.normalize(x)
        return self.attention.energy(g, self.normalize(context)) + self.ff_scale.to(g.dtype) * self.ff.energy(g)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by accounting group: the attention and FF entries' own groups (``attention``,
        ``ff``, to which ``s_ff`` is added), ``eta`` and ``norm``."""
        groups = {**self.attention.param_groups(), **self.ff.param_groups()}
        groups["ff"] = [*groups.get("ff", []), self.ff_scale]
        groups["eta"] = list(self.eta.parameters())
        groups["norm"] = [] if self.norm is None else list(self.norm.parameters())
        return groups

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, dropout={self.dropout_p}, norm={self.norm_kind!r}"
