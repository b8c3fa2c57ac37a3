"""The per-token adaptive exit through the transformers wrapper (docs/inference_compute.md §4,
docs/hf.md §3), in process: the export's generate gives our tokens and steps, cached or not, and
a left-padded batch gives each row what it gets alone. (Without energyformer installed:
tests/hf/test_hf_remote_code.py.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from run_helpers import make_run  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import energyformer.hf  # noqa: E402,F401  (registers the Auto classes)
from energyformer.hf.export import export_run  # noqa: E402
from energyformer.runs.rundir import load_run  # noqa: E402


@pytest.fixture(scope="module", params=["nrgpt", "gpt_rec"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    run = make_run(root / "run", {"arch": request.param})
    out = export_run(run, root / "hf")
    return load_run(run)[0], AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)


def test_export_generate_with_exit_equals_ours_cached_or_not(exported):
    ours, tok, model = exported
    ids = tok(["the cat sat on"], return_tensors="pt")
    kw = dict(n_steps=8, exit="kl:1e-3")
    want = ours.generate(ids["input_ids"], 6, temperature=0, **kw)
    steps = ours.generated_exit_steps
    for use_cache in (True, False):
        got = model.generate(**ids, max_new_tokens=6, do_sample=False, use_cache=use_cache, **kw)
        assert torch.equal(got, want) and torch.equal(model.model.generated_exit_steps, steps)
    assert steps.min() < steps.max() or steps.max() < 8  # the exit fired somewhere


def test_left_padded_batch_with_exit_equals_one_prompt_at_a_time(exported):
    _, tok, model = exported
    texts = ["the cat", "a dog ran on"]
    kw = dict(max_new_tokens=5, do_sample=False, n_steps=8, exit="kl:1e-3")
    batched = model.generate(**tok(texts, return_tensors="pt", padding=True), **kw)
    batched_steps = model.model.generated_exit_steps
    for row, text in enumerate(texts):
        single = model.generate(**tok([text], return_tensors="pt"), **kw)
        assert tok.decode(batched[row], skip_special_tokens=True) == tok.decode(single[0])
        assert torch.equal(batched_steps[row], model.model.generated_exit_steps[0])


def test_forward_with_exit_sets_the_steps_and_rejects_a_bad_spec(exported):
    ours, tok, model = exported
    ids = tok(["the cat sat"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids, n_steps=8, exit="kl:1e-3").logits
        want = ours(ids, n_steps=8, exit="kl:1e-3")[0]
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-6)
    assert torch.equal(model.model.exit_steps, ours.exit_steps)
    with pytest.raises(ValueError, match="unknown exit criterion 'nope'"):
        model(ids, exit="nope:1")
