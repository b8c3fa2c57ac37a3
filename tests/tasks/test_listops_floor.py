"""The ListOps floors beside the experiments' numbers (energyformer.tasks.listops_floor): the
generator's exact entropy, chance accuracies, and the ListOps report's extra metrics
(energyformer.tasks.listops); the count-model floors are tested in tests/eval."""
import itertools
import json
import math
import random

import pytest
import torch

from energyformer import build_model
from energyformer.data import load_tokenizer
from energyformer.data.listops import (
    FUNCTIONS,
    ListOpsSettings,
    chain,
    random_tree,
    read_test,
    single_function_tests,
    to_text,
)
from energyformer.data.task_data import prepare_task_data
from energyformer.tasks.listops import chain_loss, evaluate_listops, listops_report
from energyformer.tasks.listops_floor import chance_accuracies, example_log_prob, generator_entropy, generator_loss_on

# ---------------------------------------------------------------------------------------------
# the ListOps generator's entropy floor, against exact enumeration
# ---------------------------------------------------------------------------------------------

def _trees(s, depth=0, digits=range(10)):
    """Every (tree, probability) the generator can draw at ``depth`` (``digits=[0]``: shapes only)."""
    symbols = [FUNCTIONS[f][0] for f in s.functions]
    q = s.func_node_prob if depth + 1 < s.max_depth else 0.0
    children = [(d, (1 - q) / len(digits)) for d in digits]
    if q > 0:
        children += [(t, q * p) for t, p in _trees(s, depth + 1, digits)]
    n_k = s.max_args - s.min_args + 1
    for sym in symbols:
        for k in range(s.min_args, s.max_args + 1):
            for combo in itertools.product(children, repeat=k):
                p = math.prod(c[1] for c in combo) / len(symbols) / n_k
                yield [sym, *(c[0] for c in combo)], p


@pytest.mark.parametrize("s", [ListOpsSettings(functions=("max",), min_args=1, max_args=2, func_node_prob=0.3),
                               ListOpsSettings(functions=("max", "median"), max_depth=1)])
def test_generator_entropy_exact(s):
    trees = list(_trees(s))
    assert sum(p for _, p in trees) == pytest.approx(1.0)
    floor = generator_entropy(s)
    entropy = -sum(p * math.log(p) for _, p in trees)
    chain_len = sum(p * len(chain(t)) for t, p in trees)
    assert floor["example_nats"] == pytest.approx(entropy, rel=1e-10)
    assert floor["expected_chain_tokens"] == pytest.approx(chain_len, rel=1e-10)
    assert floor["expected_problem_tokens"] == pytest.approx(sum(p * (len(to_text(t)) + 1) for t, p in trees))
    assert floor["all_tokens"] == pytest.approx(entropy / chain_len, rel=1e-10)
    assert floor["after_first_eq"] == 0.0
    for t, p in trees[:: max(1, len(trees) // 300)]:  # the parser gives each tree its probability
        assert example_log_prob(chain(t), s) == pytest.approx(math.log(p), rel=1e-10)


def test_chain_length_exact_at_depth_3():
    """Lengths depend on the shape only: enumerate shapes (digit 0 with probability 1 - q)."""
    s = ListOpsSettings(functions=("sum_mod_10",), max_depth=3, min_args=1, max_args=2, func_node_prob=0.4)
    shapes = list(_trees(s, digits=[0]))
    assert sum(p for _, p in shapes) == pytest.approx(1.0)
    assert generator_entropy(s)["expected_chain_tokens"] == pytest.approx(
        sum(p * len(chain(t)) for t, p in shapes), rel=1e-10)


def test_generator_floor_default_settings_and_stream():
    s = ListOpsSettings()
    floor = generator_entropy(s)
    assert 0 < floor["all_tokens"] < floor["problem_tokens"] < math.log(17)
    rng = random.Random(3)
    chains = [chain(random_tree(rng, s)) for _ in range(20_000)]
    sampled = generator_loss_on("".join(chains), s)  # the decoded stream form
    assert sampled["n_examples"] == 20_000
    assert sampled["all_tokens"] == pytest.approx(floor["all_tokens"], rel=0.01)
    assert sampled["problem_tokens"] == pytest.approx(floor["problem_tokens"], rel=0.01)
    with pytest.raises(ValueError, match="not an expression"):
        example_log_prob("S(1234)=", s)  # four arguments
    for bad in ("Q(12)", "", "S(12"):
        with pytest.raises(ValueError, match="function symbol|not an expression"):
            example_log_prob(bad, s)


def test_chance_accuracies_hand_example():
    problems = [{"answer": a, "function": f} for a, f in
                [("9", "max"), ("9", "max"), ("3", "max"), ("1", "sum_mod_10"), ("1", "sum_mod_10"), ("9", "median")]]
    res = chance_accuracies(problems)
    assert res["majority"] == {"answer": "9", "accuracy": 0.5}
    per = res["majority_per_function"]
    assert per["per_function"]["max"] == {"answer": "9", "accuracy": 2 / 3, "n": 3}
    assert per["accuracy"] == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="no ListOps problems"):
        chance_accuracies([])


# ---------------------------------------------------------------------------------------------
# the ListOps report
# ---------------------------------------------------------------------------------------------

class _ChainModel(torch.nn.Module):
    """Puts logit 0 on the true next character of a known chain, −1e9 elsewhere; ``no_end``
    replaces the end token by '=' (a model that never stops)."""

    def __init__(self, tok, problems, no_end=False, uniform=False):
        super().__init__()
        self.tok, self.config = tok, type("C", (), {"block_size": 128})()
        self.chains = {tuple(tok.encode(p["prompt"])): tok.encode(p["chain"]) for p in problems}
        self.no_end, self.uniform = no_end, uniform
        self.end, self.eq = tok.encode("\n")[0], tok.encode("=")[0]

    def forward(self, idx):
        fill = 0.0 if self.uniform else -1e9
        logits = torch.full((idx.shape[0], idx.shape[1], self.tok.vocab_size), fill)
        for b, row in enumerate(idx.tolist()):
            ids = self.chains[tuple(row[:row.index(self.eq) + 1])]
            for n in range(len(row)):
                nxt = ids[n + 1] if n + 1 < len(ids) else self.eq
                logits[b, n, self.eq if (self.no_end and nxt == self.end) else nxt] = 0.0
        return logits, None


def test_listops_report(tmp_path):
    out = prepare_task_data("listops", out_root=tmp_path, n_train=300, n_val=30, n_test=40)
    tok, problems = load_tokenizer(out), read_test(out)[:10]
    meta = json.loads((out / "meta.json").read_text())
    single = {k: v[:4] for k, v in single_function_tests(ListOpsSettings(**meta["settings"]), n=4).items()}
    everything = problems + [p for v in single.values() for p in v]
    rep = listops_report(_ChainModel(tok, everything), tok, problems, settings=meta["settings"],
                         single_function=single)
    drawn = listops_report(_ChainModel(tok, everything), tok, problems, settings=meta["settings"],
                           single_function=4)  # N per function, drawn from the settings: the same sets
    assert drawn["single_function"] == rep["single_function"]
    with pytest.raises(ValueError, match="pass settings"):
        listops_report(_ChainModel(tok, problems), tok, problems, single_function=4)
    assert rep["accuracy"] == 1.0 and rep["end_token_rate"] == 1.0
    assert rep["answer_loss"]["loss"] == pytest.approx(0.0, abs=1e-6)
    assert rep["answer_loss"]["n_tokens"] == sum(len(p["chain"]) - len(p["prompt"]) for p in problems)
    assert rep["chance"] == chance_accuracies(problems)
    assert rep["floor"] == generator_entropy(ListOpsSettings(**meta["settings"]))
    assert set(rep["single_function"]) == set(single)
    assert all(v["accuracy"] == 1.0 and v["n"] == 4 for v in rep["single_function"].values())
    # a model that never emits the end token: end-token rate 0 (the answer parser then fails)
    stuck = evaluate_listops(_ChainModel(tok, problems, no_end=True), tok, problems)
    assert stuck["end_token_rate"] == 0.0
    # uniform logits: exactly log V on every predictable token
    uniform = chain_loss(_ChainModel(tok, problems, uniform=True), tok, problems)
    assert uniform["loss"] == pytest.approx(math.log(tok.vocab_size), rel=1e-6)
    # a real (untrained) model goes through the same path, with forward options
    model = build_model({"arch": "nrgpt", "vocab_size": tok.vocab_size, "d_model": 8, "n_heads": 1, "n_steps": 2,
                         "block_size": 128})
    real = listops_report(model, tok, problems[:3], n_steps=1)
    assert math.isfinite(real["answer_loss"]["loss"]) and 0.0 <= real["end_token_rate"] <= 1.0
