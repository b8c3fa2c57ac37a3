"""The lm-eval adapter (energyformer.eval.harness): log-likelihoods equal our own log-probs by hand,
rolling windows, generation, and one local task through both our adapter and lm-eval's own ``hf``
model on the exported folder. Offline (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from run_helpers import CHARS, local_task, make_run  # noqa: E402

from energyformer.data import CharTokenizer  # noqa: E402
from energyformer.eval.harness import EnergyformerLM, run_tasks  # noqa: E402

TOK = CharTokenizer(CHARS)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("h") / "run", {"arch": "nrgpt"})
    return EnergyformerLM(run=str(run), batch_size=2)


def _req(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _by_hand(model, ids, n_cont):
    """Σ log p(last n_cont ids | everything before), from one plain forward."""
    with torch.no_grad():
        lp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0][0].float(), dim=-1)
    return sum(float(lp[i - 1, ids[i]]) for i in range(len(ids) - n_cont, len(ids)))


def test_loglikelihood_equals_our_log_probs_by_hand_batched(lm):
    pairs = [("the cat sat", " on a mat."), ("a", " dog"), ("so on, 0 to", " 9!"), ("the dog ran to the cat;", " a")]
    got = lm.loglikelihood([_req("loglikelihood", c, x) for c, x in pairs])  # batch_size=2, mixed lengths
    for (ctx, cont), (score, _) in zip(pairs, got):
        assert score == pytest.approx(_by_hand(lm.model, TOK.encode(ctx + cont), len(cont)), abs=1e-4)


def test_loglikelihood_context_longer_than_block_is_cut_from_the_left(lm):
    ctx, cont = "the cat sat on a mat." * 3, " the end"  # 63 + 8 > block_size 32
    (score, _), = lm.loglikelihood([_req("loglikelihood", ctx, cont)])
    ids = TOK.encode(ctx + cont)[-33:]
    assert score == pytest.approx(_by_hand(lm.model, ids, len(cont)), abs=1e-4)


def test_is_greedy_flag(lm):
    ctx = "the cat"
    with torch.no_grad():
        best = int(lm.model(torch.tensor([TOK.encode(ctx)]))[0][0, -1].argmax())
    other = (best + 1) % len(CHARS)
    res = lm.loglikelihood([_req("loglikelihood", ctx, TOK.decode([best])),
                            _req("loglikelihood", ctx, TOK.decode([other]))])
    assert res[0][1] is True and res[1][1] is False


def test_loglikelihood_rolling_in_windows_by_hand(lm):
    text = "the cat sat on a mat. the dog ran to the cat; a cat ran on. And so"  # 66 tokens, block 32
    (got,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", text)])
    ids, nl = TOK.encode(text), TOK.encode("\n")[0]
    want = _by_hand(lm.model, [nl] + ids[:32], 32)  # first window: conditioned on "\n"
    for end in range(64, len(ids) + 32, 32):  # then disjoint windows, full context of the window
        end = min(end, len(ids))
        start = 32 + 32 * ((end - 33) // 32)
        want += _by_hand(lm.model, ids[end - 33:end], end - start)
    assert got == pytest.approx(want, abs=1e-3)


def test_generate_until_is_our_greedy_generation_cut_at_the_stop(lm):
    ctx = "the cat"
    full = lm.model.generate(torch.tensor([TOK.encode(ctx)]), 12, temperature=0)[0, 7:].tolist()
    text = TOK.decode(full)
    stop = text[5]
    (got,) = lm.generate_until([_req("generate_until", ctx, {"until": [stop], "max_gen_toks": 12})])
    assert got == text[:text.index(stop)]


def test_each_request_type_shows_a_progress_bar_unless_disabled(lm, capsys):
    """tqdm bars on stderr over the requests of each call (forced on here: stderr is no terminal);
    off with lm-eval's ``disable_tqdm`` or ``progress=False``."""
    calls = {"loglikelihood": lambda **kw: lm.loglikelihood([_req("loglikelihood", "the", " cat")] * 3, **kw),
             "loglikelihood_rolling": lambda **kw: lm.loglikelihood_rolling(
                 [_req("loglikelihood_rolling", "the cat sat")] * 2, **kw),
             "generate_until": lambda **kw: lm.generate_until(
                 [_req("generate_until", "the cat", {"until": ["."], "max_gen_toks": 3})] * 2, **kw)}
    try:
        for progress in (True, None, False):
            lm.progress = progress
            for desc, call in calls.items():
                capsys.readouterr()
                call()
                err = capsys.readouterr().err
                assert (f"{desc}: 100%" in err) == (progress is True), (progress, err)
                if progress:
                    n = 2 if desc != "loglikelihood" else 3
                    assert f"| {n}/{n} [" in err and "req/s" in err
                    call(disable_tqdm=True)
                    assert capsys.readouterr().err == ""
    finally:
        lm.progress = None


def test_out_of_vocabulary_text_is_named(lm):
    with pytest.raises(ValueError, match="'€'"):
        lm.loglikelihood([_req("loglikelihood", "the €", " cat")])


def test_one_local_task_both_ways_our_adapter_and_lm_evals_hf_model(tmp_path):
    import energyformer.hf  # noqa: F401  (registers energyformer_* with transformers' Auto classes)
    from energyformer.hf.export import export_run

    run = make_run(tmp_path / "run", {"arch": "gpt"})
    docs = [{"q": "the cat sat on a", "choices": [" mat.", " dog", " cat"], "answer": 0},
            {"q": "And so on, 0 to", "choices": [" 9!", " 0", " the"], "answer": 0},
            {"q": "the dog ran", "choices": [" to", " on", " a"], "answer": 1}]
    common = dict(tasks=["tiny_local_mc"], include_path=str(local_task(tmp_path / "tasks", docs)),
                  include_defaults=False, log_samples=True)
    ours = run_tasks(EnergyformerLM(run=str(run)), **common)
    folder = export_run(run, tmp_path / "hf")
    # no BOS in our tokenizers: lm-eval's hf model needs the prefix token our adapter defaults to ("\n")
    args = {"pretrained": str(folder), "device": "cpu", "batch_size": 2, "prefix_token_id": CHARS.index("\n")}
    theirs = run_tasks("hf", model_args=args, **common)
    # per doc, per choice: resps [[(loglikelihood, is_greedy)], ...]
    scores = [[[float(r[0][0]) for r in s["resps"]] for s in res["samples"]["tiny_local_mc"]] for res in (ours, theirs)]
    assert len(scores[0]) == 3
    torch.testing.assert_close(torch.tensor(scores[0]), torch.tensor(scores[1]), atol=1e-4, rtol=0)
    assert ours["results"]["tiny_local_mc"]["acc,none"] == theirs["results"]["tiny_local_mc"]["acc,none"]


def test_unknown_task_is_named(lm, tmp_path):
    with pytest.raises(ValueError, match="unknown lm-eval task 'no_such_task'"):
        run_tasks(lm, ["no_such_task"], include_path=str(tmp_path), include_defaults=False)
