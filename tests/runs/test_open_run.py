"""Opening a trained run for inference has one home, ``energyformer.runs.rundir.open_run``: what it
returns, its ``zoo:NAME`` references and its still-training warning, and that ``sample``, ``inspect``
and the lm-eval adapter (``eval``) all open their run through it."""
import warnings

import pytest
import torch
from run_helpers import make_run

from energyformer.runs import rundir
from energyformer.runs.rundir import OpenRun, load_run, lock_run_dir, open_run
from energyformer.runs.zoo import zoo_root

ZOO = "nrgpt_shakespeare_char"


def _still_training(caught) -> list[str]:
    return [str(w.message) for w in caught if "still training" in str(w.message)]


def test_open_run_returns_the_model_config_meta_tokenizer_device_and_folder(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "nrgpt"})
    opened = open_run(str(run), "cpu")
    model, run_cfg, meta, tokenizer, device, run_dir = opened
    assert isinstance(opened, OpenRun) and opened.model is model and opened.tokenizer is tokenizer
    assert device == torch.device("cpu") and all(p.device == device for p in model.parameters())
    assert not model.training and run_cfg.model.arch == "nrgpt" and meta["tokenizer"] == "char" and run_dir == run
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"
    reference = load_run(run)[0].state_dict()  # the same weights load_run gives
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_open_run_takes_a_zoo_entry_and_names_a_bad_one():
    opened = open_run(f"zoo:{ZOO}", "cpu")
    assert opened.run_dir == zoo_root() / ZOO and opened.run_cfg.model.arch == "nrgpt"
    with pytest.raises(FileNotFoundError, match="'zoo:nope' is not in the model zoo"):
        open_run("zoo:nope", "cpu")


def test_open_run_refuses_a_device_that_is_not_one(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "gpt"})
    with pytest.raises(ValueError, match=r"device='gpu0' is not a device; expected 'auto', 'cpu'"):
        open_run(run, "gpu0")


def test_open_run_warns_only_while_a_training_holds_the_run(tmp_path):
    run = make_run(tmp_path / "run", {"arch": "gpt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        open_run(run, "cpu")
    assert _still_training(caught) == []
    with lock_run_dir(run), warnings.catch_warnings(record=True) as caught:  # what a training holds
        warnings.simplefilter("always")
        open_run(run, "cpu")
    assert _still_training(caught) == [f"using step 1 of a run still training ({str(run)!r}); later checkpoints "
                                       "will differ"]


def test_sample_inspect_and_the_eval_adapter_open_their_run_with_open_run(tmp_path, monkeypatch):
    """Each of the three goes through ``open_run`` (so each warns about a run still training, once)."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("lm_eval")
    from energyformer.commands import sample
    from energyformer.eval import harness
    from energyformer.inspect.energy import inspect_run

    run = make_run(tmp_path / "run", {"arch": "nrgpt"})
    opened, real = [], rundir.open_run

    def spy(run_ref, device="auto"):
        opened.append(str(run_ref))
        return real(run_ref, device)

    monkeypatch.setattr(rundir, "open_run", spy)
    monkeypatch.setattr(harness, "open_run", spy)
    with lock_run_dir(run), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (text,) = sample(str(run), prompt="the", max_new_tokens=2, device="cpu")
        report = inspect_run(str(run), "the cat", tmp_path / "inspect", device="cpu")
        lm = harness.EnergyformerLM(run=str(run), device="cpu")
    assert opened == [str(run)] * 3
    assert len(_still_training(caught)) == 3
    assert text.startswith("the") and report["arch"] == "nrgpt" and lm.run_config.model.arch == "nrgpt"


def test_the_eval_adapter_takes_a_zoo_entry():
    pytest.importorskip("lm_eval")
    from energyformer.eval.harness import EnergyformerLM

    lm = EnergyformerLM(run=f"zoo:{ZOO}", device="cpu", batch_size=1)
    assert lm.run_config.model.arch == "nrgpt" and lm.tok_decode(lm.tok_encode("ROMEO:")) == "ROMEO:"
