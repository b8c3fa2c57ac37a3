"""Recipes and run configs: every YAML under configs/ loads and builds; overrides, type coercion,
unknown keys, validation, vocab resolution and the save/load round trip."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from energyformer import build_model
from energyformer.train.config import (DataConfig, RunConfig, TrainConfig, load_config, parse_overrides,
                                       save_config)

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))


def test_there_are_recipes():
    assert (ROOT / "configs" / "shakespeare_char" / "gpt.yaml") in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT / "configs")) for p in RECIPES])
def test_recipe_loads_and_builds_on_meta_device(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative data roots point nowhere: vocab falls back to 65
    cfg = load_config(path, resolve_vocab=True, default_vocab_size=65)
    assert isinstance(cfg, RunConfig)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert model.num_params() > 0
    given = yaml.safe_load(path.read_text())["model"].get("vocab_size")
    if given is None and not (cfg.data.path / "meta.json").exists():
        assert cfg.model.vocab_size == 65
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_gpt_recipe_size():
    cfg = load_config(ROOT / "configs" / "shakespeare_char" / "gpt.yaml", resolve_vocab=True,
                      default_vocab_size=65)
    with torch.device("meta"):
        n = build_model(dataclasses.replace(cfg.model, vocab_size=65)).num_params()
    assert 0.7e6 < n < 0.9e6
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.block_size) == (128, 4, 4, 128)


def minimal(**train):
    return {"model": {"arch": "gpt", "d_model": 16, "n_heads": 2, "n_layers": 1}, "train": train}


def test_override_forms_and_coercion():
    cfg = load_config(minimal(), ["--train.max_steps", "2000", "--train.learning_rate=3e-4",
                                  "--model.n_layers", "3", "--train.tensorboard", "--train.compile", "false",
                                  "--train.num_threads", "null", "--data.dataset", "other", "--train.seed=0"])
    assert cfg.train.max_steps == 2000 and isinstance(cfg.train.max_steps, int)
    assert cfg.train.learning_rate == 3e-4 and isinstance(cfg.train.learning_rate, float)
    assert cfg.model.n_layers == 3
    assert cfg.train.tensorboard is True and cfg.train.compile is False and cfg.train.num_threads is None
    assert cfg.data.path == Path("data/other") and cfg.train.seed == 0
    # defaults resolved from other fields
    assert cfg.train.lr_decay_steps == 2000 and cfg.train.ckpt_interval == cfg.train.eval_interval
    assert cfg.train.min_lr == pytest.approx(3e-5)
    # YAML-typed values are coerced too: int given as a float, float given as an int
    cfg = load_config({"model": {"arch": "gpt", "d_model": 16.0, "n_heads": 2}, "train": {"learning_rate": 1}})
    assert cfg.model.d_model == 16 and isinstance(cfg.model.d_model, int)
    assert isinstance(cfg.train.learning_rate, float)
    # later overrides win; arch can be overridden
    assert load_config(minimal(), ["--train.seed", "1", "--train.seed", "2"]).train.seed == 2


def test_parse_overrides():
    assert parse_overrides(["--a.b", "1", "--c.d=x=y", "--e.f"])[:2] == [(("a", "b"), "1"), (("c", "d"), "x=y")]
    assert parse_overrides(["--train.seed", "-1"]) == [(("train", "seed"), "-1")]
    with pytest.raises(ValueError, match="unexpected argument 'oops'"):
        parse_overrides(["oops"])
    with pytest.raises(ValueError, match="must name a section and a key"):
        parse_overrides(["--max_steps", "3"])


def test_unknown_keys_and_sections():
    with pytest.raises(ValueError, match=r"unknown config key 'train.max_step' \(did you mean 'max_steps'\?\).*"
                                         r"valid keys: \[.*'max_steps'"):
        load_config(minimal(), ["--train.max_step", "5"])
    with pytest.raises(ValueError, match=r"unknown config key 'model.n_step'.*arch 'gpt'.*valid keys"):
        load_config(minimal(), ["--model.n_step", "5"])
    with pytest.raises(ValueError, match=r"unknown config section 'optim'"):
        load_config(minimal(), ["--optim.lr", "5"])
    with pytest.raises(ValueError, match=r"unknown config section\(s\) \['trian'\]"):
        load_config({**minimal(), "trian": {}})
    with pytest.raises(ValueError, match="needs an 'arch' key"):
        load_config({"model": {"d_model": 16}})
    with pytest.raises(ValueError, match="model.arch='gtp' is not valid"):
        load_config({"model": {"arch": "gtp"}})


@pytest.mark.parametrize("override, match", [
    (["--train.max_steps", "abc"], r"train.max_steps='abc' must be an integer"),
    (["--train.max_steps", "2.5"], r"train.max_steps='2.5' must be an integer"),
    (["--train.learning_rate", "fast"], r"train.learning_rate='fast' must be a number"),
    (["--train.learning_rate", "-1e-3"], r"train.learning_rate=-0.001 must be > 0"),
    (["--train.learning_rate", "nan"], r"train.learning_rate=nan must be a finite number"),
    (["--train.min_lr", "1.0"], r"train.min_lr=1.0 must be <= 0.001"),
    (["--train.tensorboard", "maybe"], r"train.tensorboard='maybe' must be a boolean"),
    (["--train.batch_size", "0"], r"train.batch_size=0 must be >= 1"),
    (["--train.beta2", "1.0"], r"train.beta2=1.0 must be <="),
    (["--train.device", "gpu"], r"train.device='gpu' is not valid"),
    (["--train.device", "cpu:1"], r"train.device='cpu:1' is not valid"),
    (["--train.dtype", "float16"], r"train.dtype='float16' is not valid"),
    (["--train.lr_schedule", "linear"], r"train.lr_schedule='linear' is not valid"),
    (["--train.max_steps"], r"override --train.max_steps needs a value"),
    (["--model.n_heads", "3"], r"n_heads=3 must divide d_model=16"),
    (["--train.num_threads", "0"], r"train.num_threads=0 must be >= 1"),
])
def test_bad_values(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(minimal(learning_rate=1e-3), override)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file .*nope.yaml' does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(bad)
    bad.write_text("model: 3\n")
    with pytest.raises(ValueError, match="section 'model' must be a mapping"):
        load_config(bad)


def test_vocab_resolution(tmp_path):
    d = tmp_path / "data" / "ds"
    raw = {"model": {"arch": "gpt", "d_model": 16, "n_heads": 2}, "data": {"root": str(tmp_path / "data"),
                                                                          "dataset": "ds"}}
    with pytest.raises(FileNotFoundError, match="model.vocab_size is not set.*meta.json"):
        load_config(raw, resolve_vocab=True)
    assert load_config(raw, resolve_vocab=True, default_vocab_size=65).model.vocab_size == 65
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 42}))
    assert load_config(raw, resolve_vocab=True).model.vocab_size == 42
    assert load_config(raw, ["--model.vocab_size", "100"], resolve_vocab=True).model.vocab_size == 100
    (d / "meta.json").write_text("{broken")
    with pytest.raises(ValueError, match="no readable 'vocab_size'"):
        load_config(raw, resolve_vocab=True)


def test_save_config_round_trip(tmp_path):
    cfg = load_config(minimal(max_steps=7, compile=True), ["--data.data_dir", str(tmp_path),
                                                          "--model.tie_embeddings", "true"])
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    again = load_config(path)
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert again.data.path == tmp_path


def test_dataclass_defaults_validate():
    assert TrainConfig().lr_decay_steps == 2000 and DataConfig().path == Path("data/shakespeare_char")
    with pytest.raises(ValueError, match="train.min_lr must be > 0 with train.lr_schedule='exponential'"):
        TrainConfig(min_lr=0.0, lr_schedule="exponential")
    with pytest.raises(ValueError, match="data.dataset=''"):
        DataConfig(dataset="")


def test_optional_fields_from_strings():
    from energyformer.train.config import coerce

    assert coerce("null", int | None, "x") is None and coerce("None", int | None, "x") is None
    assert coerce("7", int | None, "x") == 7
    assert coerce("none", str | None, "x") is None  # `--model.rope none` (issue found by a user test)
    assert coerce("exact", str | None, "x") == "exact"
    assert coerce("~", str | None, "x") is None
    assert coerce("1e-3", float | str, "x") == 1e-3 and coerce("abc", float | str, "x") == "abc"
    assert coerce([1, 2], tuple[int, ...], "x") == (1, 2) and coerce("[1, 2]", list[int], "x") == [1, 2]
    with pytest.raises(ValueError, match=r"x='abc' must be an integer or null"):
        coerce("abc", int | None, "x")


def test_none_spellings_reach_optional_model_options():
    cfg = load_config(ROOT / "configs/shakespeare_char/cem.yaml", ["--model.rope", "none",
                      "--model.preconditioner", "None"], default_vocab_size=65)
    assert cfg.model.rope is None and cfg.model.preconditioner is None


def test_build_model_from_a_recipe_anywhere_with_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe's data.root ("data") does not exist here
    recipe = ROOT / "configs/shakespeare_char/nrgpt.yaml"
    with pytest.raises(FileNotFoundError, match="--model.vocab_size"):
        build_model(recipe)
    model = build_model(recipe, vocab_size=65, n_steps=2)
    assert model.config.vocab_size == 65 and model.config.n_steps == 2
    cfg = load_config(recipe, default_vocab_size=65, resolve_vocab=True).model
    assert build_model(cfg, n_steps=3).config.n_steps == 3
    assert build_model(cfg.to_dict()).config == cfg
