"""Floors to print beside a model's numbers: count-model losses of a corpus and chance accuracies.

A trained language model that does not beat the **bigram count model** of its own training
split has learned nothing a table of pair counts would not. Both count models are fitted on
the training split and scored on the validation split (nats per token):

* **unigram**, add-one (Laplace) smoothing over the whole vocabulary::

      p(b) = (c(b) + 1) / (N + V)

  Every id gets a finite loss, and with ``N ≫ V`` (a corpus of millions of tokens) the
  smoothing moves the loss by a negligible amount, so the floor is essentially the corpus's
  empirical unigram entropy.
* **bigram**, Witten–Bell interpolation with that unigram::

      p(b | a) = (c(a, b) + T(a) · p(b)) / (c(a) + T(a))

  ``c(a)`` counts the pairs starting with ``a``, ``T(a)`` the distinct tokens seen after ``a``;
  a context never seen in training (``c(a) = 0``) falls back to ``p(b)``. Witten–Bell is chosen
  because it has no free parameter (nothing is tuned on the validation split, which would make
  the floor optimistic), it gives every unseen pair a finite loss, and it backs off more where
  a context is followed by many different tokens (where unseen pairs are likely), which add-k
  smoothing of the ``V²`` table does not (on a BPE vocabulary of thousands, add-one gives most
  of each row's mass to pairs never seen).

The unigram loss averages over every validation token; the bigram loss over the ``n_val − 1``
transitions (the first validation token has no predecessor). Counts use int64 pair keys
``a · V + b`` and a sorted lookup, so a BPE-50k corpus needs no ``V × V`` table.

:func:`dataset_floors` computes both for a prepared directory and caches them as
``floors.json`` beside the data, keyed by the splits' sizes and sha256 (when ``meta.json`` has
them), so a re-prepared corpus is recomputed. :func:`multiple_choice_chance` is the accuracy of
a uniform guess.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from energyformer.data import load_meta, load_split
from energyformer.utils.io import atomic_write_json

__all__ = ["FLOORS_FILE", "count_model_losses", "dataset_floors", "multiple_choice_chance"]

FLOORS_FILE = "floors.json"
FLOORS_VERSION = 1
MAX_TOKENS = 100_000_000


def _as_ids(ids: Sequence[int] | np.ndarray, name: str, vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids).astype(np.int64, copy=False).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{name} is empty; a count model needs at least one token")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary 0..{vocab_size - 1}")
    return arr


def _unigram_probs(train: np.ndarray, vocab_size: int) -> np.ndarray:
    """Add-one unigram ``p(b) = (c(b) + 1) / (N + V)``, shape (V,)."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    return (counts + 1.0) / (train.size + vocab_size)


def _bigram_log_probs(train: np.ndarray, val: np.ndarray, uni: np.ndarray) -> np.ndarray:
    """Witten–Bell ``log p(val[i] | val[i-1])`` for ``i = 1 … n − 1``, shape (n − 1,)."""
    v = uni.size
    keys, pair_counts = np.unique(train[:-1] * v + train[1:], return_counts=True)
    ctx_counts = np.bincount(train[:-1], minlength=v).astype(np.float64)  # c(a): pairs starting with a
    ctx_types = np.bincount(keys // v, minlength=v).astype(np.float64)    # T(a): distinct followers
    a, b = val[:-1], val[1:]
    query = a * v + b
    pos = np.minimum(np.searchsorted(keys, query), keys.size - 1)
    c_ab = np.where(keys[pos] == query, pair_counts[pos], 0).astype(np.float64)
    c_a, t_a, p_b = ctx_counts[a], ctx_types[a], uni[b]
    seen = c_a > 0
    prob = np.where(seen, (c_ab + t_a * p_b) / np.where(seen, c_a + t_a, 1.0), p_b)
    return np.log(prob)


def count_model_losses(train_ids: Sequence[int] | np.ndarray, val_ids: Sequence[int] | np.ndarray,
                       vocab_size: int) -> dict[str, float]:
    """Validation cross-entropy (nats/token) of count models fitted on ``train_ids``.

    Args:
        train_ids: the training split's token ids, shape (N,) (a ``np.memmap`` is fine).
        val_ids: the validation split's ids, shape (n,).
        vocab_size: ``V``; every id must be in ``0 … V − 1``.

    Returns:
        ``{"unigram": …, "bigram": …}``: the add-one unigram and the Witten–Bell bigram (module
        docstring). With fewer than 2 tokens in a split there is no pair, and the bigram loss
        is the unigram's.

    Raises:
        ValueError: an empty split, ``vocab_size < 1`` or an id outside the vocabulary.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r} is not valid; expected an integer >= 1")
    train = _as_ids(train_ids, "train_ids", vocab_size)
    val = _as_ids(val_ids, "val_ids", vocab_size)
    uni = _unigram_probs(train, vocab_size)
    unigram = float(-np.log(uni[val]).mean())
    if val.size < 2 or train.size < 2:
        return {"unigram": unigram, "bigram": unigram}
    bigram = float(-_bigram_log_probs(train, val, uni).mean())
    return {"unigram": unigram, "bigram": bigram}


def _identity(meta: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    keys = ("vocab_size", "n_train", "n_val", "train_sha256", "val_sha256")
    return {"version": FLOORS_VERSION, **{k: meta.get(k) for k in keys}, "max_tokens": max_tokens}


def dataset_floors(data_dir: str | Path, *, cache: bool = True, max_tokens: int | None = MAX_TOKENS) -> dict[str, Any]:
    """Count-model floors of a prepared dataset, cached as ``data_dir/floors.json``.

    Args:
        data_dir: a prepared dataset directory.
        cache: read and write ``floors.json``.
        max_tokens: fit on at most the first ``max_tokens`` training tokens and score at most the
            first ``max_tokens`` validation tokens (a corpus of billions of tokens does not fit
            the counting in memory; counts from fewer tokens give a slightly higher, so still
            valid, bigram floor); None uses everything.

    Returns:
        ``{"unigram", "bigram"}`` (nats/token on the validation split) plus ``"unigram_bpt"`` /
        ``"bigram_bpt"`` (bits per token), ``"smoothing"`` and the data identity the cache is
        keyed on (``vocab_size``, ``n_train``, ``n_val`` and the splits' sha256 when known).
        A ListOps directory also gets ``"listops": {"generator": the exact entropy floor,
        "generator_on_val": the generator's predictor scored on the validation chains}``
        (:mod:`energyformer.tasks.listops_floor`). A cached file whose identity differs from the
        current ``meta.json`` is recomputed.

    Raises:
        FileNotFoundError / ValueError: as :func:`energyformer.data.load_split` (missing or
            stale data), or an id outside the vocabulary.
    """
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    ident = _identity(meta, max_tokens)
    path = data_dir / FLOORS_FILE
    if cache and path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict) and saved.get("identity") == ident:
            return saved
    val = load_split(data_dir, "val")[:max_tokens]
    losses = count_model_losses(load_split(data_dir, "train")[:max_tokens], val, int(meta["vocab_size"]))
    out = {**losses, **{f"{k}_bpt": v / math.log(2) for k, v in losses.items()},
           "smoothing": {"unigram": "add-one (Laplace)", "bigram": "Witten-Bell interpolation with the unigram"},
           "identity": ident}
    if meta.get("dataset") == "listops" and isinstance(meta.get("settings"), dict):
        out["listops"] = _listops_floors(meta, val)
    if cache:
        try:
            atomic_write_json(path, out)
        except OSError:  # a read-only data directory still gets its floors, uncached
            pass
    return out


def _listops_floors(meta: dict[str, Any], val: np.ndarray) -> dict[str, Any]:
    """The generator's exact entropy floor and its predictor's loss on the validation chains."""
    from energyformer.data import load_tokenizer
    from energyformer.data.listops import ListOpsSettings
    from energyformer.tasks.listops_floor import generator_entropy, generator_loss_on

    s = ListOpsSettings(**meta["settings"])
    return {"generator": generator_entropy(s),
            "generator_on_val": generator_loss_on(load_tokenizer(meta).decode(np.asarray(val).tolist()), s)}


def multiple_choice_chance(n_choices: int) -> float:
    """Accuracy of a uniform guess among ``n_choices`` answers (``1 / n_choices``; MMLU: 0.25).

    Raises:
        ValueError: ``n_choices`` is not an integer >= 1.
    """
    if isinstance(n_choices, bool) or not isinstance(n_choices, int) or n_choices < 1:
        raise ValueError(f"n_choices={n_choices!r} is not valid; expected an integer >= 1")
    return 1.0 / n_choices
