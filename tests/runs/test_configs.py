"""Recipes and run configs: every YAML under configs/ loads and builds; recipe inheritance,
overrides, types, unknown keys, validation, renamed keys, vocab resolution and the save/load
round trip."""
import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from energyformer import build_model
from energyformer.runs.config import DataConfig, RunConfig, TrainConfig, load_config, save_config
from energyformer.runs.recipe import read_recipe
from energyformer.utils import derived

ROOT = Path(__file__).resolve().parents[2]
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
    given = read_recipe(path)["model"].get("vocab_size")
    if given is None and not (cfg.data.path / "meta.json").exists():
        assert cfg.model.vocab_size == 65
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg
    assert "base" not in yaml.safe_load((tmp_path / "resolved.yaml").read_text())


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
    # YAML-typed values are checked too: an int is a valid float, a float is not an int
    cfg = load_config({"model": {"arch": "gpt", "d_model": 16, "n_heads": 2}, "train": {"learning_rate": 1}})
    assert isinstance(cfg.train.learning_rate, float) and cfg.train.learning_rate == 1.0
    with pytest.raises(ValueError, match=r"model.d_model=16.5 must be an integer"):
        load_config({"model": {"arch": "gpt", "d_model": 16.5, "n_heads": 2}})
    # later overrides win; arch can be overridden
    assert load_config(minimal(), ["--train.seed", "1", "--train.seed", "2"]).train.seed == 2


def test_override_token_forms():
    cfg = load_config(minimal(), ["--data.root=x=y", "--train.max-steps", "7", "--train.seed", "-0"])
    assert cfg.data.root == "x=y" and cfg.train.max_steps == 7 and cfg.train.seed == 0
    with pytest.raises(ValueError, match=r"train.seed=-1 must be >= 0"):  # "-1" is a value, not a flag
        load_config(minimal(), ["--train.seed", "-1"])
    with pytest.raises(ValueError, match="unexpected argument 'oops'"):
        load_config(minimal(), ["oops"])
    with pytest.raises(ValueError, match="must name a section and a key"):
        load_config(minimal(), ["--max_steps", "3"])


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
    (["--train.learning_rate", "nan"], r"train.learning_rate=nan must be a finite number > 0"),
    (["--train.weight_decay", "inf"], r"train.weight_decay=inf must be a finite number >= 0"),
    (["--train.min_lr", "1.0"], r"train.min_lr=1.0 must be <= 0.001"),
    (["--train.tensorboard", "maybe"], r"train.tensorboard='maybe' must be a boolean"),
    (["--train.batch_size", "0"], r"train.batch_size=0 must be >= 1"),
    (["--train.beta2", "1.0"], r"train.beta2=1.0 must be <="),
    (["--train.device", "gpu"], r"train.device='gpu' is not valid"),
    (["--train.device", "cpu:1"], r"train.device='cpu:1' is not valid"),
    (["--train.dtype", "float16"], r"train.dtype='float16' is not valid"),
    (["--train.lr_schedule", "linear"], r"train.lr_schedule='linear' is not valid"),
    (["--train.max_steps"], r"override --train.max_steps needs a value \(an integer\)"),
    (["--train.num_threads", "many"], r"train.num_threads='many' must be an integer or null"),
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
    bad.write_text("model:\n  arch: gpt\n   x: 1\n")  # the file, line and column, in one line
    with pytest.raises(ValueError, match=r"bad\.yaml:3:5: not valid YAML: mapping values are not allowed here$"):
        load_config(bad)
    bad.write_text("model:\n  arch: gpt\n  d_model: 32\n  d_model: 64\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:4:3: .*duplicate key 'd_model' \(first on line 3\)"):
        load_config(bad)
    bad.write_bytes(b"model:\n  arch: gpt\xff\n")
    with pytest.raises(ValueError, match=r"bad\.yaml' is not UTF-8 text \(byte 0xff on line 2\)"):
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
    meta = {"format_version": 1, "tokenizer": "char", "vocab_size": 42, "n_train": 10, "n_val": 2}
    (d / "meta.json").write_text(json.dumps(meta))
    assert load_config(raw, resolve_vocab=True).model.vocab_size == 42
    assert load_config(raw, ["--model.vocab_size", "100"], resolve_vocab=True).model.vocab_size == 100
    (d / "meta.json").write_text("{broken")  # read by energyformer.data.load_meta, the one reader
    with pytest.raises(ValueError, match=r"meta.json is corrupt"):
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
    cem = ROOT / "configs/shakespeare_char/cem.yaml"
    for spelling in ("null", "None", "none", "~"):
        assert load_config(cem, ["--model.head_dim", spelling]).model.head_dim == 128 // 4  # null: derived
        assert load_config(cem, ["--model.rope", spelling]).model.rope is None  # `--model.rope none`
    assert load_config(cem, ["--model.head_dim", "16"]).model.head_dim == 16
    assert load_config(cem, ["--model.rope", "llama"]).model.rope == "llama"
    assert load_config(cem, ["--model.attn_step_size", "1e-1"]).model.attn_step_size == 0.1
    with pytest.raises(ValueError, match=r"model.head_dim='abc' must be an integer or null"):
        load_config(cem, ["--model.head_dim", "abc"])
    assert load_config(minimal(), ["--data.dataset", "none"]).data.dataset == "none"  # a str field keeps it


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


# --------------------------------------------------------------------------------------------
# recipe inheritance (base:) and the out_dir default
# --------------------------------------------------------------------------------------------

def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_recipe_inheritance_chain_merges_deeply(tmp_path):
    write(tmp_path / "a.yaml", {"model": {"arch": "cem", "d_model": 32, "n_heads": 2, "n_layers": 1,
                                          "rope": "exact"},
                                "train": {"max_steps": 5, "batch_size": 4}})
    write(tmp_path / "sub" / "b.yaml", {"base": "../a.yaml", "model": {"n_steps": 2, "rope": None},
                                        "train": {"max_steps": 6}})
    c = write(tmp_path / "sub" / "c.yaml", "base: b.yaml\nmodel:\n  interaction: diag_shared\ntrain:\n")
    cfg = load_config(c)
    assert (cfg.model.d_model, cfg.model.n_steps, cfg.model.interaction) == (32, 2, "diag_shared")
    assert cfg.model.rope is None  # the child's null wins
    assert (cfg.train.max_steps, cfg.train.batch_size) == (6, 4)
    assert cfg.train.out_dir == "out/c"  # named after the recipe given, not its bases
    assert load_config(c, ["--train.max_steps", "9"]).train.max_steps == 9
    save_config(cfg, tmp_path / "resolved.yaml")
    assert "base" not in yaml.safe_load((tmp_path / "resolved.yaml").read_text())
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_recipe_inheritance_errors(tmp_path):
    write(tmp_path / "x.yaml", {"base": "y.yaml", "model": {"arch": "gpt"}})
    write(tmp_path / "y.yaml", {"base": "z.yaml"})
    write(tmp_path / "z.yaml", {"base": "x.yaml"})
    with pytest.raises(ValueError, match=r"recipe inheritance cycle: x.yaml -> y.yaml -> z.yaml -> x.yaml") as e:
        load_config(tmp_path / "x.yaml")
    assert "\n" not in str(e.value)
    write(tmp_path / "self.yaml", {"base": "self.yaml"})
    with pytest.raises(ValueError, match="cycle: self.yaml -> self.yaml"):
        load_config(tmp_path / "self.yaml")
    write(tmp_path / "orphan.yaml", {"base": "missing.yaml"})
    with pytest.raises(FileNotFoundError, match=r"base recipe .*missing.yaml.*orphan.yaml"):
        load_config(tmp_path / "orphan.yaml")
    write(tmp_path / "badbase.yaml", {"base": 3})
    with pytest.raises(ValueError, match="base=3 .* must be the file name of another recipe"):
        load_config(tmp_path / "badbase.yaml")


def test_out_dir_defaults_to_the_recipe_stem(tmp_path):
    path = write(tmp_path / "my_run.yaml", minimal())
    assert load_config(path).train.out_dir == "out/my_run"
    assert load_config(path, ["--train.out_dir", "elsewhere"]).train.out_dir == "elsewhere"
    assert load_config(minimal()).train.out_dir == "out/run"  # no recipe file: the old default
    assert load_config(write(tmp_path / "set.yaml", minimal(out_dir="mine"))).train.out_dir == "mine"


CEM_ABLATIONS = {  # recipe -> the model fields in which it differs from cem.yaml
    "cem_t2": {"n_steps": 2},
    "cem_diag_shared": {"interaction": "diag_shared"},
    "cem_diag_per_head": {"interaction": "diag_per_head"},
    "cem_diag_only": {"interaction": "diag_only", "rope": None},
    "cem_precond": {"preconditioner": "diag_lowrank", "preconditioner_rank": 8},
    "cem_full": {"n_steps": 2, "interaction": "diag_shared", "preconditioner": "diag_lowrank",
                 "preconditioner_rank": 8},
}


@pytest.mark.parametrize("name", sorted(CEM_ABLATIONS))
def test_cem_ablations_differ_from_cem_only_in_their_option(name):
    base = load_config(ROOT / "configs/shakespeare_char/cem.yaml", default_vocab_size=65)
    cfg = load_config(ROOT / f"configs/shakespeare_char/{name}.yaml", default_vocab_size=65)
    assert cfg.model == derived.replace(base.model, **CEM_ABLATIONS[name])  # n_steps: attn/mlp_n_steps follow
    assert cfg.data == base.data
    assert cfg.train == dataclasses.replace(base.train, out_dir=f"out/{name}")
    assert read_recipe(ROOT / f"configs/shakespeare_char/{name}.yaml")["train"].get("out_dir") is None


# --------------------------------------------------------------------------------------------
# renamed (deprecated) model keys
# --------------------------------------------------------------------------------------------

@pytest.fixture
def gpt_renames_width(monkeypatch):
    """GPTConfig with a renamed key ``width`` → ``d_model`` (what the models' ``upgrade_dict`` does)."""
    from energyformer.models.gpt import GPTConfig

    seen = []

    def upgrade_dict(cls, d):
        seen.append(dict(d))
        d = dict(d)
        if "width" in d:
            warnings.warn("model key 'width' is deprecated; use 'd_model'", FutureWarning, stacklevel=2)
            d["d_model"] = d.pop("width")
        return d

    monkeypatch.setattr(GPTConfig, "renamed_keys", {"width": "d_model"}, raising=False)
    monkeypatch.setattr(GPTConfig, "upgrade_dict", classmethod(upgrade_dict), raising=False)
    return seen


def test_renamed_keys_are_upgraded_from_recipes_and_overrides(gpt_renames_width, tmp_path):
    raw = {"model": {"arch": "gpt", "width": 16, "n_heads": 2, "n_layers": 1}}
    with pytest.warns(FutureWarning, match="'width' is deprecated; use 'd_model'"):
        assert load_config(raw).model.d_model == 16
    # the override's key is part of the mapping the config class upgrades
    with pytest.warns(FutureWarning, match="'width'"):
        assert load_config(minimal(), ["--model.width", "32"]).model.d_model == 32
    assert gpt_renames_width[-1]["width"] == "32" and "arch" not in gpt_renames_width[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new key: no warning
        assert load_config(minimal(), ["--model.d_model", "32"]).model.d_model == 32


def test_default_recipe_demonstrates_descent_and_the_reference_keeps_the_free_eta():
    """`make run`'s nrgpt.yaml trains η = c·diag(γ) (provable descent, docs/nrgpt.md §5); the
    reference recipe, which extends it, restates the reference code's free η (issue 27, item 8)."""
    # the bundled corpus' 74 characters, stated: whether data/ is prepared here must not matter
    default = load_config(ROOT / "configs/shakespeare_char/nrgpt.yaml", ["--model.vocab_size", "74"])
    assert default.model.eta_param == "c_diag_gamma" and default.model.norm == "layernorm"
    assert sum(p.numel() for p in build_model(default.model).parameters()) == 233_168
    ref = load_config(ROOT / "configs/shakespeare_char/nrgpt_reference.yaml", default_vocab_size=65,
                      resolve_vocab=True).model
    assert (ref.eta_param, ref.mask, ref.norm) == ("full", "inclusive", "layernorm_frozen")


def test_old_key_override_replaces_the_recipes_new_key():
    """nrgpt.yaml says eta_param: c_diag_gamma; an override under the old name step_size must win, not clash."""
    with pytest.warns(FutureWarning, match="model.step_size is deprecated"):
        cfg = load_config(ROOT / "configs/shakespeare_char/nrgpt.yaml", ["--model.step_size", "c_identity"],
                          default_vocab_size=65, resolve_vocab=True)
    assert cfg.model.eta_param == "c_identity"
    with pytest.raises(ValueError, match="same option"):  # both spellings in one place stay an error
        load_config(ROOT / "configs/shakespeare_char/nrgpt.yaml",
                    ["--model.step_size", "full", "--model.eta_param", "full"], default_vocab_size=65,
                    resolve_vocab=True)


@pytest.mark.parametrize("override, match", [
    (["--train.depth_sampler", "poisson"], r"train.depth_sampler='poisson' is not valid; expected one of 'fixed', "
                                           r"'poisson_lognormal', 'uniform'"),
    (["--train.depth_mean", "4"], r"train.depth_mean=4.0 is only read by train.depth_sampler 'poisson_lognormal'; "
                                  r"got train.depth_sampler='fixed'"),
    (["--train.depth_max", "4"], r"train.depth_max=4 is only read by train.depth_sampler 'poisson_lognormal' or "
                                 r"'uniform'; got train.depth_sampler='fixed'"),
    (["--train.depth_sampler", "poisson_lognormal"], r"train.depth_sampler='poisson_lognormal' needs "
                                                     r"train.depth_mean"),
    (["--train.depth_sampler", "poisson_lognormal", "--train.depth_mean", "1"], r"train.depth_mean=1.0 must be > 1"),
    (["--train.depth_sampler", "poisson_lognormal", "--train.depth_mean", "inf"],
     r"train.depth_mean=inf must be a finite number > 1"),
    (["--train.depth_sampler", "poisson_lognormal", "--train.depth_mean", "6", "--train.depth_max", "5"],
     r"train.depth_max=5 must be >= train.depth_mean=6"),
    (["--train.depth_sampler", "poisson_lognormal", "--train.depth_mean", "6", "--train.depth_min", "2"],
     r"train.depth_min=2 is only read by train.depth_sampler 'uniform'; got train.depth_sampler='poisson_lognormal'"),
    (["--train.depth_sampler", "uniform", "--train.depth_max", "4"], r"train.depth_sampler='uniform' needs "
                                                                     r"train.depth_min \(an integer >= 1\)"),
    (["--train.depth_sampler", "uniform", "--train.depth_min", "0", "--train.depth_max", "4"],
     r"train.depth_min=0 must be >= 1"),
    (["--train.depth_sampler", "uniform", "--train.depth_min", "5", "--train.depth_max", "4"],
     r"train.depth_min=5 must be <= train.depth_max=4"),
    (["--train.depth_sampler", "uniform", "--train.depth_min", "5", "--train.depth_mean", "4"],
     r"train.depth_mean=4.0 is only read by train.depth_sampler 'poisson_lognormal'; got train.depth_sampler="
     r"'uniform'"),
    (["--train.backprop_steps", "0"], r"train.backprop_steps=0 must be >= 1"),
    (["--train.backprop_steps", "two"], r"train.backprop_steps='two' must be an integer or null"),
])
def test_bad_depth_values(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(minimal(learning_rate=1e-3), override)


def test_a_depth_key_without_its_sampler_says_to_give_the_sampler():
    """Resuming a randomized-depth run from a recipe that says ``fixed`` with only
    ``--train.depth_max`` fails at config load: the message says to give the sampler too."""
    with pytest.raises(ValueError, match=r"give train.depth_sampler too: resuming a run, the sampler and its keys"):
        load_config(minimal(learning_rate=1e-3), ["--train.depth_max", "2"])


def test_depth_keys_default_to_todays_training_and_round_trip(tmp_path):
    tc = load_config(minimal()).train
    assert (tc.depth_sampler, tc.depth_mean, tc.depth_min, tc.depth_max, tc.backprop_steps) == \
        ("fixed", None, None, None, None)
    cfg = load_config(minimal(), ["--train.depth_sampler", "poisson_lognormal", "--train.depth_mean", "6",
                                  "--train.depth_max", "12", "--train.backprop_steps", "2"])
    assert (cfg.train.depth_mean, cfg.train.depth_max, cfg.train.backprop_steps) == (6.0, 12, 2)
    again = load_config(save_config(cfg, tmp_path / "config.yaml"))
    assert again == cfg


def test_a_saved_config_used_as_a_recipe_derives_again_from_its_overrides(tmp_path):
    """A run's config.yaml holds every derived value; overriding an input re-derives them (a value
    that differs from its rule, or one the overrides name, is kept)."""
    run = {"model": {"arch": "cem", "vocab_size": 65, "d_model": 64, "n_heads": 4, "n_layers": 2, "n_steps": 2},
           "data": {}, "train": {"max_steps": 1000, "lr_schedule": "wsd", "learning_rate": 1e-2}}
    saved = tmp_path / "config.yaml"
    save_config(load_config(run), saved)
    on_disk = yaml.safe_load(saved.read_text())
    assert on_disk["model"]["attn_n_steps"] == 2 and on_disk["train"]["cooldown_steps"] == 100  # concrete

    cfg = load_config(saved, ["--model.n_steps", "3", "--train.max_steps", "2000"])
    assert (cfg.model.attn_n_steps, cfg.model.mlp_n_steps) == (3, 3)
    assert (cfg.train.lr_decay_steps, cfg.train.cooldown_steps, cfg.train.min_lr) == (2000, 200, 1e-3)
    assert "attn_n_steps" not in cfg.explicit["model"]  # derived, so a resume treats it as derived
    # without overrides the file reads back equal
    assert load_config(saved) == load_config(run)

    # a value the recipe set away from its rule stays, and so does one the overrides name
    on_disk["model"]["mlp_n_steps"] = 1
    saved.write_text(yaml.safe_dump(on_disk))
    cfg = load_config(saved, ["--model.n_steps", "4"])
    assert (cfg.model.attn_n_steps, cfg.model.mlp_n_steps) == (4, 1)
    cfg = load_config(saved, ["--model.n_steps", "4", "--model.attn_n_steps", "2"])
    assert (cfg.model.attn_n_steps, cfg.model.mlp_n_steps) == (2, 1)


def test_a_hand_written_recipe_keeps_the_derived_values_it_names_under_overrides(tmp_path):
    """Only a section written in full (a saved config.yaml) derives again: a hand-written recipe's
    min_lr 1e-4 and d_ff 352 are the author's, even where they equal the rule (lr / 10, the rule's d_ff)."""
    recipe = tmp_path / "llama.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"arch": "llama", "vocab_size": 65, "d_model": 128, "n_heads": 4, "n_layers": 2, "d_ff": 352},
        "train": {"learning_rate": 1e-3, "min_lr": 1e-4}}))
    assert load_config(recipe).model.d_ff == 352 and load_config(recipe).train.min_lr == 1e-4
    cfg = load_config(recipe, ["--train.learning_rate", "3e-3", "--model.d_model", "192"])
    assert (cfg.train.min_lr, cfg.model.d_ff) == (1e-4, 352)


@pytest.mark.parametrize("model, override, match", [
    ({"arch": "gpt"}, ["--model.d_model", "-4"], r"^model\.d_model=-4 must be >= 1"),
    ({"arch": "gpt"}, ["--model.n_heads", "3"], r"^model\.n_heads=3 must divide d_model=16"),
    ({"arch": "cem", "interaction": "quad"}, [], r"^model\.interaction='quad' is not valid; expected one of 'lowrank'"),
    ({"arch": "cem"}, ["--model.preconditioner", "foo"], r"^model\.preconditioner='foo' is not valid"),
])
def test_a_model_value_error_names_its_key_as_the_recipe_spells_it(model, override, match):
    """``model.`` like ``train.``/``data.`` keys (the config classes built in Python name the bare field)."""
    recipe = minimal()
    recipe["model"].update(model)
    with pytest.raises(ValueError, match=match):
        load_config(recipe, override)
    from energyformer.models.cem import CEMConfig
    with pytest.raises(ValueError, match=r"^interaction='quad' is not valid"):
        CEMConfig(vocab_size=11, d_model=16, n_heads=2, interaction="quad")


@pytest.mark.parametrize("override, match", [
    (["--train.lr_schedule", "cosin"], r"train.lr_schedule='cosin' is not valid \(did you mean 'cosine'\?\); expected"),
    (["--model.arch", "lama"], r"model.arch='lama' is not valid \(did you mean 'llama'\?\); expected"),
    (["--model.arch", "cem", "--model.interaction", "diag_shard"],
     r"model.interaction='diag_shard' is not valid \(did you mean 'diag_shared'\?\); expected"),
    (["--model.arch", "cem", "--model.interaction", "zzz"], r"model.interaction='zzz' is not valid; expected"),
])
def test_a_mistyped_value_names_the_closest_choice(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(minimal(), override)
