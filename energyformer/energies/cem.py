"""CEM energies and their analytic gradients (docs/cem.md §2–§4, §7; pure functions, no state).

Notation (docs/README.md §2, docs/cem.md): ``g`` (B, N, d) is the normalized moving variable ``Norm(x)``, ``h_ctx``
(B, N, d) the fixed normalized context ``ĥ = Norm(h)`` of the sub-block input. Projections
are in PyTorch layout: ``w_q, w_k`` (H·d_h, d), ``w_gate, w_up`` (d_ff, d). Energies are per
token, shape (B, N), summed over heads and features; ``*_grad`` returns (B, N, d), the exact
derivative of that per-token energy w.r.t. ``g`` with the context held fixed.

Attention / interaction energy (docs/cem.md §2, §4), causal ``j ≤ i``, ``τ = sqrt(d_h)``::

    ε_att(g_i | ĥ_{1:i}) = − Σ_k τ log Σ_{j≤i} exp( s^k_ij / τ ),
    s^k_ij = (R_i W^Q_k g_i)·(R_j W^K_k ĥ_j) + Σ_c d_kc g_ic ĥ_jc      (= g_iᵀ A_k(i,j) ĥ_j)
    ∇_g ε_att = − Σ_k [ (W^Q_k)ᵀ R_iᵀ Σ_j a^k_ij R_j W^K_k ĥ_j  +  d_k ⊙ Σ_j a^k_ij ĥ_j ]

``R_p`` is RoPE at position ``p`` (identity without RoPE); ``d_k`` is the D+LR diagonal, in the
form named by ``diag_mode``: ``"none"`` (``diag=None``, plain tied attention), ``"shared"`` by all
heads (``diag`` of shape (d,)), or ``"per_head"`` (``diag`` of shape (H, d)). ``w_q = w_k = None``
keeps only the diagonal term.

Gated-MLP energy (docs/cem.md §3), ``F = ∫SiLU``::

    variant A (tie="gate"): ε = − Σ_m (W_U ĥ)_m F(w_m·g),          ∇ = − Wᵀ(W_U ĥ ⊙ SiLU(W g)),  W = w_gate
    variant B (tie="up"):   ε = − ½ Σ_m SiLU(w^G_m·ĥ) (w_m·g)²,   ∇ = − Wᵀ(SiLU(W_G ĥ) ⊙ W g),  W = w_up

Every fast path (SDPA, summed-over-heads shared diagonal, augmented heads) has a plain
per-element reference beside it (``*_reference``) built from explicit ``A_k(i, j)`` matrices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from energyformer._validate import check_choice
from energyformer.energies.heads import (apply_rope, causal_mask, merge_heads, rope_matrices, sdpa_causal_kwargs,
                                         split_heads)
from energyformer.energies.silu_antiderivative import silu_antiderivative

ROPE_MODES = ("exact", "llama")
DIAG_MODES = ("none", "shared", "per_head")
MLP_TIES = ("gate", "up")

__all__ = [
    "InteractionContext", "interaction_context", "interaction_energy", "interaction_grad",
    "interaction_energy_reference", "interaction_grad_reference",
    "gated_mlp_context", "gated_mlp_energy", "gated_mlp_grad", "rms_norm_vjp",
    "ROPE_MODES", "MLP_TIES", "DIAG_MODES", "diag_mode_of",
]


# ----------------------------------------------------------------------------- helpers

def _causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """(N, N) bool, True where key ``j ≤ i`` (allowed)."""
    pos = torch.arange(n, device=device)
    return pos[:, None] >= pos[None, :]


def _softmax_dtype(dt: torch.dtype) -> torch.dtype:
    """float32 at least (float64 stays float64): log-sum-exp / softmax precision rule."""
    return torch.promote_types(dt, torch.float32)


def _neg_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``−(a @ w)``, negating whichever of the activation ``a`` (…, k) and the weight ``w`` (k, d)
    is smaller: the weight in training (B·N rows), the one-token activation in cached decoding,
    where negating a d_ff × d weight per token cost more than the product itself."""
    return -(a @ w) if a.numel() < w.numel() else a @ (-w)


def diag_mode_of(diag: torch.Tensor | None) -> str:
    """The D+LR form a ``diag`` argument holds: ``"none"`` (None), ``"shared"`` (d,) or ``"per_head"`` (H, d).

    Used only when a caller does not say ``diag_mode`` (direct calls of the pure functions); the
    layers always pass it explicitly (their interaction entry knows its form).
    """
    if diag is None:
        return "none"
    return "shared" if diag.dim() == 1 else "per_head"


def _check_interaction(g: torch.Tensor, h_ctx: torch.Tensor, w_q, w_k, n_heads: int, diag,
                       tau: float | None, rope, diag_mode: str | None,
                       allow_longer_context: bool = False) -> tuple[int, float, str]:
    """Validate shapes against the declared ``diag_mode``; return ``(head_dim, tau, diag_mode)``.

    ``allow_longer_context``: ``h_ctx`` may hold ``S ≥ N`` positions (cached decoding: ``g`` are
    the last ``N``); ``rope`` then holds the tables of the queries' positions.

    Raises:
        ValueError: any mismatch, naming the argument, its shape and the expected one.
    """
    longer_ok = (allow_longer_context and g.dim() == 3 and h_ctx.dim() == 3 and h_ctx.shape[0] == g.shape[0]
                 and h_ctx.shape[2] == g.shape[2] and h_ctx.shape[1] >= g.shape[1])
    if (g.dim() != 3 or h_ctx.shape != g.shape) and not longer_ok:
        raise ValueError(f"g and h_ctx must both be (B, N, d); got {tuple(g.shape)} and {tuple(h_ctx.shape)}")
    d = g.shape[-1]
    mode = diag_mode_of(diag) if diag_mode is None else check_choice("diag_mode", diag_mode, DIAG_MODES)
    expected = {"none": None, "shared": (d,), "per_head": (n_heads, d)}[mode]
    got = None if diag is None else tuple(diag.shape)
    if got != expected:
        raise ValueError(f"diag_mode={mode!r} needs diag of shape {expected} (d={d}, n_heads={n_heads}); got {got}")
    if (w_q is None) != (w_k is None):
        raise ValueError("w_q and w_k must both be given (low-rank term) or both be None (diagonal only)")
    if w_q is None:
        if mode != "per_head":
            raise ValueError(f"without w_q/w_k (diagonal only), diag must have shape (n_heads, d)=({n_heads}, {d}) "
                             f"with diag_mode='per_head'; got {got} with diag_mode={mode!r}")
        if tau is None:
            raise ValueError("tau must be given when there is no low-rank term (w_q=None)")
        if rope is not None:
            raise ValueError("rope acts on the low-rank term; with w_q=None it must be None")
        return d, float(tau), mode
    if w_q.shape != w_k.shape or w_q.dim() != 2 or w_q.shape[1] != d or w_q.shape[0] % n_heads:
        raise ValueError(f"w_q and w_k must both be (n_heads*head_dim, d) with d={d}, n_heads={n_heads}; "
                         f"got {tuple(w_q.shape)} and {tuple(w_k.shape)}")
    head_dim = w_q.shape[0] // n_heads
    if rope is not None:
        cos, sin = rope
        if cos.shape != (g.shape[1], head_dim) or sin.shape != cos.shape:
            raise ValueError(f"rope (cos, sin) must be (N, head_dim)=({g.shape[1]}, {head_dim}); got {tuple(cos.shape)}")
    return head_dim, (math.sqrt(head_dim) if tau is None else float(tau)), mode


# ----------------------------------------------------------------------------- attention: fast path

@dataclass
class InteractionContext:
    """What a CEM attention sub-block computes once from its input and reuses at every step.

    ``h``: ĥ (B, N, d) (None in a cached context without a diagonal, where it is not needed).
    ``k``: keys ``R_j W_K ĥ_j`` (B, H, N, d_h) or None (diagonal only).
    ``v``: values (B, H, N, d_h): the rotated keys (no RoPE / exact mode) or the un-rotated keys
    (llama mode). ``rope``: the (cos, sin) used, or None. ``rope_mode``: "exact" or "llama".
    """

    h: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor] | None
    rope_mode: str


def interaction_context(h_ctx: torch.Tensor, w_k: torch.Tensor | None, n_heads: int, *,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                        rope_mode: str = "exact") -> InteractionContext:
    """Keys and values from the fixed context ``ĥ`` (B, N, d), computed once per sub-block (docs/cem.md §6).

    Raises:
        ValueError: ``rope_mode`` not in ("exact", "llama").
    """
    check_choice("rope_mode", rope_mode, ROPE_MODES)
    if w_k is None:
        return InteractionContext(h_ctx, None, None, rope, rope_mode)
    k_raw = split_heads(h_ctx @ w_k.t(), n_heads)
    if rope is None:
        return InteractionContext(h_ctx, k_raw, k_raw, None, rope_mode)
    k = apply_rope(k_raw, *rope)
    return InteractionContext(h_ctx, k, k if rope_mode == "exact" else k_raw, rope, rope_mode)


def interaction_grad(g: torch.Tensor, h_ctx: torch.Tensor, w_q: torch.Tensor | None,
                     w_k: torch.Tensor | None, n_heads: int, *, diag: torch.Tensor | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None, rope_mode: str = "exact",
                     tau: float | None = None, context: InteractionContext | None = None,
                     diag_mode: str | None = None) -> torch.Tensor:
    """Analytic ``∇_g ε_att`` (B, N, d) (docs/cem.md §2 gradient, §4 D+LR, §2.1 RoPE).

    Fast paths: no diagonal → ``SDPA(q, k, v, is_causal=True, scale=1/τ)`` then ``@ W_Q``;
    shared diagonal (d,) → one set of attention weights per head, summed over heads before the
    diagonal term (two extra N×N×d products, docs/cem.md §4); per-head diagonal (H, d) → augmented
    heads ``[W_Q g ; d_k⊙g]`` / ``[W_K ĥ ; ĥ]`` through SDPA with explicit ``scale=1/τ``;
    ``w_q = w_k = None`` → diagonal-only heads through SDPA.

    ``rope_mode="exact"`` is the true gradient of the rotated energy (values = rotated keys,
    head output un-rotated by ``R_iᵀ``). ``rope_mode="llama"`` is **not** a gradient of any
    energy: it returns minus what Llama attention with ``v_proj = k_proj``, ``o_proj = q_projᵀ``
    computes (values = un-rotated keys, no un-rotation). Without RoPE the two coincide.

    Args:
        g, h_ctx: (B, N, d). w_q, w_k: (H·d_h, d) or both None. n_heads: H.
        diag: None, (d,) shared, or (H, d) per head. rope: (cos, sin), each (N, d_h), or None.
        tau: temperature, default ``sqrt(d_h)`` (required when ``w_q`` is None).
        context: precomputed :func:`interaction_context` of ``h_ctx`` (then ``w_k`` is only checked).
            Cached decoding (docs/architecture.md §5): ``context`` and ``h_ctx`` may hold ``S ≥ N``
            positions, ``g`` being the last ``N`` of them; ``context.rope`` (and ``rope``) are then
            the tables of the queries' positions (the cached keys are already rotated).
        diag_mode: ``"none"``, ``"shared"`` or ``"per_head"``: the D+LR form ``diag`` holds (checked
            against its shape); ``None`` reads it from the shape (:func:`diag_mode_of`).

    Raises:
        ValueError: inconsistent shapes, unknown ``rope_mode``/``diag_mode``, missing ``tau``.
    """
    head_dim, tau, diag_mode = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope, diag_mode,
                                                  allow_longer_context=context is not None)
    ctx = context if context is not None else interaction_context(h_ctx, w_k, n_heads, rope=rope,
                                                                  rope_mode=rope_mode)
    h = ctx.h
    b, n, d = g.shape
    s_len = (ctx.k if ctx.k is not None else h).shape[-2]  # = n without a cache; queries: the last n
    causal = {"is_causal": True} if s_len == n else sdpa_causal_kwargs(n, s_len, g.device)
    scale = 1.0 / tau
    # The minus sign goes on the smaller operand: the weights in training, the activations when decoding.
    if w_q is None:  # diagonal-only heads: q = d_k ⊙ g, k = v = ĥ
        dq = diag[None, :, None, :] * g[:, None]
        hk = h[:, None].expand(b, n_heads, s_len, d)
        o = F.scaled_dot_product_attention(dq, hk, hk, **causal, scale=scale)
        return ((-diag)[None, :, None, :] * o).sum(1)

    q = split_heads(g @ w_q.t(), n_heads)
    if ctx.rope is not None:
        q = apply_rope(q, *ctx.rope)
    diag_term = None
    if diag_mode == "none":
        y = F.scaled_dot_product_attention(q, ctx.k, ctx.v, **causal, scale=scale)
    elif diag_mode == "shared":
        # Shared diagonal: its score is head-independent, and its update is linear in the
        # weights, so Σ_k d ⊙ Σ_j a^k_ij ĥ_j = d ⊙ Σ_j (Σ_k a^k_ij) ĥ_j.
        # Every per-element pass over the (B, H, N, S) scores costs as much as a small GEMM on
        # CPU, so the scale goes on q and g (B×N×d, not B×H×N×S) and the causal −∞ goes into the
        # head-independent (B, N, S) diagonal scores: one add, then softmax (benchmarks/README.md).
        sdt = _softmax_dtype(q.dtype)
        allowed = _causal_mask(n, g.device) if s_len == n else causal_mask(n, s_len, g.device)
        bias = ((g * (diag * scale)) @ h.transpose(-1, -2)).to(sdt).masked_fill(~allowed, float("-inf"))
        s = (q * scale) @ ctx.k.transpose(-1, -2)
        a = torch.softmax(s.to(sdt) + bias[:, None], dim=-1).to(q.dtype)  # (B, H, N, S)
        y = a @ ctx.v
        diag_term = (-diag) * (a.sum(1) @ h)
    else:  # per_head
        hk = h[:, None].expand(b, n_heads, s_len, d)
        qa = torch.cat((q, diag[None, :, None, :] * g[:, None]), dim=-1)
        ka = torch.cat((ctx.k, hk), dim=-1)
        va = ka if ctx.v is ctx.k else torch.cat((ctx.v, hk), dim=-1)
        o = F.scaled_dot_product_attention(qa, ka, va, **causal, scale=scale)
        y, o2 = o.split((head_dim, d), dim=-1)
        diag_term = ((-diag)[None, :, None, :] * o2).sum(1)
    if ctx.rope is not None and ctx.rope_mode == "exact":
        y = apply_rope(y, *ctx.rope, inverse=True)  # R_iᵀ: back to the query's frame
    grad = _neg_matmul(merge_heads(y), w_q)
    if diag_term is not None:
        grad = grad + diag_term
    return grad


def _scores(g, h_ctx, w_q, w_k, n_heads, diag, rope, diag_mode) -> torch.Tensor:
    """Raw scores ``s^k_ij = g_iᵀ A_k(i, j) ĥ_j`` (B, H, N, N) via projections (energy evaluation)."""
    if w_q is None:
        return torch.einsum("bic,hc,bjc->bhij", g, diag, h_ctx)
    q, k = split_heads(g @ w_q.t(), n_heads), split_heads(h_ctx @ w_k.t(), n_heads)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    s = q @ k.transpose(-1, -2)
    if diag_mode == "shared":
        s = s + ((g * diag) @ h_ctx.transpose(-1, -2))[:, None]
    elif diag_mode == "per_head":
        s = s + torch.einsum("bic,hc,bjc->bhij", g, diag, h_ctx)
    return s


def interaction_energy(g: torch.Tensor, h_ctx: torch.Tensor, w_q: torch.Tensor | None,
                       w_k: torch.Tensor | None, n_heads: int, *, diag: torch.Tensor | None = None,
                       rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                       tau: float | None = None, diag_mode: str | None = None) -> torch.Tensor:
    """Per-token ``ε_att`` (B, N) = ``− Σ_k τ · lse_{j≤i}(s^k_ij / τ)`` (docs/cem.md §2, §4).

    Same arguments as :func:`interaction_grad`. With RoPE this is the rotated energy (the one
    whose gradient is the ``"exact"`` mode). Log-sum-exp in at least float32.

    Raises:
        ValueError: inconsistent shapes, missing ``tau`` for diagonal-only.
    """
    _, tau, diag_mode = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope, diag_mode)
    s = _scores(g, h_ctx, w_q, w_k, n_heads, diag, rope, diag_mode)
    s = s.to(_softmax_dtype(s.dtype)) / tau
    s = s.masked_fill(~_causal_mask(g.shape[1], g.device), float("-inf"))
    return (-tau * torch.logsumexp(s, dim=-1).sum(1)).to(g.dtype)


# ----------------------------------------------------------------------------- attention: plain reference

def _interaction_matrices(w_q, w_k, n_heads, diag, rope, n, d, dtype, device):
    """Explicit ``A_k(i, j)`` (H, N, N, d, d) and the value maps ``V_k(i, j)`` used by the update."""
    h = n_heads
    eye = torch.eye(d, dtype=dtype, device=device)
    if diag is None:
        dmat = torch.zeros(h, d, d, dtype=dtype, device=device)
    else:
        dd = diag.expand(h, d) if diag.dim() == 1 else diag
        dmat = dd[:, :, None] * eye  # (H, d, d)
    if w_q is None:
        a = dmat[:, None, None].expand(h, n, n, d, d)
        return a, a
    dh = w_q.shape[0] // n_heads
    wq, wk = w_q.view(n_heads, dh, d), w_k.view(n_heads, dh, d)
    r = (rope_matrices(*rope) if rope is not None
         else torch.eye(dh, dtype=dtype, device=device).expand(n, dh, dh))
    qr = torch.einsum("ief,hfa->hiea", r, wq)  # R_i W^Q_k : (H, N, dh, d)
    kr = torch.einsum("jef,hfb->hjeb", r, wk)  # R_j W^K_k : (H, N, dh, d)
    a = torch.einsum("hiea,hjeb->hijab", qr, kr) + dmat[:, None, None]
    v_llama = (torch.einsum("hea,heb->hab", wq, wk) + dmat)[:, None, None].expand(h, n, n, d, d)
    return a, v_llama


def interaction_energy_reference(g, h_ctx, w_q, w_k, n_heads, *, diag=None, rope=None, tau=None,
                                 diag_mode=None) -> torch.Tensor:
    """Plain reference of :func:`interaction_energy`: explicit ``g_iᵀ A_k(i, j) ĥ_j`` (O(H N² d²); tests only)."""
    _, tau, _ = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope, diag_mode)
    b, n, d = g.shape
    a, _ = _interaction_matrices(w_q, w_k, n_heads, diag, rope, n, d, g.dtype, g.device)
    s = torch.einsum("bia,hijac,bjc->bhij", g, a, h_ctx) / tau
    out = torch.zeros(b, n, dtype=g.dtype, device=g.device)
    for i in range(n):  # explicit causal sum over j ≤ i
        out[:, i] = -tau * torch.logsumexp(s[:, :, i, : i + 1], dim=-1).sum(1)
    return out


def interaction_grad_reference(g, h_ctx, w_q, w_k, n_heads, *, diag=None, rope=None, rope_mode="exact",
                               tau=None, diag_mode=None) -> torch.Tensor:
    """Plain reference of :func:`interaction_grad`: ``− Σ_k Σ_{j≤i} a^k_ij V_k(i, j) ĥ_j`` (tests only).

    ``V_k(i, j) = A_k(i, j)`` in exact mode; in llama mode ``V_k = W^Q_kᵀ W^K_k + diag(d_k)``
    (un-rotated values, no un-rotation) while the weights ``a`` still use the rotated scores.
    """
    check_choice("rope_mode", rope_mode, ROPE_MODES)
    _, tau, _ = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope, diag_mode)
    b, n, d = g.shape
    a_mat, v_llama = _interaction_matrices(w_q, w_k, n_heads, diag, rope, n, d, g.dtype, g.device)
    v_mat = a_mat if (rope is None or rope_mode == "exact") else v_llama
    s = torch.einsum("bia,hijac,bjc->bhij", g, a_mat, h_ctx) / tau
    out = torch.zeros_like(g)
    for i in range(n):
        w = torch.softmax(s[:, :, i, : i + 1], dim=-1)  # (B, H, i+1)
        vh = torch.einsum("hjac,bjc->bhja", v_mat[:, i, : i + 1], h_ctx[:, : i + 1])
        out[:, i] = -torch.einsum("bhj,bhja->ba", w, vh)
    return out


# ----------------------------------------------------------------------------- gated MLP

def _check_mlp(g, h_ctx, w_gate, w_up, tie):
    check_choice("mlp_tie", tie, MLP_TIES)
    if g.shape != h_ctx.shape or g.dim() != 3:
        raise ValueError(f"g and h_ctx must both be (B, N, d); got {tuple(g.shape)} and {tuple(h_ctx.shape)}")
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.shape[1] != g.shape[-1]:
        raise ValueError(f"w_gate and w_up must both be (d_ff, d) with d={g.shape[-1]}; "
                         f"got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")


def gated_mlp_context(h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      tie: str = "gate") -> torch.Tensor:
    """The fixed multiplicative branch (B, N, d_ff) from ``ĥ``: ``W_U ĥ`` (tie="gate") or ``SiLU(W_G ĥ)`` (tie="up")."""
    check_choice("mlp_tie", tie, MLP_TIES)
    if tie == "gate":
        return h_ctx @ w_up.t()
    return F.silu(h_ctx @ w_gate.t())


def gated_mlp_energy(g: torch.Tensor, h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                     tie: str = "gate") -> torch.Tensor:
    """Per-token MLP energy (B, N) (docs/cem.md §3).

    ``tie="gate"`` (variant A, default): ``− Σ_m (W_U ĥ)_m F(w^gate_m·g)``, ``F(z) = z·softplus(z) + Li₂(−e^z)``.
    ``tie="up"`` (variant B): ``− ½ Σ_m SiLU(w^gate_m·ĥ) (w^up_m·g)²``.

    Raises:
        ValueError: shape mismatch or ``tie`` not in ("gate", "up").
    """
    _check_mlp(g, h_ctx, w_gate, w_up, tie)
    c = gated_mlp_context(h_ctx, w_gate, w_up, tie)
    if tie == "gate":
        return -(c * silu_antiderivative(g @ w_gate.t())).sum(-1)
    return -0.5 * (c * (g @ w_up.t()) ** 2).sum(-1)


def gated_mlp_grad(g: torch.Tensor, h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   tie: str = "gate", context: torch.Tensor | None = None) -> torch.Tensor:
    """Analytic ``∇_g`` of :func:`gated_mlp_energy` (B, N, d) (docs/cem.md §3).

    ``tie="gate"``: ``− W_Gᵀ(W_U ĥ ⊙ SiLU(W_G g))``; ``tie="up"``: ``− W_Uᵀ(SiLU(W_G ĥ) ⊙ W_U g)``.
    ``context``: precomputed :func:`gated_mlp_context` (B, N, d_ff), reused across recursion steps.

    Raises:
        ValueError: shape mismatch or ``tie`` not in ("gate", "up").
    """
    _check_mlp(g, h_ctx, w_gate, w_up, tie)
    c = context if context is not None else gated_mlp_context(h_ctx, w_gate, w_up, tie)
    if tie == "gate":
        return _neg_matmul(c * F.silu(g @ w_gate.t()), w_gate)
    return _neg_matmul(c * (g @ w_up.t()), w_up)


# ----------------------------------------------------------------------------- norm Jacobian

def rms_norm_vjp(x: torch.Tensor, v: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``J_Norm(x)ᵀ v`` for ``RMSNorm(x) = γ ⊙ x / r``, ``r = sqrt(mean(x²) + eps)`` (docs/cem.md §7 ``grad_through_norm``).

    ``Jᵀ v = (γ⊙v)/r − x · (x·(γ⊙v)) / (d r³)``; shapes (…, d) -> (…, d). Used to turn ``∇_g ε`` into
    the true ``∇_x ε`` when the energy is differentiated through the norm.
    """
    d = x.shape[-1]
    gv = v if weight is None else v * weight
    r = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return gv / r - x * (x * gv).sum(-1, keepdim=True) / (d * r ** 3)
