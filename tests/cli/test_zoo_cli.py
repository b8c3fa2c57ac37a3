"""`energyformer zoo` and `zoo:NAME` as the RUN of sample, inspect and export, from any working
directory, with outputs that never go into the package."""
import json
import stat

import pytest

from energyformer.cli import main
from energyformer.runs.zoo import zoo_root


def test_zoo_lists_the_entries(capsys):
    assert main(["zoo"]) == 0
    out = capsys.readouterr().out
    assert "| zoo:nrgpt_shakespeare_char |" in out and "| zoo:cem_t2_shakespeare_char |" in out
    assert "1.7070" in out and "energyformer experiment energy_descent" in out


def test_sample_inspect_export_take_a_zoo_entry(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in (zoo_root() / "nrgpt_shakespeare_char").iterdir())
    assert main(["sample", "zoo:nrgpt_shakespeare_char", "--prompt", "ROMEO:", "--max-new-tokens", "20",
                 "--seed", "0", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ROMEO:") and len(text.strip()) > len("ROMEO:")
    assert main(["inspect", "zoo:nrgpt_shakespeare_char", "--prompt", "ROMEO:", "--device", "cpu"]) == 0
    assert (tmp_path / "inspect" / "nrgpt_shakespeare_char" / "trace.json").is_file()  # not inside the package
    pytest.importorskip("transformers")
    assert main(["export", "zoo:cem_t2_shakespeare_char"]) == 0
    out = tmp_path / "hf" / "cem_t2_shakespeare_char"
    assert (out / "config.json").is_file()
    card = (out / "README.md").read_text(encoding="utf-8")
    value = json.loads((zoo_root() / "cem_t2_shakespeare_char" / "zoo.json").read_text())["metric"]["value"]
    assert "fixed evaluation: " in card and f"{value:.4f}" in card and "None" not in card  # the entry's metric
    assert all(stat.S_IMODE(f.stat().st_mode) & 0o044 == 0o044 for f in out.iterdir())  # readable by others
    assert sorted(p.name for p in (zoo_root() / "nrgpt_shakespeare_char").iterdir()) == before


def test_a_mistyped_zoo_entry_is_one_error_line(capsys):
    assert main(["sample", "zoo:cem_t2", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean zoo:cem_t2_shakespeare_char?" in err


def test_eval_of_a_zoo_entry_names_it_and_writes_under_the_working_directory(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "zoo:nrgpt_shakespeare_char", "--tasks", "mmlu_dev", "--limit", "1", "--num_fewshot", "0",
                 "--quiet", "--device", "cpu"]) == 0
    report = json.loads((tmp_path / "eval" / "nrgpt_shakespeare_char.json").read_text())
    assert report["run"] == "zoo:nrgpt_shakespeare_char"  # not the package's folder
    assert capsys.readouterr().out.startswith("**zoo:nrgpt_shakespeare_char**")
