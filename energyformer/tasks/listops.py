"""ListOps accuracy: greedy exact match of the final answer on held-out expressions (docs/nrgpt.md §8).

A problem is its prompt (the expression and ``=``, e.g. ``S(3X(12)4)=``); the model continues it
greedily until the end token ``\\n`` (or a length limit); the answer is what follows the last
``=`` of the continuation. Accuracy is the share of exact matches, with its standard error
``sqrt(p (1 − p) / n)``, overall and per root function. Data: :mod:`energyformer.data.listops`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

import torch

from energyformer.data.listops import END


def parse_answer(continuation: str) -> str:
    """The final answer in a generated continuation: the text after the last ``=`` up to the end token.

    ``"S(324)=9\\nX(…"`` → ``"9"``; a continuation without ``=`` is its own answer (``"9\\n"`` → ``"9"``).
    """
    text = continuation.split(END, 1)[0]
    return text.rsplit("=", 1)[-1].strip()


def accuracy_with_stderr(correct: Sequence[bool]) -> dict[str, float]:
    """``{"accuracy", "stderr", "n"}`` of a list of outcomes (binomial standard error).

    Raises:
        ValueError: ``correct`` is empty.
    """
    n = len(correct)
    if n == 0:
        raise ValueError("no outcomes to score; give at least one test problem")
    p = sum(bool(c) for c in correct) / n
    return {"accuracy": p, "stderr": math.sqrt(p * (1 - p) / n), "n": n}


@torch.no_grad()
def greedy_continuations(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         end_id: int, batch_size: int = 256, device: str | torch.device = "cpu",
                         **forward_kwargs: Any) -> list[list[int]]:
    """Greedy continuations (token ids, up to and including ``end_id``) of each prompt.

    Prompts of equal length are decoded together (no padding, so learned positions stay exact);
    a batch stops once every row has produced ``end_id``. The context is cropped to the model's
    ``block_size``. ``forward_kwargs`` go to the model (e.g. ``n_steps``).
    """
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    block = model.config.block_size
    was_training = model.training
    model.eval()
    try:
        for length, rows in sorted(by_len.items()):
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                idx = torch.tensor([list(prompts[i]) for i in chunk], dtype=torch.long, device=device)
                done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
                for _ in range(max_new_tokens):
                    logits, _ = model(idx[:, -block:], **forward_kwargs)
                    nxt = logits[:, -1].argmax(-1)
                    idx = torch.cat([idx, nxt[:, None]], dim=1)
                    done |= nxt == end_id
                    if bool(done.all()):
                        break
                for row, i in zip(idx[:, length:].tolist(), chunk):
                    out[i] = row[: row.index(end_id) + 1] if end_id in row else row
    finally:
        model.train(was_training)
    return out


def evaluate_listops(model: torch.nn.Module, tokenizer: Any, problems: Sequence[dict[str, str]],
                     batch_size: int = 256, device: str | torch.device = "cpu",
                     **forward_kwargs: Any) -> dict[str, Any]:
    """Exact-match accuracy of the greedy final answer on ``problems`` (``test.jsonl`` rows).

    Args:
        model: a language model ``model(idx) -> (logits, _)``.
        tokenizer: the dataset's char tokenizer (``load_tokenizer(meta)``).
        problems: dicts with ``prompt``, ``answer``, ``function`` and ``chain``.
        batch_size, device, forward_kwargs: see :func:`greedy_continuations`.

    Returns:
        ``{"accuracy", "stderr", "n", "per_function": {name: {"accuracy", "stderr", "n"}},
        "examples": the first 5 (prompt, continuation, answer)}``.

    Raises:
        ValueError: no problems, or a prompt with a character outside the tokenizer's vocabulary.
    """
    if not problems:
        raise ValueError("no ListOps problems to evaluate")
    prompts = [tokenizer.encode(p["prompt"]) for p in problems]
    longest = max(len(p["chain"]) - len(p["prompt"]) for p in problems)
    end_id = tokenizer.encode(END)[0]
    conts = greedy_continuations(model, prompts, longest + 4, end_id, batch_size, device, **forward_kwargs)
    texts = [tokenizer.decode(c) for c in conts]
    correct = [parse_answer(t) == p["answer"] for t, p in zip(texts, problems)]
    per_fn: dict[str, list[bool]] = defaultdict(list)
    for ok, p in zip(correct, problems):
        per_fn[p["function"]].append(ok)
    return {**accuracy_with_stderr(correct),
            "per_function": {f: accuracy_with_stderr(v) for f, v in sorted(per_fn.items())},
            "examples": [(p["prompt"], t, p["answer"]) for p, t in list(zip(problems, texts))[:5]]}
