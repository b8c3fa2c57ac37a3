"""NRGPT energies and their analytic partial gradients (docs/nrgpt.md §2, §3). Pure functions.

Conventions (docs/README.md §2, docs/architecture.md §1):

* ``g`` is the normalized token state, shape ``(B, N, d)``; tokens are rows.
* Every ``*_energy`` returns per-token energies ``(B, N)`` (summed over heads and features).
* Every ``*_grad`` returns ``(B, N, d)``: the exact partial derivative of token ``A``'s energy
  w.r.t. its own ``g_A`` with the causal context (earlier tokens ``g_B``) held fixed.

Attention energy (docs/nrgpt.md §2), per head ``h`` with ``J_h ∈ R^{d×d}``::

    E_A = −(1/β) Σ_h α_h log Σ_{B ∈ ctx(A)} exp(β g_Bᵀ J_h g_A)
    ∂E_A/∂g_A = −Σ_h α_h J_hᵀ Σ_B p^h_{AB} g_B,   p^h_{AB} = softmax_B(β g_Bᵀ J_h g_A)

``strict=True`` (the model option ``mask="strict"``): ``ctx(A) = {B < A}``; the first token has no
context, so its attention energy and force are 0 (not −∞ / NaN). ``strict=False`` (``mask="inclusive"``):
``ctx(A) = {B ≤ A}``; the key slot
``B = A`` is treated as a constant (the reference code's behaviour, docs/nrgpt.md §2 item 3), i.e. the
gradient is taken w.r.t. the *query* occurrence of ``g_A`` only. The optional ``context``
argument makes that explicit: the energy is evaluated with queries from ``g`` and keys from
``context`` (default ``g``), and ``*_grad`` is the derivative w.r.t. ``g`` at ``context = g``.

Two parameterizations of ``J_h``:

* ``"full"`` (reference code): ``J`` of shape ``(H, d, d)``. Keys ``k_{hB} = J_hᵀ g_B`` so the
  score is ``g_A · k_{hB}`` and the force is ``−Σ_h α_h Σ_B p_{AB} k_{hB}``: one ``d×d`` projection
  per head, as in the reference code's ``EnergyHead_H`` (whose ``H.weight`` equals ``J_hᵀ``).
* ``"factored"`` (paper / Energy Transformer): ``J_h = W^K_hᵀ W^Q_h`` with ``q_weight``,
  ``k_weight`` of shape ``(H, d_h, d)``.

The attention ``*_grad`` functions are the fast path (``scaled_dot_product_attention``, or the
scores materialized in the compute dtype for heads wider than the fused CUDA kernels take, as
full ``J``'s ``d``-wide keys at GPT-2 width; docs/gpu.md "Wide attention heads") and the
FF1/FF2W ``*_grad`` functions fused ``autograd.Function``s with hand-written backwards; each
``*_grad_reference`` function is the plain reference (explicit masked softmax / the formula under
ordinary autograd) held equal to it, and to ``torch.autograd`` on the energy, in the tests.

The strict mask on the fast path (docs/nrgpt.md §2, "strict mask as a shifted causal mask"): ``B < A``
is the inclusive causal mask ``B' ≤ A'`` between the queries of positions ``1 … N−1`` and the keys
of positions ``0 … N−2``, so SDPA runs with ``is_causal=True`` and no explicit mask (the flash /
cuDNN kernels stay eligible, causal tiles are skipped); row 0 has no key and gets force 0 and
energy 0, as on the reference path. The energies use the same shifted stream
(:func:`attention_energy`); :func:`attention_energy_reference` and
:func:`attention_energy_factored_reference` are the plain masked log-sum-exp.

Feed-forward energies (docs/nrgpt.md §3; σ = exact-erf GELU, biases as in the reference code)::

    FF1:  E = −‖σ(W g + b)‖²                         ∂E/∂g = −2 Wᵀ(σ(z) ⊙ σ'(z))
    FF2W: E = −gᵀ(W² σ(W¹ g + b¹) + b²)              ∂E/∂g = −(W² σ(z) + b²) − W¹ᵀ(σ'(z) ⊙ W²ᵀ g)
    FF2:  E = −‖σ(W^b σ(W^a g + a) + b)‖²            ∂E/∂g = −2 W^aᵀ(σ'(z₁) ⊙ W^bᵀ(σ(z₂) ⊙ σ'(z₂)))

Weights follow ``nn.Linear``: ``W ∈ R^{out×in}`` and ``z = g Wᵀ + b`` for row-stacked tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from energyformer.energies.heads import (
    attention_path,
    causal_mask,
    compute_dtype,
    sdpa_causal_kwargs,
    softmax_low_precision,
)

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# --------------------------------------------------------------------------------------------
# masks (the boolean mask itself is energyformer.energies.heads.causal_mask, strict = B < A)
# --------------------------------------------------------------------------------------------
def _check_strict(strict: object) -> None:
    if not isinstance(strict, bool):
        raise ValueError(f"strict={strict!r} must be a bool: True for the mask B < A (mask='strict'), "
                         "False for B ≤ A (mask='inclusive')")


def _safe_mask(n: int, strict: bool, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mask with every row non-empty (row 0 of the strict mask gets its diagonal) + the empty rows.

    The filled-in entries only keep softmax / log-sum-exp finite; their results are discarded
    (set to exactly 0) by the callers, so no information flows through them.
    """
    allowed = causal_mask(n, n, device, strict=strict)
    if strict:
        empty = torch.zeros(n, dtype=torch.bool, device=device)
        empty[0] = True
        allowed = allowed.clone()
        allowed[0, 0] = True
        return allowed, empty
    return allowed, None


def _check_shapes(g: torch.Tensor, context: torch.Tensor | None, alpha: torch.Tensor, n_heads: int) -> torch.Tensor:
    if g.dim() != 3:
        raise ValueError(f"g must have shape (B, N, d), got {tuple(g.shape)}")
    if context is None:
        context = g
    elif context.shape != g.shape:
        raise ValueError(f"context shape {tuple(context.shape)} must equal g shape {tuple(g.shape)}")
    if alpha.shape != (n_heads,):
        raise ValueError(f"alpha must have shape (H,)=({n_heads},), got {tuple(alpha.shape)}")
    return context


def _lse_energy(scores: torch.Tensor, alpha: torch.Tensor, beta: float, strict: bool) -> torch.Tensor:
    """``scores (B, H, N, N)`` already multiplied by β → per-token energy ``(B, N)``."""
    n = scores.shape[-1]
    allowed, empty = _safe_mask(n, strict, scores.device)
    lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(dim=-1)  # (B, H, N)
    if empty is not None:
        lse = lse.masked_fill(empty, 0.0)
    return -(alpha.to(lse.dtype)[:, None] * lse).sum(dim=1) / beta


# --------------------------------------------------------------------------------------------
# attention: full J (reference code)
# --------------------------------------------------------------------------------------------
def _full_keys(context: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """``k[b, h, B] = J_hᵀ g_B`` (row form ``g_B @ J_h``): ``(B, N, d), (H, d, d) -> (B, H, N, d)``."""
    return torch.einsum("bnd,hde->bhne", context, J.to(context.dtype))


def attention_energy(g: torch.Tensor, J: torch.Tensor, alpha: torch.Tensor, beta: float,
                     strict: bool = True, context: torch.Tensor | None = None) -> torch.Tensor:
    """NRGPT attention energy with one full ``d×d`` matrix per head (docs/nrgpt.md §2).

    Args:
        g: normalized states ``(B, N, d)`` (queries).
        J: ``(H, d, d)``; score ``s^h_{AB} = g_Bᵀ J_h g_A``.
        alpha: head weights ``(H,)``.
        beta: inverse temperature (> 0).
        strict: the mask B < A (``True``, the paper) or B ≤ A (``False``, the reference code on LM tasks).
        context: states used as keys ``(B, N, d)``; default ``g``.

    Returns:
        ``(B, N)`` per-token energies; token 0 has energy 0 under the strict mask.

    Raises:
        ValueError: ``strict`` not a bool, or bad shapes.
    """
    _check_strict(strict)
    context = _check_shapes(g, context, alpha, J.shape[0])
    return _shifted_energy(g.unsqueeze(1), _full_keys(context, J), alpha, beta, strict)


def attention_energy_reference(g: torch.Tensor, J: torch.Tensor, alpha: torch.Tensor, beta: float,
                               strict: bool = True, context: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference for :func:`attention_energy` (the masked log-sum-exp over all ``N × N``
    scores, row 0 of the strict mask filled in then set to 0): ``(B, N)``."""
    _check_strict(strict)
    context = _check_shapes(g, context, alpha, J.shape[0])
    keys = _full_keys(context, J)                                   # (B, H, N, d)
    scores = beta * torch.einsum("bad,bhkd->bhak", g, keys)         # (B, H, N_query, N_key)
    return _lse_energy(scores, alpha, beta, strict)


def attention_grad(g: torch.Tensor, J: torch.Tensor, alpha: torch.Tensor, beta: float,
                   strict: bool = True, dropout_p: float = 0.0) -> torch.Tensor:
    """Fast path for ``∂E_A/∂g_A`` of :func:`attention_energy`: ``(B, N, d)``.

    ``= −Σ_h α_h Σ_{B ∈ ctx(A)} p^h_{AB} J_hᵀ g_B`` (docs/nrgpt.md §2). Queries are ``g`` itself
    (cast once to the keys' dtype, then viewed over heads, never copied), keys and values are
    ``J_hᵀ g_B``, ``d`` wide: SDPA, or on CUDA above 256 features the materialized scores
    (:func:`energyformer.energies.heads.attention_path`, docs/gpu.md "Wide attention heads").
    ``dropout_p > 0`` drops attention weights (training only; the result is then a stochastic
    force, not the exact gradient). Token 0's force is 0 under the strict mask.

    Raises:
        ValueError: ``strict`` not a bool, or bad shapes.
    """
    _check_strict(strict)
    _check_shapes(g, None, alpha, J.shape[0])
    keys = _full_keys(g, J)                                         # (B, H, N, d)
    q = g.to(keys.dtype).unsqueeze(1)                               # cast once, then a view over heads
    if attention_path(keys.shape[-1], g.device) == "sdpa":
        q = q.expand_as(keys)
    return _sdpa_force(q, keys, alpha, beta, strict, dropout_p, out_weight=None)


def attention_grad_reference(g: torch.Tensor, J: torch.Tensor, alpha: torch.Tensor, beta: float,
                             strict: bool = True, dropout_p: float = 0.0) -> torch.Tensor:
    """Plain reference for :func:`attention_grad` (explicit masked softmax over ``N × N``, the
    strict mask's empty row 0 filled in then zeroed; ``dropout_p`` drops the softmax weights as
    SDPA does): ``(B, N, d)``."""
    _check_strict(strict)
    _check_shapes(g, None, alpha, J.shape[0])
    keys = _full_keys(g, J)
    scores = beta * torch.einsum("bad,bhkd->bhak", g, keys)
    p = F.dropout(_masked_softmax(scores, strict), dropout_p) if dropout_p else _masked_softmax(scores, strict)
    return -torch.einsum("h,bhak,bhkd->bad", alpha.to(g.dtype), p, keys)


# --------------------------------------------------------------------------------------------
# attention: factored J_h = W^Kᵀ W^Q (paper / Energy Transformer)
# --------------------------------------------------------------------------------------------
def attention_energy_factored(g: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                              alpha: torch.Tensor, beta: float, strict: bool = True,
                              context: torch.Tensor | None = None) -> torch.Tensor:
    """Attention energy with ``J_h = W^K_hᵀ W^Q_h`` (docs/nrgpt.md §2 paper form): ``(B, N)``.

    Args:
        g: ``(B, N, d)`` queries; ``context``: ``(B, N, d)`` keys (default ``g``).
        q_weight, k_weight: ``(H, d_h, d)``; score ``β (W^K_h g_B)·(W^Q_h g_A)``.
        alpha: ``(H,)``; beta: inverse temperature; strict: B < A (True) or B ≤ A (False).

    Equals :func:`attention_energy` with ``J = k_weightᵀ @ q_weight`` (tested).
    """
    _check_strict(strict)
    context = _check_shapes(g, context, alpha, q_weight.shape[0])
    return _shifted_energy(head_projection(g, q_weight), head_projection(context, k_weight), alpha, beta, strict)


def attention_energy_factored_reference(g: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                        alpha: torch.Tensor, beta: float, strict: bool = True,
                                        context: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference for :func:`attention_energy_factored` (masked log-sum-exp over ``N × N``): ``(B, N)``."""
    _check_strict(strict)
    context = _check_shapes(g, context, alpha, q_weight.shape[0])
    q = torch.einsum("bnd,hed->bhne", g, q_weight.to(g.dtype))
    k = torch.einsum("bnd,hed->bhne", context, k_weight.to(g.dtype))
    scores = beta * (q @ k.transpose(-2, -1))
    return _lse_energy(scores, alpha, beta, strict)


def _factored_qk(g: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, alpha: torch.Tensor,
                 strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs of the factored attention: per-head ``q = W^Q g``, ``k = W^K g``, ``(B, H, N, e)``."""
    _check_strict(strict)
    _check_shapes(g, None, alpha, q_weight.shape[0])
    return (torch.einsum("bnd,hed->bhne", g, q_weight.to(g.dtype)),
            torch.einsum("bnd,hed->bhne", g, k_weight.to(g.dtype)))


def attention_grad_factored(g: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                            alpha: torch.Tensor, beta: float, strict: bool = True,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """Fast path (SDPA) for the factored force ``−Σ_h α_h W^Q_hᵀ Σ_B p^h_{AB} W^K_h g_B``: ``(B, N, d)``."""
    q, k = _factored_qk(g, q_weight, k_weight, alpha, strict)
    return _sdpa_force(q, k, alpha, beta, strict, dropout_p, out_weight=q_weight.to(g.dtype))


def attention_grad_factored_reference(g: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                      alpha: torch.Tensor, beta: float, strict: bool = True,
                                      dropout_p: float = 0.0) -> torch.Tensor:
    """Plain reference for :func:`attention_grad_factored` (as :func:`attention_grad_reference`): ``(B, N, d)``."""
    q, k = _factored_qk(g, q_weight, k_weight, alpha, strict)
    p = _masked_softmax(beta * (q @ k.transpose(-2, -1)), strict)
    p = F.dropout(p, dropout_p) if dropout_p else p
    ctx = p @ k                                                     # (B, H, N, d_h)
    return -torch.einsum("h,bhne,hed->bnd", alpha.to(g.dtype), ctx, q_weight.to(g.dtype))


# --------------------------------------------------------------------------------------------
# attention helpers
# --------------------------------------------------------------------------------------------
def _masked_softmax(scores: torch.Tensor, strict: bool) -> torch.Tensor:
    """Softmax over keys of ``(B, H, N, N)`` scores; empty rows (strict, token 0) are all zero."""
    allowed, empty = _safe_mask(scores.shape[-1], strict, scores.device)
    p = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    if empty is not None:
        p = p.masked_fill(empty[:, None], 0.0)
    return p


def _shift(q: torch.Tensor, keys: torch.Tensor, strict: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Any mask as an inclusive causal one: ``(q', keys', first_row_empty)``.

    Queries at the last ``N`` of ``S`` positions see, under the strict mask, the keys ``B < A``,
    i.e. keys ``0 … S−2`` under the inclusive (bottom-right aligned) causal mask. Without a cache
    (``N = S``) position 0 sees nothing: its query is dropped (``first_row_empty``) and the square
    ``(N−1) × (N−1)`` inclusive mask remains. The inclusive mask is returned unchanged.
    """
    n, s = q.shape[-2], keys.shape[-2]
    if not strict:
        return q, keys, False
    keys = keys[..., : s - 1, :]
    if n == s:
        return q[..., 1:, :], keys, True
    return q, keys, False


def _pad_first_row(t: torch.Tensor, first_empty: bool) -> torch.Tensor:
    """Token 0 of the strict mask (no context): a zero row in front of ``(B, N−1, …)``."""
    if not first_empty:
        return t
    return F.pad(t, (0, 0, 1, 0)) if t.dim() == 3 else F.pad(t, (1, 0))


def _shifted_energy(q: torch.Tensor, keys: torch.Tensor, alpha: torch.Tensor, beta: float,
                    strict: bool) -> torch.Tensor:
    """Per-token energy ``(B, N)`` of queries ``q`` ``(B, H or 1, N, e)`` at the last ``N`` of the
    ``S`` positions of ``keys`` ``(B, H, S, e)``: log-sum-exp over the shifted stream of :func:`_shift`
    (token 0 of the strict mask: energy 0)."""
    q2, k2, first_empty = _shift(q, keys, strict)
    m, s = q2.shape[-2], k2.shape[-2]
    scores = beta * (q2 @ k2.transpose(-2, -1))                     # (B, H, M, S')
    if m == 0:                                                      # N = 1, strict: no row to reduce
        lse = scores.sum(dim=-1)
    else:
        lse = scores.masked_fill(~causal_mask(m, s, q.device), float("-inf")).logsumexp(dim=-1)
    return _pad_first_row(-(alpha.to(lse.dtype)[:, None] * lse).sum(dim=1) / beta, first_empty)


def _sdpa_force(q: torch.Tensor, k: torch.Tensor, alpha: torch.Tensor, beta: float, strict: bool,
                dropout_p: float, out_weight: torch.Tensor | None) -> torch.Tensor:
    """``−Σ_h α_h (softmax(β q kᵀ) k)_h [@ out_weight_h]`` ``(B, N, d)`` for queries ``q``
    ``(B, H or 1, N, e)`` at the last ``N`` of the ``S`` positions of ``k`` ``(B, H, S, e)`` (the
    values are the keys), under the mask.

    The path is chosen by :func:`energyformer.energies.heads.attention_path`: one SDPA call with
    ``is_causal=True`` and no explicit mask whenever ``N = S``, for either mask (the strict one on
    the shifted stream of :func:`_shift`; token 0 then gets force exactly 0); or, for heads wider
    than the fused CUDA kernels take (full ``J``: ``e = d``), :func:`_scores_attend`, the same
    product with the scores materialized in the compute dtype. Both equal the plain reference
    (tested, float64 and bf16).
    """
    q2, k2, first_empty = _shift(q, k, strict)
    if q2.shape[-2] == 0:                                           # N = 1, strict: nothing to attend
        ctx = k2
    elif attention_path(k2.shape[-1], q.device) == "scores":
        ctx = _scores_attend(q2, k2, beta, dropout_p)
    else:
        q2 = _cast_queries(q2, k2)
        if q2.shape[1] != k2.shape[1]:
            q2 = q2.expand(-1, k2.shape[1], -1, -1)
        ctx = F.scaled_dot_product_attention(q2, k2, k2, scale=beta, dropout_p=dropout_p,
                                             **sdpa_causal_kwargs(q2.shape[-2], k2.shape[-2], q.device))
    a = alpha.to(ctx.dtype)
    if out_weight is None:
        force = -torch.einsum("h,bhne->bne", a, ctx)
    else:
        force = -torch.einsum("h,bhne,hed->bnd", a, ctx, out_weight.to(ctx.dtype))
    return _pad_first_row(force, first_empty)


def _cast_queries(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q`` in ``k``'s dtype; a query expanded over heads (stride 0, full ``J``) is cast on one head
    and expanded again, so no ``(B, H, N, e)`` copy is made (autocast inside SDPA would make one)."""
    if q.dtype == k.dtype:
        return q
    if q.dim() == 4 and q.shape[1] > 1 and q.stride(1) == 0:
        return q[:, :1].to(k.dtype).expand_as(q)
    return q.to(k.dtype)


def _scores_attend(q: torch.Tensor, k: torch.Tensor, beta: float, dropout_p: float) -> torch.Tensor:
    """``softmax(β q kᵀ + causal) k`` ``(B, H, M, e)`` with the ``(B, H, M, S)`` scores materialized
    in the compute dtype (bf16 under autocast, softmax accumulated in float32 by the kernel): the
    path for heads wider than :data:`~energyformer.energies.heads.FUSED_HEAD_DIM_MAX`, where SDPA
    would fall to the slow memory-efficient kernel. ``q`` ``(B, H or 1, M, e)`` (one head: shared by
    every head, as full ``J``'s ``g``, without expanding it), ``k`` ``(B, H, S, e)`` (also the values);
    queries at the last ``M`` of ``S`` positions, inclusive causal mask (the shifted stream)."""
    dt = compute_dtype(k)
    k = k.to(dt)
    if q.shape[1] > 1 and q.stride(1) == 0:                         # expanded over heads: one head is enough
        q = q[:, :1]
    q = q.to(dt) * beta                                             # the scale on the (smaller) queries
    m, s = q.shape[-2], k.shape[-2]
    if q.shape[1] == 1 and k.shape[1] > 1:
        scores = torch.einsum("bme,bhse->bhms", q[:, 0], k)
    else:
        scores = q @ k.transpose(-2, -1)                           # (B, H, M, S)
    if m > 1:
        scores = scores.masked_fill(~causal_mask(m, s, q.device), float("-inf"))
    p = softmax_low_precision(scores)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return p @ k


# --------------------------------------------------------------------------------------------
# attention against cached keys (cached decoding, docs/architecture.md §5)
# --------------------------------------------------------------------------------------------
def attention_keys(context: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """Full-``J`` keys (= values) ``k_{hB} = J_hᵀ g_B``: ``(B, N, d), (H, d, d) -> (B, H, N, d)``."""
    return _full_keys(context, J)


def head_projection(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Factored queries or keys ``W_h g``: ``(B, N, d), (H, d_h, d) -> (B, H, N, d_h)``."""
    return torch.einsum("bnd,hed->bhne", g, weight.to(g.dtype))


def attention_force_from_keys(q: torch.Tensor, keys: torch.Tensor, alpha: torch.Tensor, beta: float,
                              strict: bool = True, out_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Attention force ``−Σ_h α_h Σ_{B∈ctx(A)} p^h_{AB} k_{hB} [W^Q_h]`` of the last ``N`` of ``S`` positions.

    ``q`` ``(B, H, N, e)``: the queries (full ``J``: ``g`` repeated over heads; factored:
    ``W^Q_h g``) of positions ``S−N … S−1``; ``keys`` ``(B, H, S, e)``: every position's keys (the
    values), earlier ones from the cache; ``out_weight`` ``(H, d_h, d)`` (factored) or None.
    Returns ``(B, N, d)``; equals :func:`attention_grad` / :func:`attention_grad_factored` on the
    whole sequence, restricted to the last ``N`` rows (tested).

    Raises:
        ValueError: ``strict`` not a bool, or ``q`` and ``keys`` of different ``(B, H, e)`` or ``N > S``.
    """
    _check_strict(strict)
    n, s = q.shape[-2], keys.shape[-2]
    if q.dim() != 4 or keys.shape[:2] != q.shape[:2] or keys.shape[-1] != q.shape[-1] or n > s:
        raise ValueError(f"q (B, H, N, e) and keys (B, H, S, e) with N <= S expected; got {tuple(q.shape)} "
                         f"and {tuple(keys.shape)}")
    return _sdpa_force(q, keys, alpha, beta, strict, 0.0, out_weight)


def attention_energy_from_keys(q: torch.Tensor, keys: torch.Tensor, alpha: torch.Tensor, beta: float,
                               strict: bool = True) -> torch.Tensor:
    """Per-token attention energy ``(B, N)`` of the last ``N`` of ``S`` positions against ``keys``.

    Same arguments as :func:`attention_force_from_keys`; equals :func:`attention_energy` /
    :func:`attention_energy_factored` on the whole sequence, last ``N`` columns (tested).
    """
    _check_strict(strict)
    return _shifted_energy(q, keys, alpha, beta, strict)


# --------------------------------------------------------------------------------------------
# feed-forward energies
# --------------------------------------------------------------------------------------------
def gelu(z: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU ``σ(z) = z Φ(z)``, PyTorch's ``nn.GELU()`` default."""
    return F.gelu(z)


def gelu_prime(z: torch.Tensor) -> torch.Tensor:
    """``σ'(z) = Φ(z) + z φ(z)`` for the exact GELU."""
    cdf = 0.5 * (1.0 + torch.erf(z * _INV_SQRT_2))
    pdf = torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return cdf + z * pdf


def _linear(g: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(g, W.to(g.dtype), None if b is None else b.to(g.dtype))


def ff1_energy(g: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """FF1 (NRGPT_H_FF1) energy ``−‖σ(W g + b)‖²`` per token: ``(B, N, d) -> (B, N)``; ``W (M, d)``, ``b (M,)``."""
    return -gelu(_linear(g, W, b)).pow(2).sum(dim=-1)


def ff1_grad(g: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``∂E/∂g = −2 Wᵀ(σ(z) ⊙ σ'(z))``, ``z = W g + b`` (docs/nrgpt.md §3): ``(B, N, d)``.

    Fast path: a fused ``autograd.Function`` with a hand-written backward (saves two
    ``(…, M)`` tensors instead of the ~10 element-wise intermediates autograd would keep);
    first-order differentiable only. :func:`ff1_grad_reference` is the plain reference held equal
    in the tests, forward and backward.
    """
    return _FF1Grad.apply(g, W.to(g.dtype), None if b is None else b.to(g.dtype))[0]


def ff1_grad_reference(g: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Plain reference for :func:`ff1_grad` (ordinary autograd through the formula)."""
    z = _linear(g, W, b)
    return -2.0 * (gelu(z) * gelu_prime(z)) @ W.to(g.dtype)


def ff2w_energy(g: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor | None,
                W2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
    """FF2W (NRGPT_H_FF2W) energy ``−gᵀ(W² σ(W¹ g + b¹) + b²)``: ``(B, N)``; ``W1 (M, d)``, ``W2 (d, M)``."""
    return -(g * _linear(gelu(_linear(g, W1, b1)), W2, b2)).sum(dim=-1)


def ff2w_grad(g: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor | None,
              W2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
    """``∂E/∂g = −(W² σ(z) + b²) − W¹ᵀ(σ'(z) ⊙ W²ᵀ g)``, ``z = W¹ g + b¹`` (docs/nrgpt.md §3): ``(B, N, d)``.

    The first term is a standard MLP; the second is the symmetric correction.
    Fast path: a fused ``autograd.Function`` with a hand-written backward (saves four
    ``(…, M)`` tensors; first-order differentiable only); :func:`ff2w_grad_reference` is the plain
    reference held equal in the tests, forward and backward.
    """
    cast = lambda t: None if t is None else t.to(g.dtype)  # noqa: E731
    return _FF2WGrad.apply(g, cast(W1), cast(b1), cast(W2), cast(b2))[0]


def ff2w_grad_reference(g: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor | None,
                    W2: torch.Tensor, b2: torch.Tensor | None) -> torch.Tensor:
    """Plain reference for :func:`ff2w_grad` (ordinary autograd through the formula)."""
    z = _linear(g, W1, b1)
    W1c, W2c = W1.to(g.dtype), W2.to(g.dtype)
    mlp = _linear(gelu(z), W2c, b2)
    corr = (gelu_prime(z) * (g @ W2c)) @ W1c
    return -(mlp + corr)


def ff2_energy(g: torch.Tensor, Wa: torch.Tensor, a: torch.Tensor | None,
               Wb: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """FF2 (reference ``GradFeedForward_2Lay``) energy ``−‖σ(W^b σ(W^a g + a) + b)‖²``: ``(B, N)``.

    ``Wa (d_a, d)`` (the reference uses ``d_a = d``), ``Wb (M, d_a)``.
    """
    return -gelu(_linear(gelu(_linear(g, Wa, a)), Wb, b)).pow(2).sum(dim=-1)


def ff2_grad(g: torch.Tensor, Wa: torch.Tensor, a: torch.Tensor | None,
             Wb: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``∂E/∂g = −2 W^aᵀ(σ'(z₁) ⊙ W^bᵀ(σ(z₂) ⊙ σ'(z₂)))`` with ``z₁ = W^a g + a``, ``z₂ = W^b σ(z₁) + b``.

    Analytic (the reference code uses ``torch.func.grad``, i.e. double backward in training;
    this closed form needs only first-order autograd). ``(B, N, d)``.
    """
    s1, sp1 = _gelu_parts(_linear(g, Wa, a), second=False)
    s2, sp2 = _gelu_parts(_linear(s1, Wb, b), second=False)
    return -2.0 * (sp1 * ((s2 * sp2) @ Wb.to(g.dtype))) @ Wa.to(g.dtype)



# --------------------------------------------------------------------------------------------
# fused FF forces (forward = the analytic gradient; backward = its derivative, written out)
# --------------------------------------------------------------------------------------------
_TAIL = 10.0  # |z| beyond which φ(z) < 7.7e-23 and Φ(−|z|) < 7.6e-24


def _gelu_parts(z: torch.Tensor, second: bool = True):
    """``σ(z), σ'(z)`` and (``second=True``) ``σ''(z) = φ(z)(2 − z²)`` of the exact GELU.

    ``φ`` and ``Φ`` are evaluated at ``z`` clamped to ``±10``: their tails would otherwise
    underflow into subnormal floats (|z| > 13 in float32), which makes every later CPU op on
    them ~10× slower — a real slowdown once training grows the FF weights. The absolute change
    is below 1e-20 per element (``σ(z) = z Φ(z)`` still uses the unclamped ``z``).
    """
    zc = z.clamp(-_TAIL, _TAIL)
    zz = zc * zc
    cdf = torch.special.ndtr(zc)
    pdf = torch.exp(zz * -0.5) * _INV_SQRT_2PI
    s, sp = z * cdf, torch.addcmul(cdf, zc, pdf)
    if not second:
        return s, sp
    return s, sp, pdf * (2.0 - zz)


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_rows aᵀ b`` for ``a (…, p)``, ``b (…, q)`` → ``(p, q)``."""
    return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])


class _FF1Grad(torch.autograd.Function):
    """``F = −2 (σ(z) ⊙ σ'(z)) W``, ``z = g Wᵀ + b`` (row form).

    Mixed precision: under autocast, inputs are cast to the autocast dtype and the forward and
    backward run in it with autocast off (gradients are returned in each input's own dtype).
    """

    generate_vmap_rule = True  # usable under torch.func.vmap

    @staticmethod
    def forward(g, W, b):
        dt = compute_dtype(g)
        with torch.autocast(g.device.type, enabled=False):
            g, W = g.to(dt), W.to(dt)
            b = None if b is None else b.to(dt)
            s, sp, spp = _gelu_parts(F.linear(g, W, b))
            ssp = s * sp
            # σσ' and (σσ')' = σ'² + σσ'' are kept for the backward
            # (inputs are returned as views: autograd.Function may not save an input returned as-is)
            return -2.0 * ssp @ W, g.view_as(g), W.view_as(W), ssp, sp * sp + s * spp

    @staticmethod
    def setup_context(ctx, inputs, output):
        g, W, b = inputs
        ctx.dtypes = (g.dtype, W.dtype, None if b is None else b.dtype)
        ctx.save_for_backward(*output[1:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G, *_):
        g, W, ssp, dssp = ctx.saved_tensors
        with torch.autocast(G.device.type, enabled=False):
            G2 = -2.0 * G.to(g.dtype)
            dz = (G2 @ W.T).mul_(dssp)                 # ∂L/∂z
            dW = _outer(ssp, G2) + _outer(dz, g)
            db = _sum_rows(dz).to(ctx.dtypes[2]) if ctx.dtypes[2] is not None else None
            return (dz @ W).to(ctx.dtypes[0]), dW.to(ctx.dtypes[1]), db


class _FF2WGrad(torch.autograd.Function):
    """``F = −(σ(z) W²ᵀ + b²) − (σ'(z) ⊙ u) W¹``, ``z = g W¹ᵀ + b¹``, ``u = g W²`` (row form).

    Mixed precision as in :class:`_FF1Grad`.
    """

    generate_vmap_rule = True  # usable under torch.func.vmap

    @staticmethod
    def forward(g, W1, b1, W2, b2):
        dt = compute_dtype(g)
        with torch.autocast(g.device.type, enabled=False):
            g, W1, b1, W2, b2 = (None if t is None else t.to(dt) for t in (g, W1, b1, W2, b2))
            s, sp, spp = _gelu_parts(F.linear(g, W1, b1))
            u = g @ W2
            spu = sp * u
            # kept for the backward: g, W¹, W², σ, σ', σ'⊙u, u⊙σ''
            return (-(F.linear(s, W2, b2) + spu @ W1), g.view_as(g), W1.view_as(W1), W2.view_as(W2),
                    s, sp, spu, u * spp)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dtypes = tuple(None if t is None else t.dtype for t in inputs)
        ctx.save_for_backward(*output[1:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G, *_):
        g, W1, W2, s, sp, spu, uspp = ctx.saved_tensors
        with torch.autocast(G.device.type, enabled=False):
            A = -G.to(g.dtype)                         # ∂L/∂(σ(z)W²ᵀ + b² + (σ'⊙u)W¹)
            Q = A @ W1.T                               # ∂L/∂(σ'⊙u)        (…, M)
            du = Q * sp                                # ∂L/∂u
            dz = (A @ W2).mul_(sp).addcmul_(Q, uspp)   # ∂L/∂z = ∂L/∂σ ⊙ σ' + Q ⊙ u ⊙ σ''
            grads = (du @ W2.T + dz @ W1,              # g
                     _outer(spu, A) + _outer(dz, g),   # W¹
                     _sum_rows(dz),                    # b¹
                     _outer(A, s) + _outer(g, du),     # W²
                     _sum_rows(A))                     # b²
            return tuple(None if dt is None else gr.to(dt) for gr, dt in zip(grads, ctx.dtypes))
