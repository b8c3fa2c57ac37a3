"""The NRGPT block: one explicit descent step on the causal energy ``E = E_AT + s_ff E_FF``.

SPEC §4.4 (code form)::

    g = Norm(x)                                   (B, N, d)
    x ← x − κ · η( ∂E_AT/∂g + s_ff ∂E_FF/∂g )     (row form: F @ ηᵀ)

with partial gradients per token (each token descends its own energy, earlier tokens fixed;
SPEC §4.2). Energies and analytic gradients live in :mod:`energyformer.energies.nrgpt`.

Options (SPEC §4.2–§4.5, §6):

* ``attention``: ``"full"`` (one ``J_h ∈ R^{d×d}`` per head, Parameter ``J (H, d, d)``) or
  ``"factored"`` (``J_h = W^K_hᵀ W^Q_h``; Parameters ``q_proj``, ``k_proj``).
* ``alpha``: head weights ``α`` (``learn_alpha=True``: Parameter init 1; else a fixed buffer of 1s).
* ``beta``: inverse temperature; default 1 (full) or ``1/sqrt(head_dim)`` (factored).
* ``mask``: ``"strict"`` (B < A, paper) or ``"inclusive"`` (B ≤ A, reference code on LM tasks).
* ``ff``: ``"ff1"``, ``"ff2w"`` (default), ``"ff2"``; ``s_ff`` is the learnable ``ff_scale`` (init 1).
* ``step_size`` (η): ``"full"`` (bias-free ``Linear(d, d)``, the reference code),
  ``"c_diag_gamma"`` (``c·diag(γ)``, γ the norm's weight, ``c = softplus(c_raw)``),
  ``"c_identity"`` (``c·I``), ``"psd_plus_skew"`` (``L Lᵀ + S − Sᵀ``).
* ``norm``: ``"layernorm"``, ``"rmsnorm"``, ``"layernorm_frozen"`` (γ ≡ 1; reference ``BareLN``)
  or ``None`` / ``"none"`` (``g = x``; pairs with ``psd_plus_skew`` for SPEC §4.5 Prop 2.2).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from energyformer._validate import check_choice, check_divides, check_float, check_int
from energyformer.energies import nrgpt as E
from energyformer.layers.norms import NORMS, make_norm

ATTENTIONS = ("full", "factored")
STEP_SIZES = ("full", "c_diag_gamma", "c_identity", "psd_plus_skew")
BLOCK_NORMS = NORMS + ("none", None)


def _inv_softplus(y: float) -> float:
    """``x`` with ``softplus(x) = y`` (y > 0)."""
    return y + math.log(-math.expm1(-y))


class NRGPTBlock(nn.Module):
    """One NRGPT descent step ``(B, N, d) -> (B, N, d)`` (SPEC §4.4), applied recurrently by the model.

    Args:
        d_model: width ``d``.
        n_heads: number of heads ``H`` (must divide ``d_model``).
        attention: ``"full"`` | ``"factored"``.
        head_dim: ``d_h`` for ``"factored"`` (default ``d_model // n_heads``; unused for full).
        beta: inverse temperature (default 1 for full, ``1/sqrt(head_dim)`` for factored).
        learn_alpha: learn the head weights α (init 1); ``False`` fixes α = 1 (reference code).
        mask: ``"strict"`` | ``"inclusive"``.
        ff: ``"ff1"`` | ``"ff2w"`` | ``"ff2"``.
        d_ff: FF hidden size ``M`` (default ``4·d_model``).
        step_size: η parameterization, see the module docstring.
        c_init: initial ``c`` for ``c_diag_gamma`` / ``c_identity``; for ``psd_plus_skew`` the
            initial ``L`` has ``E[L Lᵀ] = c_init·I``.
        norm: ``"layernorm"`` | ``"rmsnorm"`` | ``"layernorm_frozen"`` | ``None``/``"none"``.
        norm_eps: norm epsilon.
        dropout: attention-weight dropout and dropout on the attention force (reference code).

    Raises:
        ValueError: any invalid option (names the value and the allowed ones), e.g.
            ``n_heads`` not dividing ``d_model``, ``c_init <= 0``, ``step_size="c_diag_gamma"``
            with ``norm=None`` (no γ exists; use ``"c_identity"``).
    """

    def __init__(self, d_model: int, n_heads: int, *, attention: str = "full", head_dim: int | None = None,
                 beta: float | None = None, learn_alpha: bool = True, mask: str = "strict",
                 ff: str = "ff2w", d_ff: int | None = None, step_size: str = "full", c_init: float = 0.1,
                 norm: str | None = "layernorm", norm_eps: float = 1e-5, dropout: float = 0.0):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        check_divides("n_heads", n_heads, "d_model", d_model)
        check_choice("attention", attention, ATTENTIONS)
        check_choice("mask", mask, E.MASKS)
        check_choice("ff", ff, E.FF_KINDS)
        check_choice("step_size", step_size, STEP_SIZES)
        check_choice("norm", norm, BLOCK_NORMS)
        check_float("c_init", c_init, 0.0, strict=True)
        check_float("dropout", dropout, 0.0, maximum=0.999)
        if not isinstance(learn_alpha, bool):
            raise ValueError(f"learn_alpha={learn_alpha!r} must be a bool")
        norm = None if norm == "none" else norm
        if step_size == "c_diag_gamma" and norm is None:
            raise ValueError("step_size='c_diag_gamma' needs a norm with a scale γ; with norm=None "
                             "use step_size='c_identity' or 'psd_plus_skew'")
        head_dim = d_model // n_heads if head_dim is None else check_int("head_dim", head_dim, 1)
        d_ff = 4 * d_model if d_ff is None else check_int("d_ff", d_ff, 1)
        if beta is None:
            beta = 1.0 if attention == "full" else 1.0 / math.sqrt(head_dim)
        self.beta = check_float("beta", beta, 0.0, strict=True)

        self.d_model, self.n_heads, self.head_dim, self.d_ff = d_model, n_heads, head_dim, d_ff
        self.attention, self.mask, self.ff, self.step_size = attention, mask, ff, step_size
        self.norm_kind = norm
        self.dropout_p = dropout

        # normalization g = Norm(x)
        self.norm = None if norm is None else make_norm(norm, d_model, eps=norm_eps)

        # attention energy parameters
        if attention == "full":
            self.J = nn.Parameter(torch.empty(n_heads, d_model, d_model))
        else:
            self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
            self.k_proj = nn.Linear(d_model, n_heads * head_dim, bias=False)
        if learn_alpha:
            self.alpha = nn.Parameter(torch.ones(n_heads))
        else:
            self.register_buffer("alpha", torch.ones(n_heads), persistent=False)
        self.attn_dropout = nn.Dropout(dropout)

        # feed-forward energy parameters (biases as in the reference code)
        if ff == "ff1":
            self.up_proj = nn.Linear(d_model, d_ff)
        elif ff == "ff2w":
            self.up_proj = nn.Linear(d_model, d_ff)
            self.down_proj = nn.Linear(d_ff, d_model)
        else:  # ff2: W^a ∈ R^{d×d}, W^b ∈ R^{M×d}
            self.in_proj = nn.Linear(d_model, d_model)
            self.up_proj = nn.Linear(d_model, d_ff)
        self.ff_scale = nn.Parameter(torch.ones(()))  # s_ff

        # inference-rate matrix η
        if step_size == "full":
            self.eta_proj = nn.Linear(d_model, d_model, bias=False)
        elif step_size in ("c_diag_gamma", "c_identity"):
            self.c_raw = nn.Parameter(torch.full((), _inv_softplus(c_init)))
        else:
            self.eta_L = nn.Parameter(torch.empty(d_model, d_model))
            self.eta_S = nn.Parameter(torch.empty(d_model, d_model))
        self._c_init = c_init
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Reference-code init: weights ``N(0, 0.02²)``, biases 0, α = s_ff = 1, ``c = c_init``."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if self.attention == "full":
            nn.init.normal_(self.J, mean=0.0, std=0.02)
        if self.step_size == "psd_plus_skew":
            nn.init.normal_(self.eta_L, mean=0.0, std=math.sqrt(self._c_init / self.d_model))
            nn.init.normal_(self.eta_S, mean=0.0, std=0.02)

    @property
    def c(self) -> torch.Tensor:
        """``c = softplus(c_raw)`` (only for ``c_diag_gamma`` / ``c_identity``)."""
        return F.softplus(self.c_raw)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``g = Norm(x)`` (or ``x`` itself without a norm): ``(B, N, d)``."""
        return x if self.norm is None else self.norm(x)

    def eta_matrix(self) -> torch.Tensor:
        """The inference-rate matrix η ``(d, d)`` as a dense tensor (for tests / inspection)."""
        if self.step_size == "full":
            return self.eta_proj.weight
        if self.step_size == "c_identity":
            return self.c * torch.eye(self.d_model, dtype=self.c_raw.dtype, device=self.c_raw.device)
        if self.step_size == "c_diag_gamma":
            return torch.diag(self.c * self.norm.weight)
        L, S = self.eta_L, self.eta_S
        return L @ L.T + S - S.T

    def apply_eta(self, v: torch.Tensor) -> torch.Tensor:
        """``η v`` per token (row form ``v @ ηᵀ``): ``(B, N, d) -> (B, N, d)``."""
        if self.step_size == "full":
            return self.eta_proj(v)
        if self.step_size == "c_identity":
            return self.c.to(v.dtype) * v
        if self.step_size == "c_diag_gamma":
            return v * (self.c * self.norm.weight).to(v.dtype)
        L, S = self.eta_L.to(v.dtype), self.eta_S.to(v.dtype)
        return (v @ L) @ L.T + v @ S.T - v @ S  # v (L Lᵀ)ᵀ + v (S − Sᵀ)ᵀ

    # ------------------------------------------------------------------------------------------
    def _ff_weights(self) -> tuple:
        if self.ff == "ff1":
            return (self.up_proj.weight, self.up_proj.bias)
        if self.ff == "ff2w":
            return (self.up_proj.weight, self.up_proj.bias, self.down_proj.weight, self.down_proj.bias)
        return (self.in_proj.weight, self.in_proj.bias, self.up_proj.weight, self.up_proj.bias)

    def _qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        H, dh, d = self.n_heads, self.head_dim, self.d_model
        return self.q_proj.weight.view(H, dh, d), self.k_proj.weight.view(H, dh, d)

    def attn_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``∂E_AT/∂g`` per token ``(B, N, d)`` (with attention dropout in training mode)."""
        p = self.dropout_p if self.training else 0.0
        if self.attention == "full":
            return E.attention_grad(g, self.J, self.alpha, self.beta, self.mask, dropout_p=p)
        qw, kw = self._qk()
        return E.attention_grad_factored(g, qw, kw, self.alpha, self.beta, self.mask, dropout_p=p)

    def ff_grad(self, g: torch.Tensor) -> torch.Tensor:
        """``∂E_FF/∂g`` per token ``(B, N, d)`` (without the ``s_ff`` scale)."""
        fn = {"ff1": E.ff1_grad, "ff2w": E.ff2w_grad, "ff2": E.ff2_grad}[self.ff]
        return fn(g, *self._ff_weights())

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
        step = self.apply_eta(self.force(x))
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
        if self.attention == "full":
            e_attn = E.attention_energy(g, self.J, self.alpha, self.beta, self.mask)
        else:
            qw, kw = self._qk()
            e_attn = E.attention_energy_factored(g, qw, kw, self.alpha, self.beta, self.mask)
        fn = {"ff1": E.ff1_energy, "ff2w": E.ff2w_energy, "ff2": E.ff2_energy}[self.ff]
        e_ff = self.ff_scale.to(g.dtype) * fn(g, *self._ff_weights())
        return {"attn": e_attn, "ff": e_ff}

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, attention={self.attention!r}, "
                f"beta={self.beta:.4g}, mask={self.mask!r}, ff={self.ff!r}, d_ff={self.d_ff}, "
                f"step_size={self.step_size!r}, norm={self.norm_kind!r}")
