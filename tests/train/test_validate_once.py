"""One ``energyformer train`` validates each section of its config once (the model config is not
rebuilt from a dict when the model is built) and reads the data's meta.json once (``load_config`` reads
it for ``model.vocab_size`` and hands it on as ``RunConfig.data_meta``)."""
from collections import Counter
from pathlib import Path

import pytest
import yaml

import energyformer.data.meta as data_meta
from energyformer.commands import train
from energyformer.data.prepare import prepare_text
from energyformer.data.task_data import prepare_task_data
from energyformer.models.registry import get_arch
from energyformer.runs.config import DataConfig, TrainConfig

CASES = {
    "nrgpt": {"arch": "nrgpt", "d_model": 16, "n_heads": 2, "block_size": 16},
    "cem": {"arch": "cem", "d_model": 16, "n_heads": 2, "n_layers": 1, "block_size": 16},
    "regressor": {"arch": "regressor", "x_dim": 1, "d_model": 16, "n_heads": 2, "n_layers": 1, "block_size": 12},
}


def _count(monkeypatch, cls, name: str, counts: Counter) -> None:
    original = cls.__post_init__

    def counted(self, *args, **kwargs):
        if type(self) is cls:  # a subclass's own call counts once, under its own name
            counts[name] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__post_init__", counted)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_train_run_validates_its_config_once_and_reads_meta_json_once(arch, tmp_path, monkeypatch):
    if arch == "regressor":
        data = prepare_task_data("gp", out_root=tmp_path, n_points=6, n_train=20, n_val=4, n_test=4, x_dim=1)
    else:
        text = tmp_path / "tiny.txt"
        text.write_text("the cat sat on the mat. " * 40)
        data = prepare_text(text, tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": CASES[arch], "data": {"data_dir": str(data)},
        "train": {"out_dir": str(tmp_path / "run"), "max_steps": 2, "batch_size": 2, "eval_interval": 2,
                  "warmup_steps": 1, "device": "cpu"}}))
    counts: Counter = Counter()
    _count(monkeypatch, get_arch(arch)[1], "model", counts)
    _count(monkeypatch, DataConfig, "data", counts)
    _count(monkeypatch, TrainConfig, "train", counts)
    read = data_meta.read_json_object

    def read_counted(path, *args, **kwargs):
        if Path(path).name == data_meta.META_FILE:
            counts["meta.json"] += 1
        return read(path, *args, **kwargs)

    monkeypatch.setattr(data_meta, "read_json_object", read_counted)
    train(str(recipe), progress=False)
    # the regressor's spec builds one more TrainConfig: the config of the keys its loop reads
    assert counts == {"model": 1, "data": 1, "train": 2 if arch == "regressor" else 1, "meta.json": 1}, counts
