"""Sampling in ``generate`` (energyformer/models/sampling.py, docs/architecture.md §5): every accepted
argument gives a defined result (T → 0 is greedy, tiny T never NaN), the filters keep what they
promise, stops, prompts of different lengths, and a seed that reproduces the ids."""
import math

import pytest
import torch

from energyformer import build_model
from energyformer.models.sampling import apply_repetition_penalty, filter_logits, select_next

V = 23


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model({"arch": "llama", "vocab_size": V, "block_size": 32, "d_model": 16, "n_layers": 2,
                     "n_heads": 2, "d_ff": 24})
    with torch.no_grad():  # logits far from uniform, so greedy and sampling differ
        m.lm_head.weight.mul_(40)
    return m.eval()


def _prompt(n=4, b=3, seed=0):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("temperature", [1e-3, 1e-40, 1e-300, 5e-324])
def test_tiny_temperatures_are_greedy_and_never_nan(model, temperature):
    idx = _prompt()
    greedy = model.generate(idx, 12, temperature=0.0)
    out = model.generate(idx, 12, temperature=temperature, top_p=0.9, min_p=0.01, generator=_gen(0))
    assert torch.equal(out, greedy)


def test_tiny_temperature_logits_give_a_one_hot_distribution():
    logits = torch.tensor([[1.0, 3.0, 2.9999, -5.0], [0.0, 0.0, 1e-7, float("-inf")]])
    probs = torch.softmax(filter_logits(logits, 1e-40), dim=-1)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]))


def test_huge_temperature_is_uniform_over_the_allowed_ids():
    logits = torch.tensor([[1.0, 30.0, -20.0, float("-inf")]])
    probs = torch.softmax(filter_logits(logits, 1e300), dim=-1)
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))


def test_top_k_top_p_min_p_keep_what_they_promise():
    logits = torch.tensor([[math.log(p) for p in (0.5, 0.25, 0.15, 0.1)]])
    kept = lambda **kw: torch.isfinite(filter_logits(logits, 1.0, **kw))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False]
    assert kept(top_p=0.4) == [True, False, False, False]       # 0.5 already reaches 0.4
    assert kept(top_p=0.6) == [True, True, False, False]
    assert kept(top_p=0.8) == [True, True, True, False]        # 0.75 < 0.8 ≤ 0.9
    assert kept(top_p=1e-30) == [True, False, False, False]    # the most likely id is always kept
    assert kept(top_p=1.0) == [True] * 4
    assert kept(min_p=0.3) == [True, True, True, False]        # 0.15 ≥ 0.3·0.5, 0.1 < 0.15
    assert kept(min_p=1.0) == [True, False, False, False]
    assert kept(min_p=0.0) == [True] * 4
    # the kept probabilities are renormalised, in the original order
    probs = torch.softmax(filter_logits(logits, 1.0, top_p=0.6), dim=-1)
    torch.testing.assert_close(probs, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_filters_in_a_batch_act_per_row():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]])
    kept = torch.isfinite(filter_logits(logits, 1.0, top_p=0.5))
    assert kept[0].sum() == 2 and kept[1].tolist() == [True, False, False, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 1]]), 2.0)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    huge = apply_repetition_penalty(torch.tensor([[2.0, -10.0, float("-inf")]]), torch.tensor([[1, 2]]), 1e38)
    assert huge[0, 1] == torch.finfo(torch.float32).min and huge[0, 2] == float("-inf")  # clamped; masked stays
    nxt = select_next(torch.tensor([[5.0, 4.0, -1.0]]), torch.tensor([[0]]), temperature=0.0, repetition_penalty=2.0)
    assert nxt.tolist() == [[1]]  # 5/2 < 4: the seen id loses its lead


def test_repetition_penalty_in_generate_changes_greedy_text(model):
    idx = _prompt(b=1)
    plain = model.generate(idx, 20, temperature=0.0)
    penalised = model.generate(idx, 20, temperature=0.0, repetition_penalty=1e6)
    repeats = lambda row: len(row) - len(set(row))  # noqa: E731
    assert repeats(penalised[0].tolist()) < repeats(plain[0].tolist())


def test_seed_makes_sampling_reproducible(model):
    idx = _prompt()
    kw = dict(temperature=1.0, top_k=10, top_p=0.95, min_p=0.01, repetition_penalty=1.2)
    a = model.generate(idx, 15, generator=_gen(3), **kw)
    b = model.generate(idx, 15, generator=_gen(3), **kw)
    c = model.generate(idx, 15, generator=_gen(4), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_stop_ids_and_stop_callable(model):
    idx = _prompt()
    free = model.generate(idx, 10, temperature=0.0)
    stop_id = int(free[0, 6])  # the third generated token of row 0
    rows = model.generate([r for r in idx], 10, temperature=0.0, stop_ids=[stop_id])
    for row, full in zip(rows, free):
        gen = full[4:].tolist()
        end = gen.index(stop_id) + 1 if stop_id in gen else len(gen)
        assert row.tolist() == full[: 4 + end].tolist()  # cut right after its stop id
    # a tensor keeps its shape: a stopped row repeats its stop token
    out = model.generate(idx, 10, temperature=0.0, stop_ids=[stop_id])
    n0 = out.shape[1]
    assert all(int(r[n0 - 1]) == stop_id or stop_id not in r[4:].tolist() for r in out)
    # stop(generated) -> bool, e.g. a stop string: here "after 3 tokens"
    rows = model.generate([idx[0].tolist()], 10, temperature=0.0, stop=lambda ids: len(ids) >= 3)
    assert rows[0].tolist() == free[0, :7].tolist()


def test_prompts_of_different_lengths_each_as_if_alone(model):
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11, 12]]
    out = model.generate(prompts, 8, temperature=0.0)
    assert [len(r) for r in out] == [len(p) + 8 for p in prompts]
    for p, r in zip(prompts, out):
        alone = model.generate(torch.tensor([p]), 8, temperature=0.0)[0]
        assert r.tolist() == alone.tolist()
    s1 = model.generate(prompts, 8, temperature=1.0, generator=_gen(1))
    s2 = model.generate(prompts, 8, temperature=1.0, generator=_gen(1))
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))


@pytest.mark.parametrize("kw,match", [
    (dict(top_p=0.0), "top_p=0.0 must be > 0.0"), (dict(top_p=1.5), "top_p=1.5 must be <= 1.0"),
    (dict(min_p=-0.1), "min_p=-0.1 must be >= 0.0"), (dict(min_p=2.0), "min_p=2.0 must be <= 1.0"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be > 0.0"),
    (dict(top_k=0), "top_k=0 must be >= 1"), (dict(temperature=float("inf")), "temperature=inf must be a finite"),
    (dict(temperature=float("nan")), "temperature=nan must be a finite"), (dict(stop_ids=[-1]), "stop_ids entry=-1"),
])
def test_invalid_sampling_arguments_are_clear_errors(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.generate(_prompt(), 2, **kw)


def test_bad_prompt_lists_are_clear_errors(model):
    with pytest.raises(ValueError, match="non-empty list of prompts"):
        model.generate([], 2)
    with pytest.raises(ValueError, match="sequence length 0"):
        model.generate([[1, 2], []], 2)
    with pytest.raises(ValueError, match="prompt 0 must be a 1-D"):
        model.generate([[[1, 2]]], 2)
    with pytest.raises(ValueError, match=f"token id {V}"):
        model.generate([[1], [V]], 2)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1e-30, top_k=1), dict(top_k=V + 10),
                                dict(top_p=1e-9), dict(min_p=1.0), dict(repetition_penalty=1e-30),
                                dict(repetition_penalty=1e30, temperature=1e-20)])
def test_every_accepted_extreme_gives_valid_ids(model, kw):
    out = model.generate(_prompt(), 6, generator=_gen(0), **kw)
    assert out.shape == (3, 10) and 0 <= int(out.min()) and int(out.max()) < V


# ------------------------------------------------------------------------------------------ the `sample` command
SEP = "\n---------------\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny trained char-level GPT run (hand-written data, 30 steps)."""
    import yaml
    from helpers import make_data_dir

    from energyformer.cli import main

    root = tmp_path_factory.mktemp("sample")
    make_data_dir(root / "data" / "tiny", n_words=1500)
    cfg = {"model": {"arch": "gpt", "d_model": 32, "n_layers": 1, "n_heads": 2, "block_size": 16},
           "data": {"root": str(root / "data"), "dataset": "tiny"},
           "train": {"out_dir": str(root / "run"), "max_steps": 30, "batch_size": 8, "eval_interval": 30,
                     "eval_iters": 1, "log_interval": 10, "warmup_steps": 2, "learning_rate": 3e-3, "device": "cpu"}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(root / "tiny.yaml")]) == 0
    return root / "run"


def _sample(run_dir, capsys, *args):
    from energyformer.cli import main

    code = main(["sample", str(run_dir), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_sample_new_options_and_use_cache(run_dir, capsys):
    common = ["--max-new-tokens", "30", "--seed", "5", "--top-p", "0.9", "--min-p", "0.05",
              "--repetition-penalty", "1.3", "--temperature", "0.9"]
    code, cached, _ = _sample(run_dir, capsys, "--prompt", "the ", *common)
    assert code == 0 and cached.startswith("the ") and len(cached) == 4 + 30 + 1
    assert _sample(run_dir, capsys, "--prompt", "the ", *common)[1] == cached             # seeded
    within = [*common, "--max-new-tokens", "11"]  # 4 + 11 < block_size 16: the same context either way
    assert _sample(run_dir, capsys, "--prompt", "the ", *within, "--use-cache", "false")[1] == \
        _sample(run_dir, capsys, "--prompt", "the ", *within)[1]
    assert _sample(run_dir, capsys, "--prompt", "the ", *common[:-2], "--temperature", "1e-40")[1] == \
        _sample(run_dir, capsys, "--prompt", "the ", *common[:-2], "--temperature", "0")[1]


def test_sample_a_batch_of_prompts_and_stop_texts(run_dir, capsys):
    code, out, _ = _sample(run_dir, capsys, "--prompt", '["the ", "a", "dog ran"]', "--max-new-tokens", "20",
                           "--temperature", "0", "--num-samples", "2")
    texts = out.removesuffix("\n").split(SEP)
    assert code == 0 and len(texts) == 6
    for prompt, (a, b) in zip(["the ", "a", "dog ran"], zip(texts[::2], texts[1::2])):
        assert a == b and a.startswith(prompt) and len(a) == len(prompt) + 20
        alone = _sample(run_dir, capsys, "--prompt", prompt, "--max-new-tokens", "20", "--temperature", "0")[1]
        assert alone == a + "\n"  # each prompt as if sampled alone
    full = texts[0]
    stop = full[6:8]  # a stop text that occurs in the continuation
    code, out, _ = _sample(run_dir, capsys, "--prompt", "the ", "--max-new-tokens", "20", "--temperature", "0",
                           "--stop", stop)
    assert code == 0 and out == full[: full.index(stop, 4)] + "\n"
    code, out, _ = _sample(run_dir, capsys, "--prompt", "the ", "--max-new-tokens", "20", "--temperature", "0",
                           "--stop", f'["zzz", "{stop}"]')
    assert out == full[: full.index(stop, 4)] + "\n"


@pytest.mark.parametrize("args,match", [(["--top-p", "0"], "top_p=0.0 must be > 0.0"),
                                        (["--min-p", "1.5"], "min_p=1.5 must be <= 1.0"),
                                        (["--repetition-penalty", "-1"], "repetition_penalty=-1.0 must be > 0.0"),
                                        (["--stop", ""], "a stop text must not be empty")])
def test_sample_bad_options_are_one_line_errors(run_dir, capsys, args, match):
    code, _, err = _sample(run_dir, capsys, "--prompt", "the ", *args)
    assert code == 2 and err.startswith("error: ") and match in err and err.count("\n") == 1


def test_interactive_prompt_loop_reads_stdin(run_dir):
    """`sample --interactive` answers each line of standard input; a bad line is an error line, not the end."""
    import subprocess
    import sys

    lines = "the \n\nXYZ€\na\\nt\ncat \n"
    r = subprocess.run([sys.executable, "-m", "energyformer", "sample", str(run_dir), "--interactive",
                        "--max-new-tokens", "10", "--temperature", "0"], input=lines, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    answers = r.stdout.split(SEP)
    assert answers[-1] == "" and len(answers) == 4  # three good prompts, each followed by the separator
    assert [a[: len(p)] for a, p in zip(answers, ["the ", "a\nt", "cat "])] == ["the ", "a\nt", "cat "]
    assert all(len(a) == len(p) + 10 for a, p in zip(answers, ["the ", "a\nt", "cat "]))
    assert r.stderr.count("error: ") == 1 and "cannot encode the prompt" in r.stderr
