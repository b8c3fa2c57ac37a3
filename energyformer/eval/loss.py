"""Held-out loss of a language model, and what it means in perplexity and bits.

The loss is the mean cross-entropy in nats per token (what ``CausalLM.forward`` returns).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

# evaluation batches of split i come from a generator seeded with seed + _SPLIT_SEED_STRIDE * (i + 1)
_SPLIT_SEED_STRIDE = 1_000_003


@torch.no_grad()
def estimate_loss(model: nn.Module, splits: Mapping[str, Any], *, eval_iters: int, batch_size: int,
                  block_size: int, seed: int, device: str | torch.device = "cpu",
                  autocast: Any = None, get_batch: Callable | None = None, rank: int = 0,
                  world_size: int = 1, all_reduce: Callable[[float], float] | None = None) -> dict[str, float]:
    """Mean loss over ``eval_iters`` random batches of each split, in eval mode.

    Each split draws its batches from its own ``torch.Generator`` seeded from ``seed`` and the
    split's position in ``splits``: the same batches at every evaluation (curves are
    comparable) and the caller's RNG streams are untouched (training resumes exactly).

    Args:
        model: ``model(x, y) -> (logits, loss)`` with ``x, y`` of shape (B, N).
        splits: name → 1-D token array (e.g. ``{"val": val_data, "train": train_data}``).
        eval_iters: batches per split.
        batch_size: B.
        block_size: N.
        seed: base seed of the per-split generators.
        device: where the batches go.
        autocast: a context manager entered around each forward (e.g. bf16 autocast); none by default.
        get_batch: ``get_batch(data, B, N, generator, device) -> (x, y)``; default
            ``energyformer.data.get_batch``.
        rank, world_size, all_reduce: with several processes, rank ``r`` evaluates batches
            ``r, r + W, ...`` (every rank runs the same number of forwards, padding with
            batches of weight 0, as sharded models need) and ``all_reduce`` sums a float over
            ranks; the result is the mean over the same ``eval_iters`` batches as one process.

    Returns:
        ``{split name: mean loss in nats per token}``. The model's train/eval mode is restored.

    """
    if get_batch is None:
        from energyformer.data import get_batch
    was_training = model.training
    model.eval()
    out = {}
    per_rank = -(-eval_iters // world_size)
    try:
        for i, (name, data) in enumerate(splits.items()):
            gen = torch.Generator().manual_seed(seed + _SPLIT_SEED_STRIDE * (i + 1))
            total, first = 0.0, None
            for j in range(per_rank * world_size):
                if j < eval_iters:
                    batch = get_batch(data, batch_size, block_size, gen, device if j % world_size == rank else "cpu")
                    first = batch if first is None and j % world_size == rank else first
                if j % world_size != rank:
                    continue
                weight = 1.0 if j < eval_iters else 0.0  # padding: as many forwards on every rank
                x, y = batch if weight else (first if first is not None else batch)
                if x.device != torch.device(device):
                    x, y = x.to(device), y.to(device)
                with autocast if autocast is not None else contextlib.nullcontext():
                    _, loss = model(x, y)
                total += weight * loss.item()
            out[name] = (all_reduce(total) if all_reduce is not None else total) / eval_iters
    finally:
        model.train(was_training)
    return out


def perplexity(mean_loss: float) -> float:
    """``exp(loss)``: perplexity per token from a mean loss in nats per token."""
    return math.exp(mean_loss)


def bits_per_token(mean_loss: float) -> float:
    """``loss / ln 2``: bits per token; for a character tokenizer, bits per character."""
    return mean_loss / math.log(2)


def bits_per_byte(mean_loss: float, n_tokens: int, n_bytes: int) -> float:
    """Bits per UTF-8 byte of a text of ``n_bytes`` bytes that tokenizes to ``n_tokens`` tokens.

    ``loss · n_tokens / (n_bytes · ln 2)``: comparable across tokenizers.

    Raises:
        ValueError: ``n_tokens`` or ``n_bytes`` not positive.
    """
    if n_tokens <= 0 or n_bytes <= 0:
        raise ValueError(f"n_tokens={n_tokens} and n_bytes={n_bytes} must be > 0")
    return mean_loss * n_tokens / (n_bytes * math.log(2))
