"""Floors for ListOps numbers: the generator's exact entropy and chance accuracies (docs/nrgpt.md §7).

**Entropy floor.** An example is a random tree drawn by
:func:`energyformer.data.listops.random_tree`, written as its chain of reductions. The
expression text and the tree determine each other, and everything after the expression (the
first ``=``, every reduction, the answer, the end token) is a function of the tree. So the
Bayes-optimal predictor of the generator pays, over one example, exactly ``−log p(tree)``
nats, all of it on the expression's tokens, and nothing on the tokens after the first ``=``.
In the training stream (chains concatenated, examples independent) the per-token floor is the
ratio of expectations::

    floor_all     = E[−log p(tree)] / E[len(chain)]          every token of the stream
    floor_problem = E[−log p(tree)] / E[len(expression) + 1]   the expression and its "="
    floor_after   = 0                                         tokens after the first "="

Both expectations are computed exactly by a recursion over the tree depth (no sampling). For a
function node at depth ``δ`` with ``k`` children (uniform in ``min_args … max_args``), each
child nested with probability ``q = func_node_prob`` while ``δ + 1 < max_depth``::

    H_node(δ)  = H(symbol) + H(k) + E[k] · H_child(δ)
    H_child(δ) = h(q) + q · H_node(δ + 1) + (1 − q) · log 10       (log 10 at the last depth)

``len(chain)`` needs the lengths of every reduced text: with ``M`` the function nodes of a
subtree, ``ℓ`` its text length and ``A`` the summed length of its texts from the first to its
value (reductions are post-order, so a subtree's are consecutive), a node whose children have
``(Mᵢ, ℓᵢ, Aᵢ)`` and ``aᵢ = Σ_{j<i} Mⱼ`` has::

    M = 1 + Σ Mᵢ,   ℓ = 3 + Σ ℓᵢ,   A = 3M + 1 + Σᵢ [aᵢ (ℓᵢ − 1) + Aᵢ + M − 1 − Mᵢ]

(a digit child is ``M = 0, ℓ = A = 1``), whose expectation factorizes over the independent
children; ``len(chain) = A + M + 1`` (``M`` signs ``=`` and the end token). This floor is of the
unfiltered generator: the training split drops the held-out expressions (a share ``h`` of all
draws), so a predictor that also knew the filter would pay ``−log(1 − h)`` nats less per
training example. It is also a full-context floor: a window that starts inside an example
cannot know the tokens before it. :func:`generator_loss_on` scores the generator's predictor
on actual chains (e.g. the validation split), for comparison.

**Chance accuracies** (:func:`chance_accuracies`): always answering the most common answer of
the given test problems, and the most common answer per root function (both read from the
problems themselves, so they bound any constant or root-function-only guess on that set).
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from energyformer.data.listops import END, FUNCTIONS, ListOpsSettings

__all__ = ["chance_accuracies", "example_log_prob", "generator_entropy", "generator_loss_on"]


def _entropy(probs: Iterable[float]) -> float:
    return -sum(p * math.log(p) for p in probs if p > 0)


def _symbol_probs(s: ListOpsSettings) -> dict[str, float]:
    counts = Counter(FUNCTIONS[f][0] for f in s.functions)
    return {sym: c / len(s.functions) for sym, c in counts.items()}


def _node_stats(s: ListOpsSettings) -> dict[str, float]:
    """Expectations for a root node: ``H`` (nats), ``len`` (expression), ``M`` (function nodes), ``A``."""
    ks = range(s.min_args, s.max_args + 1)
    e_k = sum(ks) / len(ks)
    e_kk = sum(k * (k - 1) for k in ks) / len(ks)  # E[k(k − 1)]
    h_fixed = _entropy(_symbol_probs(s).values()) + math.log(len(ks))
    node: dict[str, float] | None = None  # the node one level deeper
    for depth in range(s.max_depth - 1, -1, -1):
        q = s.func_node_prob if depth + 1 < s.max_depth else 0.0
        child = {"H": math.log(10), "len": 1.0, "M": 0.0, "A": 1.0}
        if q > 0:
            assert node is not None
            child = {"H": _entropy((q, 1 - q)) + q * node["H"] + (1 - q) * math.log(10),
                     "len": q * node["len"] + (1 - q), "M": q * node["M"], "A": q * node["A"] + (1 - q)}
        e_m = 1 + e_k * child["M"]
        node = {"H": h_fixed + e_k * child["H"], "len": 3 + e_k * child["len"], "M": e_m,
                "A": (3 * e_m + 1 + e_kk / 2 * child["M"] * (child["len"] - 1) + e_k * child["A"]
                      + e_kk * child["M"])}
    assert node is not None
    return node


def generator_entropy(s: ListOpsSettings | None = None) -> dict[str, float]:
    """The exact entropy floor of the ListOps generator with settings ``s`` (default: the released data's).

    Returns:
        ``{"example_nats"``: E[−log p(tree)] per example, ``"expected_chain_tokens"``,
        ``"expected_problem_tokens"`` (expression and ``=``), ``"expected_function_nodes"``,
        ``"all_tokens"``: the per-token floor over the whole stream (nats),
        ``"problem_tokens"``: the floor on the expression tokens,
        ``"after_first_eq"``: 0.0 (the rest of a chain is determined by its expression)``}``.
    """
    s = s if s is not None else ListOpsSettings()
    st = _node_stats(s)
    chain_len = st["A"] + st["M"] + 1
    return {"example_nats": st["H"], "expected_chain_tokens": chain_len,
            "expected_problem_tokens": st["len"] + 1, "expected_function_nodes": st["M"],
            "all_tokens": st["H"] / chain_len, "problem_tokens": st["H"] / (st["len"] + 1),
            "after_first_eq": 0.0}


def _parse(text: str, pos: int, s: ListOpsSettings, depth: int, probs: dict[str, float]) -> tuple[float, int]:
    """``(log p, next position)`` of the function node starting at ``text[pos]`` at ``depth``."""
    sym = text[pos:pos + 1]
    if sym not in probs or text[pos + 1:pos + 2] != "(":
        raise ValueError(f"expected a function symbol ({', '.join(sorted(probs))}) and '(' at position {pos} "
                         f"of {text!r}")
    logp, pos, k = math.log(probs[sym]), pos + 2, 0
    q = s.func_node_prob if depth + 1 < s.max_depth else 0.0
    while pos < len(text) and text[pos] != ")":
        if text[pos].isdigit():
            if q >= 1:
                raise ValueError(f"{text!r} has a digit argument at depth {depth}, which func_node_prob=1 "
                                 "never draws")
            logp += (math.log(1 - q) if q > 0 else 0.0) - math.log(10)
            pos += 1
        else:
            if q == 0:
                raise ValueError(f"{text!r} nests deeper than max_depth={s.max_depth}")
            sub, pos = _parse(text, pos, s, depth + 1, probs)
            logp += math.log(q) + sub
        k += 1
    if pos >= len(text) or not s.min_args <= k <= s.max_args:
        raise ValueError(f"{text!r} is not an expression of these settings ({k} arguments at depth {depth}; "
                         f"expected {s.min_args}…{s.max_args} and a closing ')')")
    return logp - math.log(s.max_args - s.min_args + 1), pos + 1


def example_log_prob(expression: str, s: ListOpsSettings | None = None) -> float:
    """``log p`` of one expression (``"S(3X(12)4)"``, or a whole chain: only the text before ``=`` counts).

    Raises:
        ValueError: the text is not an expression the generator with ``s`` can draw.
    """
    s = s if s is not None else ListOpsSettings()
    text = expression.split("=", 1)[0]
    logp, end = _parse(text, 0, s, 0, _symbol_probs(s))
    if end != len(text):
        raise ValueError(f"{expression!r} has text after its expression ({text[end:]!r})")
    return logp


def generator_loss_on(chains: Sequence[str] | str, s: ListOpsSettings | None = None) -> dict[str, float]:
    """The generator's Bayes predictor scored on actual chains (nats/token).

    Args:
        chains: chains (each ending with the end token), or their concatenation (e.g. the
            decoded validation split).
        s: the generator settings the chains came from.

    Returns:
        ``{"all_tokens", "problem_tokens", "after_first_eq": 0.0, "n_examples", "n_tokens"}``.

    Raises:
        ValueError: no complete chain, or a chain the settings cannot draw.
    """
    if isinstance(chains, str):
        chains = [c + END for c in chains.split(END)[:-1]]
    if not chains:
        raise ValueError("no complete ListOps chain (ending with the end token) to score")
    nats = -sum(example_log_prob(c, s) for c in chains)
    n_tokens = sum(len(c) for c in chains)
    n_problem = sum(len(c.split("=", 1)[0]) + 1 for c in chains)
    return {"all_tokens": nats / n_tokens, "problem_tokens": nats / n_problem, "after_first_eq": 0.0,
            "n_examples": len(chains), "n_tokens": n_tokens}


def chance_accuracies(problems: Sequence[dict[str, str]]) -> dict[str, Any]:
    """Accuracies of constant guesses on ``problems`` (dicts with ``answer`` and ``function``).

    Returns:
        ``{"majority": {"answer", "accuracy"}, "majority_per_function": {"accuracy",
        "per_function": {symbol: {"answer", "accuracy", "n"}}}, "n"}``: the most common answer
        of all problems, and the most common answer among the problems of each root function
        (ties go to the smallest answer).

    Raises:
        ValueError: no problems.
    """
    if not problems:
        raise ValueError("no ListOps problems to score chance accuracies on")

    def majority(answers: list[str]) -> tuple[str, int]:
        counts = Counter(answers)
        best = max(sorted(counts), key=lambda a: counts[a])
        return best, counts[best]

    n = len(problems)
    answer, hits = majority([p["answer"] for p in problems])
    by_fn: dict[str, list[str]] = defaultdict(list)
    for p in problems:
        by_fn[p["function"]].append(p["answer"])
    per_fn = {}
    for fn, answers in sorted(by_fn.items()):
        a, h = majority(answers)
        per_fn[fn] = {"answer": a, "accuracy": h / len(answers), "n": len(answers)}
    total = sum(v["accuracy"] * v["n"] for v in per_fn.values()) / n
    return {"majority": {"answer": answer, "accuracy": hits / n},
            "majority_per_function": {"accuracy": total, "per_function": per_fn}, "n": n}
