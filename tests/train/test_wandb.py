"""``train.wandb``: the Weights & Biases logger beside metrics.jsonl, in offline mode (no account, no network)."""
import sys
from pathlib import Path

import pytest
from helpers import make_data_dir, tiny_config

from energyformer.cli import main
from energyformer.runs import load_config
from energyformer.train import train
from energyformer.train.metrics import WANDB_ID_FILE, MetricsLogger

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "shakespeare_char" / "gpt.yaml")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


def _cfg(tmp_path, max_steps, **train_kw):
    model = {"d_model": 16, "n_layers": 1, "block_size": 8}
    return tiny_config(make_data_dir(tmp_path / "data"), tmp_path / "run", model,
                       **{"max_steps": max_steps, "batch_size": 2, "eval_interval": 2, "warmup_steps": 1,
                          "learning_rate": 1e-3, "compile": False, **train_kw})


def _run_files(run_dir, run_id):
    return sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_offline_wandb_logs_the_metrics_and_a_resumed_run_continues_it(tmp_path, offline):
    pytest.importorskip("wandb")
    train(_cfg(tmp_path, 2, wandb=True, wandb_project="ef-test", wandb_run_name="tiny"), progress=False)
    run_dir = tmp_path / "run"
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    files = _run_files(run_dir, run_id)
    assert len(files) == 1
    logged = files[0].read_bytes()
    for key in (b"train_loss", b"val_loss", b"lr", b"ef-test", b"tiny"):
        assert key in logged, key
    assert b"d_model" in logged  # the run config is the W&B config

    train(_cfg(tmp_path, 4, wandb=True, resume="auto"), progress=False)
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    assert len(_run_files(run_dir, run_id)) == 2  # a second offline segment of the same W&B run


def test_wandb_off_writes_nothing_of_wandb(tmp_path, offline):
    train(_cfg(tmp_path, 1), progress=False)
    assert not (tmp_path / "run" / WANDB_ID_FILE).exists() and not (tmp_path / "run" / "wandb").exists()


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys, offline):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r"energyformer\[wandb\]"):
        MetricsLogger(tmp_path / "x", wandb={"project": "p", "name": "n", "config": {}})
    data = make_data_dir(tmp_path / "data")
    code = main(["train", RECIPE, "--data.data_dir", str(data), "--train.wandb",
                 "--train.max_steps", "1", "--train.out_dir", str(tmp_path / "run"), "--train.device", "cpu",
                 "--model.d_model", "16", "--model.n_layers", "1", "--model.block_size", "8",
                 "--train.batch_size", "2", "--train.compile", "false", "--train.warmup_steps", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "energyformer[wandb]" in err, err


@pytest.mark.parametrize("override, message", [
    (["--train.wandb", "maybe"], r"train.wandb='maybe' must be a boolean"),
    (["--train.wandb_project", " "], r"train.wandb_project=' ' must be a non-empty string"),
])
def test_bad_wandb_options_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(RECIPE, override)
