"""Next-token selection for ``CausalLM.generate`` (docs/architecture.md §5): logits → one id per row.

The steps, in the order Hugging Face's ``generate`` applies them::

    logits (B, V), float32
    → vocab_limit        ids ≥ V' get −∞ (a vocabulary padded past its tokenizer's)
    → repetition_penalty ids already in the row: l/p if l > 0 else l·p      (p > 0; 1 = off)
    → greedy (temperature 0): argmax; else
    → temperature        (l − max l)/T in float64: the maximum is 0 before dividing, so any T > 0,
                         however small, gives a defined softmax (T → 0 is greedy)
    → top_k              keep the k largest
    → top_p              keep the smallest set of most likely ids whose mass reaches p
    → min_p              keep ids whose probability is ≥ min_p × the largest probability
    → multinomial        with the caller's ``torch.Generator`` (same seed, same ids)

Every filter keeps the most likely id, so the kept set is never empty.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from energyformer._validate import check_float, check_int

__all__ = ["check_sampling", "apply_repetition_penalty", "filter_logits", "select_next"]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, min_p: float | None,
                   repetition_penalty: float | None) -> None:
    """Validate the sampling options.

    Raises:
        ValueError: ``temperature < 0`` or not finite, ``top_k < 1``, ``top_p`` outside (0, 1],
            ``min_p`` outside [0, 1], ``repetition_penalty <= 0``; each message names the value.
    """
    check_float("temperature", temperature, 0.0)
    if top_k is not None:
        check_int("top_k", top_k, 1)
    if top_p is not None:
        check_float("top_p", top_p, 0.0, strict=True, maximum=1.0)
    if min_p is not None:
        check_float("min_p", min_p, 0.0, maximum=1.0)
    if repetition_penalty is not None:
        check_float("repetition_penalty", repetition_penalty, 0.0, strict=True)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty: for every id in ``seen`` (B, S) of its row, a logit ``l`` becomes
    ``l / penalty`` if ``l > 0`` else ``l · penalty`` (clamped to the finite range). ``logits``
    (B, V) → (B, V) (a new tensor)."""
    picked = logits.gather(1, seen)
    fin = torch.finfo(logits.dtype)
    new = torch.where(picked > 0, picked / penalty, picked * penalty).clamp(fin.min, fin.max)  # a huge penalty
    return logits.scatter(1, seen, torch.where(torch.isfinite(picked), new, picked))           # stays finite


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> torch.Tensor:
    """Temperature-scaled logits (B, V) with the ids outside top-k / top-p / min-p at −∞ (``temperature > 0``).

    Finite wherever kept: the row maximum is subtracted before dividing by ``temperature``.
    """
    # in float64 so that no positive temperature (down to 5e-324) rounds to 0: 0/T = 0, (<0)/T < 0 or −∞
    # (MPS has no float64: there T is floored at float32's smallest normal number, still a defined result)
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    if shifted.device.type == "mps":
        logits = shifted / max(temperature, torch.finfo(torch.float32).tiny)
    else:
        logits = (shifted.double() / temperature).to(logits.dtype)
    neg_inf = float("-inf")
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the more likely ids
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), neg_inf)
    if min_p is not None and min_p > 0.0:
        probs = F.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, neg_inf)
    return logits


def select_next(logits: torch.Tensor, seen: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, min_p: float | None = None, repetition_penalty: float | None = None,
                vocab_limit: int | None = None, generator: torch.Generator | None = None,
                check_finite: bool = True) -> torch.Tensor:
    """Next ids ``(B, 1)`` from the last position's ``logits`` ``(B, V)`` (see the module docstring).

    ``seen`` ``(B, S)``: the ids of each row so far (for the repetition penalty).
    ``check_finite=False`` skips the non-finite check (a host read); the caller checks then.

    Raises:
        ValueError: non-finite logits among the allowed ids (diverged weights).
    """
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.size(-1):
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    if check_finite and not torch.isfinite(logits[:, : vocab_limit or logits.size(-1)]).all():
        raise ValueError("the model produced non-finite logits (NaN/Inf): its weights have diverged")
    if repetition_penalty is not None and repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p, min_p), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
