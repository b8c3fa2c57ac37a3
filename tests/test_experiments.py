"""`energyformer experiment NAME --quick` for every experiment: the pipeline (data, training, metrics,
results files, resuming finished runs), not the science (tiny sizes, seconds each)."""
import json

import pytest

from energyformer.cli import main
from energyformer.experiments import EXPERIMENTS, run_experiment


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_quick(name, tmp_path, capsys):
    args = ["experiment", name, "--quick", "--seeds", "1", "--results-dir", str(tmp_path / "results"),
            "--work-dir", str(tmp_path / "work")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "results" / name
    table = (out / "table.md").read_text()
    assert table.count("|") > 10 and table.splitlines()[-1] in printed
    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == name and results["quick"] is True
    assert list(out.glob("*.png")), "every experiment writes its plots"
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs and all((out / "runs" / r / "summary.json").is_file() for r in runs)
    # a second call reuses every finished run instead of training it again
    assert main(args) == 0
    again = capsys.readouterr().out
    assert again.count("finished earlier") == len(runs)


def test_experiment_errors(tmp_path, capsys):
    assert main(["experiment", "nope"]) == 2
    assert "experiment='nope' is not valid" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seeds=0 must be >= 1"):
        run_experiment("gp_recursion", seeds=0)
    # a full run needs the prepared data and says which command makes it
    assert main(["experiment", "listops_transition", "--seeds", "1", "--data-root", str(tmp_path / "none"),
                 "--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")]) == 2
    assert "energyformer prepare listops" in capsys.readouterr().err
