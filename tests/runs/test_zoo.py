"""The model zoo (energyformer.runs.zoo): every shipped entry loads offline through ``zoo:NAME``, its
weights are the ones its experiment scored, and they reproduce the loss recorded on its check tokens."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from energyformer.eval.suite import windows_loss
from energyformer.runs.rundir import load_run
from energyformer.runs.zoo import ENTRY_FILE, model_card, resolve_run_dir, zoo_entries, zoo_root

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = [e["name"] for e in zoo_entries()]


def test_the_zoo_ships_the_experiments_models():
    assert {"nrgpt_shakespeare_char", "cem_shakespeare_char", "llama_shakespeare_char",
            "cem_t2_shakespeare_char"} <= set(ENTRIES)


@pytest.mark.parametrize("name", ENTRIES)
def test_each_entry_loads_and_reproduces_its_recorded_loss(name):
    model, run_cfg, meta = load_run(f"zoo:{name}")
    card = json.loads((zoo_root() / name / ENTRY_FILE).read_text())
    assert card["arch"] == run_cfg.model.arch and sum(p.numel() for p in model.parameters()) > 0
    assert meta["tokenizer"] == "char"
    check = json.loads((zoo_root() / name / "check.json").read_text())
    loss, count = windows_loss(model, np.asarray(check["tokens"]))
    assert count == len(check["tokens"]) - 1 and loss == pytest.approx(check["loss"], rel=1e-5)
    # the shipped weights are the ones the experiment scored: same file hash as the record's evaluation
    source = ROOT / card["source"]
    if source.is_dir():  # a clone (the wheel has no results/)
        recorded = json.loads((source / "final_eval.json").read_text())
        sha = hashlib.sha256((zoo_root() / name / "model.safetensors").read_bytes()).hexdigest()
        assert recorded["weights_sha256"] == sha and recorded["value"] == card["metric"]["value"]
    assert f"**{card['metric']['value']:.4f}**" in (zoo_root() / name / "README.md").read_text()
    assert (zoo_root() / name / "README.md").read_text() == model_card(card)


def test_a_zoo_name_that_does_not_exist_says_which_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'zoo:nrgpt_shakespear' is not in the model zoo .*did you mean "
                                               r"zoo:nrgpt_shakespeare_char\?"):
        resolve_run_dir("zoo:nrgpt_shakespear")
    with pytest.raises(FileNotFoundError, match=r"entries: none"):
        resolve_run_dir("zoo:x", root=tmp_path)
    assert resolve_run_dir("out/run") == Path("out/run") and resolve_run_dir(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="not in the model zoo"):
        load_run("zoo:nope")
