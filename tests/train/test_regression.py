"""The regressor's loop (``train/regression.py``) reads only the ``TrainConfig`` keys of its
:class:`~energyformer.models.registry.ArchSpec`; any other key set away from its default is refused in one
``error:`` line naming the keys (it used to be ignored silently), and the device it trains on is the one
``train.device`` gives and the summary records."""
import pytest
import yaml

from energyformer.cli import main
from energyformer.data.task_data import prepare_task_data
from energyformer.models.registry import REGRESSOR_TRAIN_KEYS, get_spec
from energyformer.runs.config import TrainConfig, load_config
from energyformer.runs.rundir import read_summary
from energyformer.train import train

MODEL = {"arch": "regressor", "x_dim": 1, "d_model": 16, "n_heads": 2, "n_layers": 1, "block_size": 12}


@pytest.fixture(scope="module")
def gp_data(tmp_path_factory):
    return prepare_task_data("gp", out_root=tmp_path_factory.mktemp("gp"), n_points=6, n_train=20, n_val=4,
                             n_test=4, x_dim=1)


def run_cfg(data, out, **train_keys):
    return load_config({"model": MODEL, "data": {"data_dir": str(data)},
                        "train": {"out_dir": str(out), "max_steps": 3, "batch_size": 4, "eval_interval": 3,
                                  "warmup_steps": 1, **train_keys}})


def test_defaults_and_derived_defaults_are_not_refused():
    spec = get_spec("regressor")
    assert spec.train_keys == REGRESSOR_TRAIN_KEYS and not spec.language_model
    assert spec.ignored_train_keys(TrainConfig()) == []
    # ckpt_interval follows eval_interval (a derived default), min_lr follows learning_rate: both read or derived
    assert spec.ignored_train_keys(TrainConfig(eval_interval=7, learning_rate=3e-3)) == []
    assert spec.ignored_train_keys(TrainConfig(eval_interval=7, ckpt_interval=5)) == ["ckpt_interval"]
    assert get_spec("nrgpt").ignored_train_keys(TrainConfig(grad_accum_steps=2, resume="never")) == []


@pytest.mark.parametrize("keys,named", [
    ({"resume": "never"}, "train.resume='never'"),
    ({"grad_accum_steps": 2, "parallel": "fsdp"}, "train.grad_accum_steps=2, train.parallel='fsdp'"),
    ({"eval_iters": 5, "compile": True, "deterministic": True},
     "train.eval_iters=5, train.compile=True, train.deterministic=True"),
])
def test_keys_the_loop_does_not_read_are_one_error_line(gp_data, tmp_path, keys, named):
    with pytest.raises(ValueError, match="does not read " + named.replace("(", r"\(")):
        train(run_cfg(gp_data, tmp_path / "run", **keys), progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_the_cli_refuses_them_in_one_line(gp_data, tmp_path, capsys):
    recipe = tmp_path / "gp.yaml"
    recipe.write_text(yaml.safe_dump({"model": MODEL, "data": {"data_dir": str(gp_data)},
                                      "train": {"out_dir": str(tmp_path / "run"), "max_steps": 2}}))
    rc = main(["train", str(recipe), "--train.grad_accum_steps", "4"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and err.startswith("error:"), err
    assert "train.grad_accum_steps=4" in err and "model.arch='regressor'" in err, err


def test_the_regressor_trains_on_the_given_device_and_records_it(gp_data, tmp_path):
    summary = train(run_cfg(gp_data, tmp_path / "run", device="cpu", dtype="float32"), progress=False)
    assert summary["device"] == "cpu" and read_summary(tmp_path / "run")["steps"] == 3
    assert 0 < summary["cpu_minutes"] and summary["minutes"] > 0  # CPU time beside the wall clock
    with pytest.raises(ValueError, match="the regressor trains in float32"):
        train(run_cfg(gp_data, tmp_path / "run2", dtype="bfloat16"), progress=False)


def test_the_regressor_sets_up_the_process_as_every_training(gp_data, tmp_path, monkeypatch):
    """``configure_backends`` runs here too (the CPU allocator, ``ENERGYFORMER_MALLOC``): a bad value
    is refused before anything is written."""
    monkeypatch.setenv("ENERGYFORMER_MALLOC", "bogus")
    with pytest.raises(ValueError, match="ENERGYFORMER_MALLOC='bogus' must be one of tuned, system"):
        train(run_cfg(gp_data, tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()
