"""CEM energies and their analytic gradients (docs/cem.md §2–§4, §7; pure functions, no state).

Notation (docs/README.md §2, docs/cem.md): ``g`` (B, N, d) is the normalized moving variable ``Norm(x)``, ``h_ctx``
(B, N, d) the fixed normalized context ``ĥ = Norm(h)`` of the sub-block input. Projections
are in PyTorch layout: ``w_q, w_k`` (H·d_h, d), ``w_gate, w_up`` (d_ff, d). Energies are per
token, shape (B, N), summed over heads and features; ``*_grad`` returns (B, N, d), the exact
derivative of that per-token energy w.r.t. ``g`` with the context held fixed.

Every function takes tensors and plain numbers, never the name of an option: a registry entry
(``energyformer.layers.cem_options``) calls the functions of its own form.

Attention / interaction energy (docs/cem.md §2, §4), causal ``j ≤ i``, ``τ = sqrt(d_h)``::

    ε_att(g_i | ĥ_{1:i}) = − Σ_k τ log Σ_{j≤i} exp( s^k_ij / τ ),
    s^k_ij = (R_i W^Q_k g_i)·(R_j W^K_k ĥ_j) + Σ_c d_kc g_ic ĥ_jc      (= g_iᵀ A_k(i,j) ĥ_j)
    ∇_g ε_att = − Σ_k [ (W^Q_k)ᵀ R_iᵀ Σ_j a^k_ij R_j W^K_k ĥ_j  +  d_k ⊙ Σ_j a^k_ij ĥ_j ]

``R_p`` is RoPE at position ``p`` (identity without RoPE); ``d_k`` is the D+LR diagonal: ``diag``
None (plain tied attention), of shape (d,) (one diagonal for every head) or (H, d) (one per
head). ``w_q = w_k = None`` keeps only the diagonal term. The fast gradients, one per form:
:func:`lowrank_grad`, :func:`diag_shared_grad`, :func:`diag_per_head_grad`, :func:`diag_only_grad`;
:func:`interaction_grad` checks its arguments and calls the one the given tensors ask for.

Gated-MLP energy (docs/cem.md §3), ``F = ∫SiLU``, one function triple per tie::

    gate tie (variant A): ε = − Σ_m (W_U ĥ)_m F(w_m·g),          ∇ = − Wᵀ(W_U ĥ ⊙ SiLU(W g)),  W = w_gate
    up tie (variant B):   ε = − ½ Σ_m SiLU(w^G_m·ĥ) (w_m·g)²,   ∇ = − Wᵀ(SiLU(W_G ĥ) ⊙ W g),  W = w_up

Every fast path (SDPA, summed-over-heads shared diagonal, augmented heads) has a plain
per-element reference beside it (``*_reference``) built from explicit ``A_k(i, j)`` matrices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from energyformer.energies.heads import (
    apply_rope,
    attention_path,
    causal_mask,
    causal_row_blocks,
    compute_dtype,
    forced_attention_path,
    merge_heads,
    rope_matrices,
    sdpa_causal_kwargs,
    softmax_low_precision,
    split_heads,
)
from energyformer.energies.silu_antiderivative import silu_antiderivative

__all__ = [
    "InteractionContext", "interaction_context", "fold_step_map", "interaction_energy", "interaction_grad",
    "lowrank_grad", "diag_shared_grad", "diag_shared_grad_sdpa", "diag_shared_grad_dense", "diag_per_head_grad",
    "diag_per_head_grad_sdpa", "diag_per_head_grad_dense", "diag_only_grad", "diag_only_grad_sdpa",
    "diag_only_grad_dense",
    "interaction_energy_reference", "interaction_grad_reference",
    "gate_tie_context", "gate_tie_energy", "gate_tie_grad", "up_tie_context", "up_tie_energy", "up_tie_grad",
    "rms_norm_vjp",
]


# ----------------------------------------------------------------------------- helpers

def _softmax_dtype(dt: torch.dtype) -> torch.dtype:
    """float32 at least (float64 stays float64): log-sum-exp / softmax precision rule."""
    return torch.promote_types(dt, torch.float32)


def _neg_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``−(a @ w)``, negating whichever of the activation ``a`` (…, k) and the weight ``w`` (k, d)
    is smaller: the weight in training (B·N rows), the one-token activation in cached decoding,
    where negating a d_ff × d weight per token cost more than the product itself."""
    return -(a @ w) if a.numel() < w.numel() else a @ (-w)


def _check_diag(diag, n_heads: int, d: int, diag_only: bool) -> None:
    expected = [(n_heads, d)] if diag_only else [None, (d,), (n_heads, d)]
    got = None if diag is None else tuple(diag.shape)
    if got not in expected:
        what = "without w_q/w_k (diagonal only) " if diag_only else ""
        raise ValueError(f"{what}diag must have shape {' or '.join(map(str, expected))} "
                         f"(d={d}, n_heads={n_heads}); got {got}")


def _check_interaction(g: torch.Tensor, h_ctx: torch.Tensor, w_q, w_k, n_heads: int, diag,
                       tau: float | None, rope, allow_longer_context: bool = False) -> tuple[int, float]:
    """Validate the shapes; return ``(head_dim, tau)``.

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
    if (w_q is None) != (w_k is None):
        raise ValueError("w_q and w_k must both be given (low-rank term) or both be None (diagonal only)")
    _check_diag(diag, n_heads, d, diag_only=w_q is None)
    if w_q is None:
        if tau is None:
            raise ValueError("tau must be given when there is no low-rank term (w_q=None)")
        if rope is not None:
            raise ValueError("rope acts on the low-rank term; with w_q=None it must be None")
        return d, float(tau)
    if w_q.shape != w_k.shape or w_q.dim() != 2 or w_q.shape[1] != d or w_q.shape[0] % n_heads:
        raise ValueError(f"w_q and w_k must both be (n_heads*head_dim, d) with d={d}, n_heads={n_heads}; "
                         f"got {tuple(w_q.shape)} and {tuple(w_k.shape)}")
    head_dim = w_q.shape[0] // n_heads
    if rope is not None:
        cos, sin = rope
        if cos.shape != (g.shape[1], head_dim) or sin.shape != cos.shape:
            raise ValueError(f"rope (cos, sin) must be (N, head_dim)=({g.shape[1]}, {head_dim}); "
                             f"got {tuple(cos.shape)}")
    return head_dim, (math.sqrt(head_dim) if tau is None else float(tau))


# ----------------------------------------------------------------------------- attention: fast path

@dataclass
class InteractionContext:
    """What a CEM attention sub-block computes once from its input and reuses at every step.

    ``h``: ĥ (B, S, d) (None in a cached context without a diagonal, where it is not needed).
    ``k``: keys ``R_j W_K ĥ_j`` (B, H, S, d_h) or None (diagonal only).
    ``v``: values (B, H, S, d_h): the rotated keys (no RoPE, or ``exact_rope``) or the un-rotated
    keys (Llama's computation). ``rope``: the (cos, sin) of the queries' positions, or None.
    ``exact_rope``: the head outputs are un-rotated by ``R_iᵀ`` (the true gradient; docs/cem.md §2.1).
    """

    h: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor] | None
    exact_rope: bool = True
    #: ``M(W_Q)`` (H·d_h, d): a linear step map ``M`` folded into the output weight (:func:`fold_step_map`)
    w_out: torch.Tensor | None = None
    #: ``M(d ⊙ ĥ)`` (B, S, d): the shared diagonal's values with ``M`` folded in (:func:`fold_step_map`)
    h_out: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """``S``, the number of context positions (``N`` without a cache)."""
        return (self.k if self.k is not None else self.h).shape[-2]

    @property
    def folded(self) -> bool:
        """Whether a step map is folded in (:func:`fold_step_map`): gradients from this context are ``M(∇_g ε)``."""
        return self.w_out is not None or self.h_out is not None


def fold_step_map(ctx: InteractionContext, step_map, w_q: torch.Tensor, diag: torch.Tensor | None = None
                  ) -> InteractionContext:
    """``ctx`` with a linear step map ``M`` (the preconditioner, docs/cem.md §5) folded into the
    gradient's output, so that :func:`lowrank_grad` / :func:`diag_shared_grad` return ``M(∇_g ε)``
    (B, N, d) with no per-token work for ``M`` at each step.

    ``M`` acts on the last dim and is linear (every step map is), so ``M(−a W_Q) = −a M(W_Q)``
    and ``M(d ⊙ Σ_j ā_ij ĥ_j) = Σ_j ā_ij M(d ⊙ ĥ_j)``: the output weight becomes ``M(W_Q)``
    (H·d_h rows, once per call) and the shared diagonal's values ``M(d ⊙ ĥ)`` (B, S, d, once per call,
    not once per step). Exact up to rounding (tested against applying ``M`` to each gradient).

    Args:
        ctx: from :func:`interaction_context`, not from a cache (``ctx.h`` is needed with a diagonal).
        step_map: a callable ``(…, d) -> (…, d)``, linear in its input (a step-map module).
        w_q: (H·d_h, d). diag: None (tied attention) or the shared diagonal (d,).

    Raises:
        ValueError: ``diag`` not None and not (d,) (a per-head diagonal's values differ per head:
            apply ``M`` to each gradient instead); a diagonal with a context without ``ĥ``;
            ``ctx`` already folded.
    """
    if ctx.folded:
        raise ValueError("this context already has a step map folded in")
    d = w_q.shape[-1]
    if diag is None:
        return replace(ctx, w_out=step_map(w_q))
    if tuple(diag.shape) != (d,):
        raise ValueError(f"a step map folds into a shared diagonal (d,)=({d},) only; got diag of shape "
                         f"{tuple(diag.shape)} (apply the map to each step's gradient instead)")
    if ctx.h is None:
        raise ValueError("folding a step map into the diagonal term needs the context's ĥ (ctx.h is None)")
    return replace(ctx, w_out=step_map(w_q), h_out=step_map(ctx.h * diag.to(ctx.h.dtype)))


def _unfolded(ctx: InteractionContext, what: str) -> None:
    if ctx.folded:
        raise ValueError(f"{what} takes no folded step map (fold_step_map supports tied attention and the "
                         "shared diagonal); apply the map to each step's gradient instead")


def interaction_context(h_ctx: torch.Tensor, w_k: torch.Tensor | None, n_heads: int, *,
                        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                        exact_rope: bool = True) -> InteractionContext:
    """Keys and values from the fixed context ``ĥ`` (B, N, d), computed once per sub-block (docs/cem.md §6).

    ``exact_rope=False`` keeps the values un-rotated (Llama's computation, not a gradient).
    """
    if w_k is None:
        return InteractionContext(h_ctx, None, None, rope, exact_rope)
    k_raw = split_heads(h_ctx @ w_k.t(), n_heads)
    if rope is None:
        return InteractionContext(h_ctx, k_raw, k_raw, None, exact_rope)
    k = apply_rope(k_raw, *rope)
    return InteractionContext(h_ctx, k, k if exact_rope else k_raw, rope, exact_rope)


def _causal_kwargs(g: torch.Tensor, ctx: InteractionContext) -> dict:
    return sdpa_causal_kwargs(g.shape[1], ctx.length, g.device)


def _queries(g: torch.Tensor, w_q: torch.Tensor, n_heads: int, ctx: InteractionContext) -> torch.Tensor:
    q = split_heads(g @ w_q.t(), n_heads)
    return q if ctx.rope is None else apply_rope(q, *ctx.rope)


def _lowrank_out(y: torch.Tensor, w_q: torch.Tensor, ctx: InteractionContext) -> torch.Tensor:
    """``−W_Qᵀ R_iᵀ y`` (B, N, d) from the head outputs ``y`` (B, H, N, d_h) (``W_Q`` is ``ctx.w_out``
    when a step map is folded in)."""
    if ctx.rope is not None and ctx.exact_rope:
        y = apply_rope(y, *ctx.rope, inverse=True)  # R_iᵀ: back to the query's frame
    return _neg_matmul(merge_heads(y), w_q if ctx.w_out is None else ctx.w_out)


def lowrank_grad(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, n_heads: int,
                 tau: float) -> torch.Tensor:
    """``∇_g ε_att`` (B, N, d) of tied attention: ``SDPA(q, k, v, causal, scale=1/τ)`` then ``−@ W_Q``.

    ``ctx`` from :func:`interaction_context` (may hold ``S ≥ N`` positions, ``g`` the last ``N``);
    from :func:`fold_step_map`, the result is ``M(∇_g ε_att)``. No shape checks (:func:`interaction_grad` checks).
    """
    if ctx.h_out is not None:
        raise ValueError("lowrank_grad has no diagonal term: a context folded with a diagonal belongs to "
                         "diag_shared_grad")
    y = F.scaled_dot_product_attention(_queries(g, w_q, n_heads, ctx), ctx.k, ctx.v, **_causal_kwargs(g, ctx),
                                       scale=1.0 / tau)
    return _lowrank_out(y, w_q, ctx)


def _augmented_width(g: torch.Tensor, w_q: torch.Tensor, n_heads: int) -> int:
    """Width of an augmented head ``[W^Q_k g ; d_k⊙g]``, padded as :func:`_augmented_grad` pads it."""
    width = w_q.shape[0] // n_heads + g.shape[-1]
    return width + (-width % _HEAD_DIM_ALIGN)


def diag_shared_grad(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                     n_heads: int, tau: float, sdpa: bool | None = None) -> torch.Tensor:
    """``∇_g ε_att`` (B, N, d) of D+LR with one diagonal ``diag`` (d,) for every head (docs/cem.md §4).

    ``sdpa=True``: :func:`diag_shared_grad_sdpa` (augmented heads through SDPA, never holds the
    (B, H, N, S) scores); ``False``: :func:`diag_shared_grad_dense` (materialized scores, cheaper in
    FLOPs); ``None`` (default): the dense path on the CPU (faster there; memory is not the limit)
    and wherever the augmented heads are wider than the fused CUDA kernels take
    (:func:`energyformer.energies.heads.attention_path`: ``d_h + d > 256``, e.g. 832 at GPT-2
    width), SDPA otherwise; inside ``force_attention_path`` the forced one. All exact (equal to
    rounding, tested).
    """
    if sdpa is None:
        sdpa = _augmented_path(g, w_q, n_heads) == "sdpa"
    fn = diag_shared_grad_sdpa if sdpa else diag_shared_grad_dense
    return fn(g, ctx, w_q, diag, n_heads, tau)


def _augmented_path(g: torch.Tensor, w_q: torch.Tensor, n_heads: int) -> str:
    """The path of a D+LR gradient: the forced one inside ``force_attention_path``; ``"scores"`` on
    the CPU (the materialized scores in causal row blocks beat the CPU flash kernel at the augmented
    width ``d_h + d``: ``benchmarks/bench_layers.py``); on CUDA, SDPA unless the augmented heads are
    wider than its fused kernels take (:func:`energyformer.energies.heads.attention_path`)."""
    forced = forced_attention_path()
    if forced is not None:
        return forced
    if g.device.type == "cpu":
        return "scores"
    return attention_path(_augmented_width(g, w_q, n_heads), g.device)


def diag_shared_grad_sdpa(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                          n_heads: int, tau: float) -> torch.Tensor:
    """:func:`diag_shared_grad` through SDPA: augmented heads ``q'_k = [W^Q_k g ; d⊙g]``,
    ``k'_k = [W^K_k ĥ ; ĥ]``, ``v'_k = [v_k ; ĥ]`` (the shared diagonal repeated per head, so
    ``q'_k·k'_k = s^k_ij``), one causal SDPA call (``is_causal=True`` without a cache), then
    ``−W_Qᵀ y − d ⊙ Σ_k o_k``. Memory O(B·H·N·(d_h + d)) instead of the (B, H, N, S) scores; the
    diagonal's score and value work is H times the dense path's. A folded step map
    (:func:`fold_step_map`): the diagonal's values are ``M(d ⊙ ĥ)`` and its term ``−Σ_k o_k``."""
    return _augmented_grad(g, ctx, w_q, diag.expand(n_heads, g.shape[-1]), n_heads, tau, h_out=ctx.h_out)


def diag_shared_grad_dense(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                           n_heads: int, tau: float) -> torch.Tensor:
    """:func:`diag_shared_grad` with the scores materialized (the CPU path, and the CUDA path of
    augmented heads too wide for the fused kernels): :class:`_SharedDiagAttention`, one causal
    block of query rows at a time with a hand-written backward.

    The diagonal score is head-independent and its update linear in the weights, so
    ``Σ_k d ⊙ Σ_j a^k_ij ĥ_j = d ⊙ Σ_j (Σ_k a^k_ij) ĥ_j``: the diagonal scores are one (B, n, S)
    product for every head, and its values one product of the head-summed weights. The scale goes
    on q and g; the scores are held in the compute dtype (bf16 under autocast; the softmax
    accumulates in float32).
    """
    scale = 1.0 / tau
    q = _queries(g, w_q, n_heads, ctx)
    dt = q.dtype
    k = ctx.k.to(dt)
    v = None if ctx.v is ctx.k else ctx.v.to(dt)  # None: values are the keys (tied)
    h_out = None if ctx.h_out is None else ctx.h_out.to(dt)  # M(d ⊙ ĥ): a folded step map
    y, o2 = _SharedDiagAttention.apply(q * scale, k, v, g.to(dt) * (diag.to(dt) * scale), ctx.h.to(dt), h_out)
    return _lowrank_out(y, w_q, ctx) + ((-diag.to(dt)) * o2 if h_out is None else -o2)


class _SharedDiagAttention(torch.autograd.Function):
    """Causal attention with materialized scores plus one diagonal score shared by every head, one
    block of query rows at a time (:func:`energyformer.energies.heads.causal_row_blocks`: a block
    stops at its last row's keys, so most of the masked upper triangle is never computed), with a
    hand-written backward (autograd through per-block slices would allocate and zero a full-size
    gradient per block and slice). Exact: equal to the per-element reference and to the SDPA path
    (tested).

    Inputs: scaled queries ``qs`` (B, H, N, d_h), keys ``k`` (B, H, S, d_h), values ``v`` (B, H, S,
    d_v; ``None`` when they are the keys, tied attention: one tensor is not passed twice, which
    ``torch.compile`` cannot trace), the scaled diagonal queries ``gq`` (B, N, d), the context
    ``h`` (B, S, d) and the diagonal's values ``hv`` (B, S, d; ``None``: they are ``h``); the queries
    are the last N of S positions. Scores ``s^k_ij = qs_k·k_k + gq·h_j``.

    Returns:
        ``y`` (B, H, N, d_v) = ``Σ_j a^k_ij v_j`` and ``o2`` (B, N, d) = ``Σ_k Σ_j a^k_ij hv_j``.
    """

    @staticmethod
    def forward(ctx, qs, k, v, gq, h, hv=None):
        ctx.tied, ctx.own_hv = v is None, hv is not None
        # q and k arrive as head views of (B, N, H·d_h): one copy here, not one per block and product
        qs, k, gq, h = qs.contiguous(), k.contiguous(), gq.contiguous(), h.contiguous()
        v = k if v is None else v.contiguous()
        hv = h if hv is None else hv.contiguous()
        n, s_len = qs.shape[2], k.shape[2]
        allowed = causal_mask(n, s_len, qs.device)
        ys, o2s, weights, head_sums = [], [], [], []
        ctx.blocks = causal_row_blocks(n, s_len)
        with torch.autocast(qs.device.type, enabled=False):
            for r0, r1, e in ctx.blocks:
                he = h[:, :e]
                scores = qs[:, :, r0:r1] @ k[:, :, :e].transpose(-1, -2)
                bias = gq[:, r0:r1] @ he.transpose(-1, -2)               # (B, rows, e), one for every head
                scores += bias.masked_fill_(~allowed[r0:r1, :e], float("-inf"))[:, None]
                a = softmax_low_precision(scores)
                ys.append(a @ v[:, :, :e])
                head_sums.append(a.sum(1))                               # kept: the backward needs it too
                o2s.append(head_sums[-1] @ hv[:, :e])
                weights.append(a)
        ctx.n_blocks = len(weights)
        ctx.save_for_backward(qs, k, None if ctx.tied else v, gq, h, hv if ctx.own_hv else None,
                              *weights, *head_sums)
        return _cat(ys, 2), _cat(o2s, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, do2):
        qs, k, v, gq, h, hv, *saved = ctx.saved_tensors
        weights, head_sums = saved[:ctx.n_blocks], saved[ctx.n_blocks:]
        v = k if ctx.tied else v
        with torch.autocast(qs.device.type, enabled=False):
            dy, do2, dqs, dgq, dk, dh, dv = _backward_buffers(ctx.tied, qs, k, v, h, gq, dy, do2)
            hv, dhv = (hv, torch.zeros_like(hv)) if ctx.own_hv else (h, dh)
            for (r0, r1, e), a, a_sum in zip(ctx.blocks, weights, head_sums):
                he, ke = h[:, :e], k[:, :, :e]
                dyb, do2b = dy[:, :, r0:r1], do2[:, r0:r1]
                da = dyb @ v[:, :, :e].transpose(-1, -2)                  # ∂L/∂a (B, H, rows, e)
                da += (do2b @ hv[:, :e].transpose(-1, -2))[:, None]
                dv[:, :, :e] += a.transpose(-1, -2) @ dyb
                dhv[:, :e] += a_sum.transpose(-1, -2) @ do2b
                ds = torch._softmax_backward_data(da, a, -1, a.dtype)       # ∂L/∂s = a ⊙ (da − Σ_j a da), fused
                dqs[:, :, r0:r1] = ds @ ke
                dk[:, :, :e] += ds.transpose(-1, -2) @ qs[:, :, r0:r1]
                dbias = ds.sum(1)
                dgq[:, r0:r1] = dbias @ he
                dh[:, :e] += dbias.transpose(-1, -2) @ gq[:, r0:r1]
        return dqs, dk, None if ctx.tied else dv, dgq, dh, dhv if ctx.own_hv else None


class _PerHeadDiagAttention(torch.autograd.Function):
    """Causal attention with materialized scores plus one diagonal score per head, as
    :class:`_SharedDiagAttention` (causal row blocks, hand-written backward, exact), with the
    diagonal's scaling and the sum over heads inside: the (B, H, N, d) scaled queries and
    per-head diagonal outputs exist one row block at a time, and the gradients of ``g`` and of the
    diagonal are reduced there, instead of as five full-size autograd passes around the call.

    Inputs: scaled queries ``qs`` (B, H, N, d_h), keys ``k`` (B, H, S, d_h), values ``v`` (B, H, S,
    d_v; ``None`` when tied), the normalized tokens ``g`` (B, N, d; ``None`` when they are the
    context ``h`` itself, a sub-block's first step: not passed twice, as ``v``), the diagonals
    ``diag`` (H, d), the context ``h`` (B, S, d) and the score scale ``1/τ`` (a float). Scores
    ``s^k_ij = qs_k·k_k + (scale · d_k ⊙ g_i)·h_j``.

    Returns:
        ``y`` (B, H, N, d_v) = ``Σ_j a^k_ij v_j`` and ``out`` (B, N, d) = ``−Σ_k d_k ⊙ Σ_j a^k_ij h_j``.
    """

    @staticmethod
    def forward(ctx, qs, k, v, g, diag, h, scale):
        ctx.tied, ctx.g_is_h, ctx.scale = v is None, g is None, scale
        qs, k, h = qs.contiguous(), k.contiguous(), h.contiguous()
        v = k if v is None else v.contiguous()
        g = h if g is None else g.contiguous()
        b, n_heads, n, _ = qs.shape
        s_len, d = h.shape[1], h.shape[2]
        dq = (diag * scale)[None, :, None, :]
        allowed = causal_mask(n, s_len, qs.device)
        ys, outs, weights, o2s = [], [], [], []
        ctx.blocks = causal_row_blocks(n, s_len)
        with torch.autocast(qs.device.type, enabled=False):
            for r0, r1, e in ctx.blocks:
                rows, he = r1 - r0, h[:, :e]
                gd = (g[:, None, r0:r1] * dq).view(b, n_heads * rows, d)    # scaled diagonal queries
                scores = qs[:, :, r0:r1] @ k[:, :, :e].transpose(-1, -2)
                scores += (gd @ he.transpose(-1, -2)).view(b, n_heads, rows, e)
                scores.masked_fill_(~allowed[r0:r1, :e], float("-inf"))
                a = softmax_low_precision(scores)
                ys.append(a @ v[:, :, :e])
                o2 = (a.view(b, n_heads * rows, e) @ he).view(b, n_heads, rows, d)   # Σ_j a^k_ij h_j
                outs.append((o2 * diag[None, :, None, :]).sum(1))
                weights.append(a)
                o2s.append(o2)                                           # kept: the diagonal's gradient
        ctx.n_blocks = len(weights)
        ctx.save_for_backward(qs, k, None if ctx.tied else v, None if ctx.g_is_h else g, diag, h, *weights, *o2s)
        return _cat(ys, 2), -_cat(outs, 1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dout):
        qs, k, v, g, diag, h, *saved = ctx.saved_tensors
        weights, o2s = saved[:ctx.n_blocks], saved[ctx.n_blocks:]
        v, g = k if ctx.tied else v, h if ctx.g_is_h else g
        b, n_heads, _, _ = qs.shape
        d = h.shape[2]
        dq, neg = (diag * ctx.scale)[None, :, None, :], (-diag)[None, :, None, :]
        with torch.autocast(qs.device.type, enabled=False):
            dy, dout, dqs, dg, dk, dh, dv = _backward_buffers(ctx.tied, qs, k, v, h, g, dy, dout)
            # the diagonal's gradient sums over batch, rows and blocks: accumulated in at least float32
            acc = torch.promote_types(diag.dtype, torch.float32)
            d_out_diag = diag.new_zeros(diag.shape, dtype=acc)
            d_query_diag = torch.zeros_like(d_out_diag)
            for (r0, r1, e), a, o2 in zip(ctx.blocks, weights, o2s):
                rows, he = r1 - r0, h[:, :e]
                dyb, doutb, gb = dy[:, :, r0:r1], dout[:, None, r0:r1], g[:, None, r0:r1]
                d_out_diag += (doutb * o2).sum((0, 2), dtype=acc)   # out = −Σ_k d_k ⊙ o2_k
                do2 = (doutb * neg).view(b, n_heads * rows, d)
                av = a.view(b, n_heads * rows, e)
                da = dyb @ v[:, :, :e].transpose(-1, -2)                  # ∂L/∂a (B, H, rows, e)
                da += (do2 @ he.transpose(-1, -2)).view(b, n_heads, rows, e)
                dv[:, :, :e] += a.transpose(-1, -2) @ dyb
                dh[:, :e] += av.transpose(-1, -2) @ do2
                ds = torch._softmax_backward_data(da, a, -1, a.dtype)       # ∂L/∂s, fused
                dqs[:, :, r0:r1] = ds @ k[:, :, :e]
                dk[:, :, :e] += ds.transpose(-1, -2) @ qs[:, :, r0:r1]
                dsv = ds.view(b, n_heads * rows, e)
                dgd = (dsv @ he).view(b, n_heads, rows, d)               # ∂L/∂(scaled diagonal queries)
                dh[:, :e] += dsv.transpose(-1, -2) @ (gb * dq).view(b, n_heads * rows, d)
                dg[:, r0:r1] = (dgd * dq).sum(1)
                d_query_diag += (dgd * gb).sum((0, 2), dtype=acc)
        ddiag = (d_query_diag * ctx.scale - d_out_diag).to(diag.dtype)
        if ctx.g_is_h:
            dh += dg
        return dqs, dk, None if ctx.tied else dv, None if ctx.g_is_h else dg, ddiag, dh, None


def _backward_buffers(tied: bool, qs, k, v, h, x, dy, dx):
    """The incoming gradients of a materialized-scores backward (``dy`` of the head outputs, ``dx``
    of the diagonal output, shaped like the diagonal input ``x``; zeros for an output that was not
    used) in the queries' dtype, and the buffers it fills: ``dqs``, ``dx_in`` (empty, written block
    by block), ``dk``, ``dh``, ``dv`` (zero, accumulated; ``dv`` is ``dk`` when tied)."""
    dy = qs.new_zeros(*qs.shape[:3], v.shape[-1]) if dy is None else dy.to(qs.dtype).contiguous()
    dx = qs.new_zeros(x.shape) if dx is None else dx.to(qs.dtype).contiguous()
    dk, dh = torch.zeros_like(k), torch.zeros_like(h)
    return dy, dx, torch.empty_like(qs), torch.empty_like(x), dk, dh, dk if tied else torch.zeros_like(v)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat`` that returns a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def diag_per_head_grad(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                       n_heads: int, tau: float) -> torch.Tensor:
    """``∇_g ε_att`` (B, N, d) of D+LR with one diagonal per head, ``diag`` (H, d) (docs/cem.md §4):
    :func:`diag_per_head_grad_sdpa` (augmented heads through SDPA) on CUDA, or
    :func:`diag_per_head_grad_dense` (materialized scores) on the CPU and where the augmented heads
    are wider than the fused CUDA kernels take (:func:`_augmented_path`). Both exact (equal to the
    per-element reference, tested)."""
    fn = diag_per_head_grad_sdpa if _augmented_path(g, w_q, n_heads) == "sdpa" else diag_per_head_grad_dense
    return fn(g, ctx, w_q, diag, n_heads, tau)


def diag_per_head_grad_sdpa(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                            n_heads: int, tau: float) -> torch.Tensor:
    """:func:`diag_per_head_grad` through augmented heads ``[W_Q g ; d_k⊙g]`` / ``[W_K ĥ ; ĥ]`` and
    one SDPA call with explicit ``scale=1/τ``: (B, N, d)."""
    _unfolded(ctx, "diag_per_head_grad_sdpa")
    return _augmented_grad(g, ctx, w_q, diag, n_heads, tau)


def diag_per_head_grad_dense(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                             n_heads: int, tau: float) -> torch.Tensor:
    """:func:`diag_per_head_grad` with the scores ``s^k_ij = q_k·k_k + (d_k⊙g_i)·ĥ_j``
    materialized in the compute dtype (bf16 under autocast), one causal block of query rows at a
    time (:class:`_PerHeadDiagAttention`): ``−W_Qᵀ Σ_j a_ij v_j − Σ_k d_k ⊙ Σ_j a^k_ij ĥ_j``,
    (B, N, d). ``ĥ`` is never expanded over heads (one batched product per term).
    """
    _unfolded(ctx, "diag_per_head_grad_dense")
    scale = 1.0 / tau
    q = _queries(g, w_q, n_heads, ctx)
    dt = q.dtype
    k = ctx.k.to(dt)
    v = None if ctx.v is ctx.k else ctx.v.to(dt)  # None: values are the keys (tied)
    g_in = None if g is ctx.h else g.to(dt)  # None: g is the context ĥ (the first step)
    y, out = _PerHeadDiagAttention.apply(q * scale, k, v, g_in, diag.to(dt), ctx.h.to(dt), scale)
    return _lowrank_out(y, w_q, ctx) + out


def _masked_softmax_scores(s: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """Causal softmax over the keys of (B, H, N, S) scores (queries the last N of S), in ``s.dtype``."""
    if n > 1:
        s = s.masked_fill(~causal_mask(n, length, s.device), float("-inf"))
    return softmax_low_precision(s)


_HEAD_DIM_ALIGN = 8  # augmented heads are zero-padded to a multiple of this (fused GPU kernels need it)


def _augmented_grad(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor, diag: torch.Tensor,
                    n_heads: int, tau: float, h_out: torch.Tensor | None = None) -> torch.Tensor:
    """D+LR gradient through augmented heads, ``diag`` (H, d) (a shared one expanded over heads).

    ``h_out``: the diagonal's values ``M(d ⊙ ĥ)`` (B, S, d) of a step map folded in with a shared
    diagonal (:func:`fold_step_map`); its term is then ``−Σ_k o_k``.

    The augmented head dims are zero-padded to a multiple of 8 inside the same concatenation
    (zero query/key features add 0 to the scores, the padded value features are dropped), so the
    memory-efficient GPU kernel accepts them whatever ``d_h + d`` is. Every piece is cast to the
    queries' (compute) dtype before ``expand`` / ``cat``, so neither autocast nor ``cat``'s type
    promotion copies an expanded tensor to float32.
    """
    q = _queries(g, w_q, n_heads, ctx)
    dt = q.dtype
    h, dg, k = ctx.h.to(dt), diag.to(dt), ctx.k.to(dt)
    v = k if ctx.v is ctx.k else ctx.v.to(dt)
    b, n, d = g.shape
    dq, dv = q.shape[-1], v.shape[-1]
    pad_k, pad_v = -(dq + d) % _HEAD_DIM_ALIGN, -(dv + d) % _HEAD_DIM_ALIGN
    hk = h[:, None].expand(b, n_heads, ctx.length, d)
    qa = torch.cat((q, dg[None, :, None, :] * g.to(dt)[:, None], q.new_zeros(b, n_heads, n, pad_k)), dim=-1)
    ka = torch.cat((k, hk, hk.new_zeros(b, n_heads, ctx.length, pad_k)), dim=-1)
    hv = hk if h_out is None else h_out.to(dt)[:, None].expand(b, n_heads, ctx.length, d)
    va = ka if (v is k and pad_v == pad_k and h_out is None) else torch.cat(
        (v, hv, hv.new_zeros(b, n_heads, ctx.length, pad_v)), dim=-1)
    o = F.scaled_dot_product_attention(qa, ka, va, **_causal_kwargs(g, ctx), scale=1.0 / tau)
    y, o2 = o[..., :dv], o[..., dv:dv + d]
    if h_out is not None:
        return _lowrank_out(y, w_q, ctx) - o2.sum(1)
    return _lowrank_out(y, w_q, ctx) + ((-dg)[None, :, None, :] * o2).sum(1)


def diag_only_grad(g: torch.Tensor, ctx: InteractionContext, diag: torch.Tensor, tau: float) -> torch.Tensor:
    """``∇_g ε_att`` (B, N, d) of per-head diagonals only, ``diag`` (H, d): ``q = d_k ⊙ g``, ``k = v = ĥ``.

    :func:`diag_only_grad_sdpa`, or :func:`diag_only_grad_dense` where the heads (``d`` wide) are
    wider than the fused CUDA kernels take (:func:`energyformer.energies.heads.attention_path`)."""
    fn = diag_only_grad_dense if attention_path(g.shape[-1], g.device) == "scores" else diag_only_grad_sdpa
    return fn(g, ctx, diag, tau)


def _diag_queries(g: torch.Tensor, ctx: InteractionContext, diag: torch.Tensor):
    """``(d_k ⊙ g, ĥ, d)`` in the compute dtype: (B, H, N, d), (B, S, d), (H, d)."""
    _unfolded(ctx, "diag_only_grad")
    dt = compute_dtype(g)
    dg = diag.to(dt)
    return dg[None, :, None, :] * g.to(dt)[:, None], ctx.h.to(dt), dg


def diag_only_grad_sdpa(g: torch.Tensor, ctx: InteractionContext, diag: torch.Tensor, tau: float) -> torch.Tensor:
    """:func:`diag_only_grad` as one SDPA call (``ĥ`` cast once, then expanded over heads): (B, N, d)."""
    b, _, d = g.shape
    dq, h, dg = _diag_queries(g, ctx, diag)
    hk = h[:, None].expand(b, diag.shape[0], ctx.length, d)
    o = F.scaled_dot_product_attention(dq, hk, hk, **_causal_kwargs(g, ctx), scale=1.0 / tau)
    return ((-dg)[None, :, None, :] * o).sum(1)


def diag_only_grad_dense(g: torch.Tensor, ctx: InteractionContext, diag: torch.Tensor, tau: float) -> torch.Tensor:
    """:func:`diag_only_grad` with the (B, H, N, S) scores materialized in the compute dtype: (B, N, d)."""
    dq, h, dg = _diag_queries(g, ctx, diag)
    a = _masked_softmax_scores(torch.einsum("bhnd,bsd->bhns", dq * (1.0 / tau), h), g.shape[1], ctx.length)
    o = torch.einsum("bhns,bsd->bhnd", a, h)
    return ((-dg)[None, :, None, :] * o).sum(1)


def interaction_grad(g: torch.Tensor, h_ctx: torch.Tensor, w_q: torch.Tensor | None,
                     w_k: torch.Tensor | None, n_heads: int, *, diag: torch.Tensor | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None, exact_rope: bool = True,
                     tau: float | None = None, context: InteractionContext | None = None) -> torch.Tensor:
    """Analytic ``∇_g ε_att`` (B, N, d) (docs/cem.md §2 gradient, §4 D+LR, §2.1 RoPE), checked.

    Calls the fast gradient of the form the tensors give: ``w_q = None`` → :func:`diag_only_grad`;
    ``diag`` None → :func:`lowrank_grad`; (d,) → :func:`diag_shared_grad`; (H, d) →
    :func:`diag_per_head_grad`.

    ``exact_rope=True`` is the true gradient of the rotated energy (values = rotated keys, head
    output un-rotated by ``R_iᵀ``). ``exact_rope=False`` is **not** a gradient of any energy: it
    returns minus what Llama attention with ``v_proj = k_proj``, ``o_proj = q_projᵀ`` computes
    (values = un-rotated keys, no un-rotation). Without RoPE the two coincide.

    Args:
        g, h_ctx: (B, N, d). w_q, w_k: (H·d_h, d) or both None. n_heads: H.
        diag: None, (d,) shared, or (H, d) per head. rope: (cos, sin), each (N, d_h), or None.
        tau: temperature, default ``sqrt(d_h)`` (required when ``w_q`` is None).
        context: precomputed :func:`interaction_context` of ``h_ctx`` (then ``w_k`` is only checked).
            Cached decoding (docs/architecture.md §5): ``context`` and ``h_ctx`` may hold ``S ≥ N``
            positions, ``g`` being the last ``N`` of them; ``context.rope`` (and ``rope``) are then
            the tables of the queries' positions (the cached keys are already rotated).

    Raises:
        ValueError: inconsistent shapes, missing ``tau``.
    """
    _, tau = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope, allow_longer_context=context is not None)
    ctx = context if context is not None else interaction_context(h_ctx, w_k, n_heads, rope=rope,
                                                                  exact_rope=exact_rope)
    if w_q is None:
        return diag_only_grad(g, ctx, diag, tau)
    if diag is None:
        return lowrank_grad(g, ctx, w_q, n_heads, tau)
    if diag.dim() == 1:
        return diag_shared_grad(g, ctx, w_q, diag, n_heads, tau)
    return diag_per_head_grad(g, ctx, w_q, diag, n_heads, tau)


def _scores(g, h_ctx, w_q, w_k, n_heads, diag, rope) -> torch.Tensor:
    """Raw scores ``s^k_ij = g_iᵀ A_k(i, j) ĥ_j`` (B, H, N, N) via projections (energy evaluation)."""
    s = 0.0
    if w_q is not None:
        q, k = split_heads(g @ w_q.t(), n_heads), split_heads(h_ctx @ w_k.t(), n_heads)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        s = q @ k.transpose(-1, -2)
    if diag is not None:  # (d,) -> (1, d) broadcasts over the heads, (H, d) is per head
        dg = diag.reshape(-1, g.shape[-1])[None, :, None, :] * g[:, None]  # (B, 1 or H, N, d)
        s = s + dg @ h_ctx[:, None].transpose(-1, -2)
    return s


def interaction_energy(g: torch.Tensor, h_ctx: torch.Tensor, w_q: torch.Tensor | None,
                       w_k: torch.Tensor | None, n_heads: int, *, diag: torch.Tensor | None = None,
                       rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                       tau: float | None = None) -> torch.Tensor:
    """Per-token ``ε_att`` (B, N) = ``− Σ_k τ · lse_{j≤i}(s^k_ij / τ)`` (docs/cem.md §2, §4).

    Same arguments as :func:`interaction_grad`. With RoPE this is the rotated energy (the one
    whose gradient is the ``exact_rope`` one). Log-sum-exp in at least float32.

    Raises:
        ValueError: inconsistent shapes, missing ``tau`` for diagonal-only.
    """
    _, tau = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope)
    s = _scores(g, h_ctx, w_q, w_k, n_heads, diag, rope)
    s = s.to(_softmax_dtype(s.dtype)) / tau
    n = g.shape[1]
    s = s.masked_fill(~causal_mask(n, n, g.device), float("-inf"))
    return (-tau * torch.logsumexp(s, dim=-1).sum(1)).to(g.dtype)


def interaction_energy_from_context(g: torch.Tensor, ctx: InteractionContext, w_q: torch.Tensor | None,
                                    n_heads: int, *, diag: torch.Tensor | None = None,
                                    tau: float | None = None) -> torch.Tensor:
    """Per-token ``ε_att`` (B, N) of the last ``N`` of ``S`` positions against a context (docs/cem.md §2, §4).

    ``ctx`` from :func:`interaction_context` or a cache (docs/architecture.md §5): its keys
    ``R_j W_K ĥ_j`` (B, H, S, d_h) (with a low-rank term) and ``ĥ`` (B, S, d) (with a diagonal),
    its ``rope`` the tables of the ``N`` query positions; ``g`` (B, N, d). The same energy as
    :func:`interaction_energy`, which recomputes the keys from ``ĥ`` (tested equal on the whole
    sequence, last ``N`` rows); this one needs no ``ĥ`` of the cached positions without a diagonal,
    so it serves cached decoding (docs/inference_compute.md §4). ``tau`` defaults to ``sqrt(d_h)``.

    Raises:
        ValueError: ``g`` not (B, N, d) with ``N ≤ S``; no ``tau`` without a low-rank term.
    """
    n, length = g.shape[1], ctx.length
    if g.dim() != 3 or n > length:
        raise ValueError(f"g must be (B, N, d) with N <= the context's {length} positions; got {tuple(g.shape)}")
    if w_q is None and tau is None:
        raise ValueError("tau must be given when there is no low-rank term (w_q=None)")
    tau = math.sqrt(w_q.shape[0] // n_heads) if tau is None else float(tau)
    s = 0.0
    if w_q is not None:
        s = _queries(g, w_q, n_heads, ctx) @ ctx.k.transpose(-1, -2)
    if diag is not None:
        dg = diag.reshape(-1, g.shape[-1])[None, :, None, :] * g[:, None]  # (B, 1 or H, N, d)
        s = s + dg @ ctx.h[:, None].transpose(-1, -2)
    s = s.to(_softmax_dtype(s.dtype)) / tau
    s = s.masked_fill(~causal_mask(n, length, g.device), float("-inf"))
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


def interaction_energy_reference(g, h_ctx, w_q, w_k, n_heads, *, diag=None, rope=None, tau=None) -> torch.Tensor:
    """Plain reference of :func:`interaction_energy`: explicit ``g_iᵀ A_k(i, j) ĥ_j`` (O(H N² d²); tests only)."""
    _, tau = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope)
    b, n, d = g.shape
    a, _ = _interaction_matrices(w_q, w_k, n_heads, diag, rope, n, d, g.dtype, g.device)
    s = torch.einsum("bia,hijac,bjc->bhij", g, a, h_ctx) / tau
    out = torch.zeros(b, n, dtype=g.dtype, device=g.device)
    for i in range(n):  # explicit causal sum over j ≤ i
        out[:, i] = -tau * torch.logsumexp(s[:, :, i, : i + 1], dim=-1).sum(1)
    return out


def interaction_grad_reference(g, h_ctx, w_q, w_k, n_heads, *, diag=None, rope=None, exact_rope=True,
                               tau=None) -> torch.Tensor:
    """Plain reference of :func:`interaction_grad`: ``− Σ_k Σ_{j≤i} a^k_ij V_k(i, j) ĥ_j`` (tests only).

    ``V_k(i, j) = A_k(i, j)`` with ``exact_rope``; without (Llama's computation) ``V_k = W^Q_kᵀ W^K_k + diag(d_k)``
    (un-rotated values, no un-rotation) while the weights ``a`` still use the rotated scores.
    """
    _, tau = _check_interaction(g, h_ctx, w_q, w_k, n_heads, diag, tau, rope)
    b, n, d = g.shape
    a_mat, v_llama = _interaction_matrices(w_q, w_k, n_heads, diag, rope, n, d, g.dtype, g.device)
    v_mat = a_mat if (rope is None or exact_rope) else v_llama
    s = torch.einsum("bia,hijac,bjc->bhij", g, a_mat, h_ctx) / tau
    out = torch.zeros_like(g)
    for i in range(n):
        w = torch.softmax(s[:, :, i, : i + 1], dim=-1)  # (B, H, i+1)
        vh = torch.einsum("hjac,bjc->bhja", v_mat[:, i, : i + 1], h_ctx[:, : i + 1])
        out[:, i] = -torch.einsum("bhj,bhja->ba", w, vh)
    return out


# ----------------------------------------------------------------------------- gated MLP

def _check_mlp(g, h_ctx, w_gate, w_up):
    if g.shape != h_ctx.shape or g.dim() != 3:
        raise ValueError(f"g and h_ctx must both be (B, N, d); got {tuple(g.shape)} and {tuple(h_ctx.shape)}")
    if w_gate.dim() != 2 or w_gate.shape != w_up.shape or w_gate.shape[1] != g.shape[-1]:
        raise ValueError(f"w_gate and w_up must both be (d_ff, d) with d={g.shape[-1]}; "
                         f"got {tuple(w_gate.shape)} and {tuple(w_up.shape)}")


def gate_tie_context(h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Gate tie (variant A, docs/cem.md §3): the fixed multiplicative branch ``W_U ĥ`` (B, N, d_ff)."""
    return h_ctx @ w_up.t()


def gate_tie_energy(g: torch.Tensor, h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Gate tie (variant A): per-token ``ε = − Σ_m (W_U ĥ)_m F(w^gate_m·g)`` (B, N),
    ``F(z) = z·softplus(z) + Li₂(−e^z)``.

    Raises:
        ValueError: shape mismatch.
    """
    _check_mlp(g, h_ctx, w_gate, w_up)
    return -(gate_tie_context(h_ctx, w_gate, w_up) * silu_antiderivative(g @ w_gate.t())).sum(-1)


def gate_tie_grad(g: torch.Tensor, h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  context: torch.Tensor | None = None, w_out: torch.Tensor | None = None) -> torch.Tensor:
    """Analytic ``∇_g`` of :func:`gate_tie_energy` (B, N, d): ``− W_Gᵀ(W_U ĥ ⊙ SiLU(W_G g))``.

    ``context``: precomputed :func:`gate_tie_context` (B, N, d_ff), reused across recursion steps.
    ``w_out``: the output weight in place of ``W_G`` (d_ff, d); ``M(W_G)`` for a linear step map
    ``M`` gives ``M(∇_g ε)`` with no per-token work for ``M`` (docs/cem.md §5).

    Raises:
        ValueError: shape mismatch.
    """
    _check_mlp(g, h_ctx, w_gate, w_up)
    c = context if context is not None else gate_tie_context(h_ctx, w_gate, w_up)
    return _neg_matmul(c * F.silu(g @ w_gate.t()), w_gate if w_out is None else w_out)


def up_tie_context(h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Up tie (variant B, docs/cem.md §3): the fixed multiplicative branch ``SiLU(W_G ĥ)`` (B, N, d_ff)."""
    return F.silu(h_ctx @ w_gate.t())


def up_tie_energy(g: torch.Tensor, h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """Up tie (variant B): per-token ``ε = − ½ Σ_m SiLU(w^gate_m·ĥ) (w^up_m·g)²`` (B, N).

    Raises:
        ValueError: shape mismatch.
    """
    _check_mlp(g, h_ctx, w_gate, w_up)
    return -0.5 * (up_tie_context(h_ctx, w_gate, w_up) * (g @ w_up.t()) ** 2).sum(-1)


def up_tie_grad(g: torch.Tensor, h_ctx: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                context: torch.Tensor | None = None, w_out: torch.Tensor | None = None) -> torch.Tensor:
    """Analytic ``∇_g`` of :func:`up_tie_energy` (B, N, d): ``− W_Uᵀ(SiLU(W_G ĥ) ⊙ W_U g)``.

    ``w_out``: the output weight in place of ``W_U``, as in :func:`gate_tie_grad`.

    Raises:
        ValueError: shape mismatch.
    """
    _check_mlp(g, h_ctx, w_gate, w_up)
    c = context if context is not None else up_tie_context(h_ctx, w_gate, w_up)
    return _neg_matmul(c * (g @ w_up.t()), w_up if w_out is None else w_out)


# ----------------------------------------------------------------------------- norm Jacobian

def rms_norm_vjp(x: torch.Tensor, v: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``J_Norm(x)ᵀ v`` for ``RMSNorm(x) = γ ⊙ x / r``, ``r = sqrt(mean(x²) + eps)``
    (docs/cem.md §7 ``grad_through_norm``).

    ``Jᵀ v = (γ⊙v)/r − x · (x·(γ⊙v)) / (d r³)``; shapes (…, d) -> (…, d). Used to turn ``∇_g ε`` into
    the true ``∇_x ε`` when the energy is differentiated through the norm.
    """
    d = x.shape[-1]
    gv = v if weight is None else v * weight
    r = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return gv / r - x * (x * gv).sum(-1, keepdim=True) / (d * r ** 3)
