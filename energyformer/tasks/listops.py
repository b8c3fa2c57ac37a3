"""ListOps accuracy: greedy exact match of the final answer on held-out expressions (docs/nrgpt.md §8).

A problem is its prompt (the expression and ``=``, e.g. ``S(3X(12)4)=``); the model continues it
greedily until the end token ``\\n`` (or a length limit); the answer is what follows the last
``=`` of the continuation. Accuracy is the share of exact matches, with its standard error
``sqrt(p (1 − p) / n)``, overall and per root function. Data: :mod:`energyformer.data.listops`.

Beside accuracy (:func:`listops_report`): the end-token rate (a model that never emits the end
token fails on format, not arithmetic), the teacher-forced loss on the tokens after the first
``=`` (:func:`chain_loss`; the generator's floor there is 0), per-function accuracy on
single-function test sets, chance accuracies and the generator's entropy floor
(:mod:`energyformer.tasks.listops_floor`).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from energyformer.data.listops import END, ListOpsSettings, single_function_tests
from energyformer.tasks.listops_floor import chance_accuracies, generator_entropy


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
        "end_token_rate": the share of continuations that emit the end token (a model that
        never does fails on format, not on arithmetic), "examples": the first 5 (prompt,
        continuation, answer)}``.

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
            "end_token_rate": sum(end_id in c for c in conts) / len(conts),
            "examples": [(p["prompt"], t, p["answer"]) for p, t in list(zip(problems, texts))[:5]]}


@torch.no_grad()
def chain_loss(model: torch.nn.Module, tokenizer: Any, problems: Sequence[dict[str, str]], batch_size: int = 256,
               device: str | torch.device = "cpu", **forward_kwargs: Any) -> dict[str, float]:
    """Teacher-forced loss on the predictable tokens: every chain token after the first ``=``.

    Those tokens (the reductions, the answer and the end token) are determined by the
    expression, so the generator's floor on them is 0 (:mod:`energyformer.tasks.listops_floor`);
    this loss says how far a model is from computing them, independently of greedy decoding.

    Returns:
        ``{"loss": mean nats per predicted token, "n_tokens"}``.

    Raises:
        ValueError: no problems, a chain without ``=``, or a chain longer than ``block_size``.
    """
    if not problems:
        raise ValueError("no ListOps problems to score")
    eq_id = tokenizer.encode("=")[0]
    block = model.config.block_size
    by_len: dict[int, list[list[int]]] = defaultdict(list)
    for p in problems:
        ids = tokenizer.encode(p["chain"])
        if eq_id not in ids or len(ids) > block:
            raise ValueError(f"chain {p['chain']!r} needs an '=' and at most block_size={block} tokens")
        by_len[len(ids)].append(ids)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for rows in by_len.values():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                idx = torch.tensor(chunk, dtype=torch.long, device=device)
                logits, _ = model(idx[:, :-1], **forward_kwargs)
                nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), idx[:, 1:], reduction="none")
                first_eq = torch.tensor([r.index(eq_id) for r in chunk], device=device)
                keep = torch.arange(idx.shape[1] - 1, device=device)[None, :] >= first_eq[:, None]
                total += float(nll[keep].sum())
                count += int(keep.sum())
    finally:
        model.train(was_training)
    return {"loss": total / count, "n_tokens": count}


def listops_report(model: torch.nn.Module, tokenizer: Any, problems: Sequence[dict[str, str]], *,
                   settings: ListOpsSettings | dict[str, Any] | None = None,
                   single_function: int | dict[str, Sequence[dict[str, str]]] | None = None,
                   batch_size: int = 256, device: str | torch.device = "cpu", **forward_kwargs: Any) -> dict[str, Any]:
    """Everything to print for a trained ListOps model, beside its floors.

    Args:
        model, tokenizer, problems, batch_size, device, forward_kwargs: as :func:`evaluate_listops`.
        settings: the dataset's :class:`~energyformer.data.listops.ListOpsSettings` (or the
            ``settings`` dict of its ``meta.json``) for the generator's entropy floor; None skips it.
        single_function: ``{function: problems}`` whose every operator is that function, or
            ``N`` to draw ``N`` per function with
            :func:`energyformer.data.listops.single_function_tests` (needs ``settings``); None
            skips them.

    Returns:
        :func:`evaluate_listops`'s dict (accuracy, stderr, n, per_function, end_token_rate,
        examples) plus ``"answer_loss"`` (:func:`chain_loss`), ``"chance"``
        (:func:`~energyformer.tasks.listops_floor.chance_accuracies` on ``problems``),
        ``"floor"`` (:func:`~energyformer.tasks.listops_floor.generator_entropy`, nats/token) and
        ``"single_function"``: ``{function: {"accuracy", "stderr", "n", "end_token_rate"}}``.

    Raises:
        ValueError: as :func:`evaluate_listops` and :func:`chain_loss`; ``single_function=N``
            without ``settings``.
    """
    s = settings if settings is None or isinstance(settings, ListOpsSettings) else ListOpsSettings(**settings)
    if isinstance(single_function, int) and not isinstance(single_function, bool):
        if s is None:
            raise ValueError("single_function=N draws the single-function sets from the dataset's settings; "
                             "pass settings too")
        single_function = single_function_tests(s, n=single_function)
    kw = dict(batch_size=batch_size, device=device, **forward_kwargs)
    report = evaluate_listops(model, tokenizer, problems, **kw)
    report["answer_loss"] = chain_loss(model, tokenizer, problems, **kw)
    report["chance"] = chance_accuracies(problems)
    if s is not None:
        report["floor"] = generator_entropy(s)
    if single_function is not None:
        report["single_function"] = {}
        for fn, probs in single_function.items():
            ev = evaluate_listops(model, tokenizer, probs, **kw)
            report["single_function"][fn] = {k: ev[k] for k in ("accuracy", "stderr", "n", "end_token_rate")}
    return report
