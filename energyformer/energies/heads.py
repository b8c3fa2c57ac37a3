"""Multi-head plumbing shared by every attention: head splitting and rotary position embedding (RoPE).

``split_heads`` / ``merge_heads`` move between ``(B, N, H·d_h)`` and ``(B, H, N, d_h)``. RoPE
(docs/baselines.md §3, docs/cem.md §3) in the "rotate-half" layout of Llama / Hugging Face, in
which feature ``c`` is paired with feature ``c + d_h/2`` and rotated by the angle ``p · θ^(−2c/d_h)``
at position ``p``:


    rope(x)_p = x_p ⊙ cos_p + rotate_half(x_p) ⊙ sin_p,     rotate_half([x₁; x₂]) = [−x₂; x₁].

``R_p`` is orthogonal, so ``R_pᵀ`` (the inverse, used to un-rotate CEM's exact-RoPE head outputs)
is the same formula with ``sin`` negated (``inverse=True``). Pure functions, in ``energies/``
because the CEM energies need them; every layer (GPT, Llama, CEM, NRGPT) imports them from here.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from energyformer._validate import check_float, check_int

__all__ = ["split_heads", "merge_heads", "rope_cos_sin", "rotate_half", "apply_rope", "rope_matrices",
           "causal_mask", "causal_blocks", "causal_row_blocks", "sdpa_causal_kwargs", "FUSED_HEAD_DIM_MAX",
           "ATTENTION_PATHS", "attention_path", "force_attention_path", "forced_attention_path", "compute_dtype",
           "softmax_low_precision"]


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``(B, N, H·d_h) -> (B, H, N, d_h)`` (a view when possible)."""
    b, n, hd = x.shape
    return x.view(b, n, n_heads, hd // n_heads).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, d_h) -> (B, N, H·d_h)``."""
    b, h, n, dh = y.shape
    return y.transpose(1, 2).reshape(b, n, h * dh)


def rope_cos_sin(n_positions: int, head_dim: int, theta: float = 10000.0, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cos, sin)``, each ``(n_positions, head_dim)``, for positions ``start … start+n_positions−1``
    (``start > 0``: the new tokens of cached decoding, docs/architecture.md §5).

    The angles are computed in float64 and cast to ``dtype`` (so float64 tests are exact to
    rounding and float32 matches Hugging Face Llama to ~1e-7).

    Raises:
        ValueError: ``head_dim`` odd or < 2, ``n_positions < 1``, ``start < 0``, ``theta <= 0``.
    """
    check_int("n_positions", n_positions, 1)
    check_int("start", start, 0)
    check_int("head_dim", head_dim, 2)
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even to use RoPE (features are rotated in pairs)")
    check_float("rope_theta", theta, 0.0, strict=True)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    pos = torch.arange(start, start + n_positions, dtype=torch.float64, device=device)
    ang = pos[:, None] * inv_freq[None, :]
    ang = torch.cat((ang, ang), dim=-1)  # (N, head_dim): pair c and c + head_dim/2 share an angle
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x₁; x₂] -> [−x₂; x₁]`` over the last dim (even size)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate ``x`` of shape ``(…, N, head_dim)`` by ``R_p`` (or ``R_pᵀ`` if ``inverse``) per position ``p``.

    ``cos``/``sin`` are ``(N, head_dim)`` from :func:`rope_cos_sin` (broadcast over leading dims).
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if inverse:
        return x * cos - rotate_half(x) * sin
    return x * cos + rotate_half(x) * sin


def rope_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Explicit rotation matrices ``R_p`` as a ``(N, head_dim, head_dim)`` tensor (test reference only).

    Built entry by entry from the pair structure, independently of :func:`apply_rope`, so
    that the plain CEM references (``energies/cem.py``) do not reuse the fast rotation code.
    """
    n, dh = cos.shape
    half = dh // 2
    r = torch.zeros(n, dh, dh, dtype=cos.dtype, device=cos.device)
    for c in range(half):
        a, b = c, c + half
        r[:, a, a] = cos[:, a]
        r[:, a, b] = -sin[:, a]
        r[:, b, a] = sin[:, b]
        r[:, b, b] = cos[:, b]
    return r


def causal_mask(n_query: int, n_key: int, device: torch.device | str | None = None, *,
                strict: bool = False) -> torch.Tensor:
    """``(n_query, n_key)`` bool, True where query ``i`` may attend to key ``j``.

    The queries are the *last* ``n_query`` of the ``n_key`` positions (cached decoding: keys of
    earlier positions come from the cache, docs/architecture.md §5), so query ``i`` sits at
    position ``p = n_key − n_query + i`` and sees ``j ≤ p`` (``strict=True``: ``j < p``).

    Raises:
        ValueError: ``n_query > n_key`` or a size < 1.
    """
    check_int("n_query", n_query, 1)
    check_int("n_key", n_key, n_query)
    return torch.ones(n_query, n_key, dtype=torch.bool, device=device).tril(n_key - n_query - int(strict))


#: at most this many query-row blocks, each of at least ``CAUSAL_BLOCK_MIN_ROWS`` rows (:func:`causal_row_blocks`)
CAUSAL_BLOCKS_MAX, CAUSAL_BLOCK_MIN_ROWS = 4, 32


@contextmanager
def causal_blocks(max_blocks: int, min_rows: int = 1) -> Iterator[None]:
    """Inside the block, :func:`causal_row_blocks` cuts at most ``max_blocks`` blocks of at least
    ``min_rows`` rows. ``causal_blocks(N)`` makes every row its own block, so a materialized path
    computes exactly the ``N(N+1)/2`` causal pairs: how ``benchmarks/bench_layers.py`` counts the
    FLOPs a path is bound by, the same charge as a causal SDPA call.

    Raises:
        ValueError: ``max_blocks`` or ``min_rows`` < 1.
    """
    global CAUSAL_BLOCKS_MAX, CAUSAL_BLOCK_MIN_ROWS
    check_int("max_blocks", max_blocks, 1)
    check_int("min_rows", min_rows, 1)
    saved = CAUSAL_BLOCKS_MAX, CAUSAL_BLOCK_MIN_ROWS
    CAUSAL_BLOCKS_MAX, CAUSAL_BLOCK_MIN_ROWS = max_blocks, min_rows
    try:
        yield
    finally:
        CAUSAL_BLOCKS_MAX, CAUSAL_BLOCK_MIN_ROWS = saved


def causal_row_blocks(n_query: int, n_key: int) -> list[tuple[int, int, int]]:
    """Query-row blocks ``(start, stop, keys)`` of a causal attention whose scores are materialized:
    rows ``start … stop−1`` (of the last ``n_query`` of ``n_key`` positions, as :func:`causal_mask`)
    see at most the first ``keys`` keys, so the score, softmax and value products of a block stop
    there. ``c`` blocks compute ``(c + 1) / 2c`` of the full ``N × S`` products when ``S = N``
    (62.5% for 4) instead of all of them; a fused causal kernel (SDPA) skips the masked half
    itself. One block (the whole product) below ``2 · CAUSAL_BLOCK_MIN_ROWS`` rows, e.g. one
    decoded token.
    """
    c = max(1, min(CAUSAL_BLOCKS_MAX, n_query // CAUSAL_BLOCK_MIN_ROWS))
    cuts = [round(i * n_query / c) for i in range(c + 1)]
    offset = n_key - n_query
    return [(cuts[i], cuts[i + 1], offset + cuts[i + 1]) for i in range(c)]


def sdpa_causal_kwargs(n_query: int, n_key: int, device: torch.device | str | None = None) -> dict:
    """The causal-mask keyword of ``scaled_dot_product_attention`` for queries at the last
    ``n_query`` of ``n_key`` positions: ``is_causal=True`` when they are equal (no cache), no mask
    for one query (the newest token sees every key), else an explicit :func:`causal_mask`."""
    if n_query == n_key:
        return {"is_causal": True}
    if n_query == 1:
        return {}
    return {"attn_mask": causal_mask(n_query, n_key, device)}


# --------------------------------------------------------------------------------------------
# wide heads: SDPA or materialized scores (docs/gpu.md, "Wide attention heads")
# --------------------------------------------------------------------------------------------
#: the widest head (query/key feature count) the fused CUDA SDPA kernels (flash, cuDNN) accept;
#: a wider one falls to the memory-efficient kernel, which is slow at that width
FUSED_HEAD_DIM_MAX = 256
#: the two ways an energy attention is computed: ``"sdpa"`` (one ``scaled_dot_product_attention``
#: call) or ``"scores"`` (the ``(B, H, N, S)`` scores materialized in the compute dtype)
ATTENTION_PATHS = ("sdpa", "scores")
_FORCED_PATH: list[str] = []


def forced_attention_path() -> str | None:
    """The path :func:`force_attention_path` forces here, or ``None`` outside it."""
    return _FORCED_PATH[-1] if _FORCED_PATH else None


def attention_path(head_dim: int, device: torch.device | str) -> str:
    """The path an energy attention with queries/keys ``head_dim`` wide takes on ``device``:
    ``"scores"`` on CUDA when ``head_dim > FUSED_HEAD_DIM_MAX`` (NRGPT's full ``J``, whose keys are
    ``d_model`` wide, and CEM's augmented diagonal heads, ``d_h + d_model`` wide), else ``"sdpa"``;
    the CPU always keeps SDPA. Inside :func:`force_attention_path` the forced path is returned."""
    if _FORCED_PATH:
        return _FORCED_PATH[-1]
    if torch.device(device).type == "cuda" and head_dim > FUSED_HEAD_DIM_MAX:
        return "scores"
    return "sdpa"


@contextmanager
def force_attention_path(path: str) -> Iterator[None]:
    """Every energy attention inside the block takes ``path`` (``"sdpa"`` or ``"scores"``) whatever
    its width and device (benchmarks compare the two; FLOP counting uses ``"sdpa"``).

    Raises:
        ValueError: ``path`` not one of :data:`ATTENTION_PATHS`.
    """
    if path not in ATTENTION_PATHS:
        raise ValueError(f"attention path {path!r} is unknown; expected one of {ATTENTION_PATHS}")
    _FORCED_PATH.append(path)
    try:
        yield
    finally:
        _FORCED_PATH.pop()


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``x`` runs in: the autocast dtype when autocast is on for ``x``'s device
    type, else ``x.dtype``. Casting an operand to it *before* ``expand`` or ``cat`` does the cast
    once, on the small tensor (autocast would otherwise copy the expanded or promoted result)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def softmax_low_precision(scores: torch.Tensor) -> torch.Tensor:
    """``softmax`` over the last dim returned in ``scores.dtype`` (bf16 stays bf16 under autocast,
    which would otherwise return float32; the kernels accumulate in float32 either way)."""
    return torch.softmax(scores, dim=-1, dtype=scores.dtype)
