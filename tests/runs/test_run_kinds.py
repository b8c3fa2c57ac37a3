"""Commands that read text refuse a run that is not a language model by what it is."""
import pytest

from energyformer.cli import main
from energyformer.runs.config import load_config, save_config
from energyformer.runs.rundir import load_run


@pytest.fixture
def regressor_run(tmp_path):
    run = tmp_path / "gp_run"
    cfg = load_config({"model": {"arch": "regressor", "d_model": 16, "n_heads": 2, "n_layers": 1},
                       "train": {"out_dir": str(run)}})
    save_config(cfg, run / "config.yaml")
    return run


def test_load_run_names_the_arch(regressor_run):
    with pytest.raises(ValueError, match=r"is an arch='regressor' run, which reads continuous values, not text"):
        load_run(regressor_run)


@pytest.mark.parametrize("argv", [["sample", "{run}"], ["inspect", "{run}"]])
def test_text_commands_refuse_a_regressor_run_in_one_line(regressor_run, tmp_path, capsys, argv):
    rc = main([a.format(run=regressor_run, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "arch='regressor'" in err, err
