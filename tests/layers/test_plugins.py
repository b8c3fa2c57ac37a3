"""Adding a parameterization is one registered class: a toy CEM interaction and a toy NRGPT step map,
each defined in a few lines below, train end to end through the CLI with no other change.

The two snippets are the examples of docs/architecture.md ("Adding an option").
"""
import re
import sys

import pytest
import torch
import torch.nn as nn
import yaml
from helpers import make_data_dir, tiny_config_dict

from energyformer.cli import main
from energyformer.layers.cem_options import INTERACTIONS, DiagSharedInteraction
from energyformer.layers.step_maps import STEP_MAPS, StepMap


# --- snippet 1: a CEM interaction (docs/architecture.md) ------------------------------------------
class WarmDiagInteraction(DiagSharedInteraction):
    """D+LR with a shared diagonal that starts at 0.1 instead of 0 (a toy initialisation study)."""

    def _make_diag(self, d_model: int, n_heads: int) -> nn.Parameter:
        return nn.Parameter(torch.full((d_model,), 0.1))


# --- snippet 2: an NRGPT step map (docs/architecture.md) -------------------------------------------
class FixedScalarMap(StepMap):
    """η = s·I with s fixed (a buffer, not learned)."""

    def __init__(self, d_model, scale=None, *, rank=8, norm=None):
        super().__init__(d_model, scale, rank=rank, norm=norm)
        self.register_buffer("s", torch.tensor(self.scale))

    def reset_parameters(self):
        pass

    def forward(self, v):
        return self.s.to(v.dtype) * v

    def matrix(self):
        return self.s * torch.eye(self.d_model, dtype=self.s.dtype, device=self.s.device)


@pytest.fixture
def toy_entries():
    INTERACTIONS.register("warm_diag")(WarmDiagInteraction)
    STEP_MAPS.register("fixed_scalar")(FixedScalarMap)
    yield
    INTERACTIONS.unregister("warm_diag")
    STEP_MAPS.unregister("fixed_scalar")


def _recipe(tmp_path, model):
    data = make_data_dir(tmp_path / "data" / "toy")
    recipe = tiny_config_dict(data, None, {"d_model": 16, "n_heads": 2, **model}, max_steps=4, eval_interval=2,
                              warmup_steps=1, learning_rate=1e-3)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("model,check", [
    ({"arch": "cem", "n_layers": 1, "d_ff": 24, "interaction": "warm_diag", "rope": "exact"},
     lambda sd: [k for k in sd if k.endswith("attn.interaction.diag")]),
    ({"arch": "nrgpt", "n_steps": 2, "eta_param": "fixed_scalar", "c_init": 0.2},
     lambda sd: [k for k in sd if k == "block.eta.s"]),
])
def test_toy_entries_train_through_the_cli(tmp_path, toy_entries, model, check, capsys):
    out = tmp_path / "run"
    rc = main(["train", str(_recipe(tmp_path, model)), "--train.out_dir", str(out)])
    assert rc == 0, capsys.readouterr().err
    from safetensors.torch import load_file

    weights = load_file(str(out / "model.safetensors"))
    assert check(weights), sorted(weights)
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert saved.get("interaction", saved.get("eta_param")) in ("warm_diag", "fixed_scalar")


def test_unregistered_name_is_a_one_line_cli_error(tmp_path, capsys):
    rc = main(["train", str(_recipe(tmp_path, {"arch": "cem", "interaction": "warm_diag"}))])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "interaction='warm_diag'" in err and "lowrank" in err


# --- loading plugins: entry points, imports: of a run config ---------------------------------------
def _toy_module(tmp_path, name, body):
    (tmp_path / f"{name}.py").write_text(body)
    return name


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    INTERACTIONS.unregister("warm_diag_plugin")
    for m in ("toy_plugin_ok", "toy_plugin_ep", "toy_plugin_bad"):
        sys.modules.pop(m, None)


_TOY = ("from energyformer.layers.cem_options import INTERACTIONS, DiagSharedInteraction\n"
        "INTERACTIONS.register('warm_diag_plugin')(type('W', (DiagSharedInteraction,), {}))\n")


def test_imports_of_a_config_are_loaded_before_the_model_and_recorded(plugin_path, tmp_path):
    from energyformer.runs.config import load_config

    mod = _toy_module(plugin_path, "toy_plugin_ok", _TOY)
    cfg = load_config({"imports": [mod], "model": {"arch": "cem", "vocab_size": 11, "interaction": "warm_diag_plugin"}})
    assert cfg.imports == [mod] and cfg.to_dict()["imports"] == [mod]
    assert "imports" not in load_config({"model": {"arch": "cem", "vocab_size": 11}}).to_dict()
    extra = load_config({"model": {"arch": "cem", "vocab_size": 11}}, imports=[mod, mod])
    assert extra.imports == [mod]


def test_a_plugin_that_fails_is_one_line_naming_it(plugin_path):
    from energyformer.utils.plugins import PluginError, load_plugins

    _toy_module(plugin_path, "toy_plugin_bad", "raise RuntimeError('boom\\nsecond line')\n")
    for name in ("toy_plugin_bad", "no_such_plugin_module"):
        with pytest.raises(PluginError, match=name) as err:
            load_plugins([name])
        assert "\n" not in str(err.value) and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="list of module names"):
        load_plugins("toy_plugin_bad")


def test_check_imports_merges_the_lists_in_order_and_names_a_bad_one():
    from energyformer.utils.plugins import check_imports

    assert check_imports(None) == [] and check_imports(["b", " a "], None, ("a", "c")) == ["b", "a", "c"]
    for bad in ("mod", "", {"mod": 1}, False):
        with pytest.raises(ValueError, match=re.escape(f"imports={bad!r} must be a list of module names")):
            check_imports(["ok"], bad)
    for bad, what in ((["mod", ""], "an empty module name (entry 2)"), ([" "], "an empty module name (entry 1)"),
                      ([3], "3, not a module name (entry 1)")):
        with pytest.raises(ValueError, match=re.escape(f"imports={bad!r} has {what}; expected a list of module")):
            check_imports(["ok"], bad)
    with pytest.raises(ValueError, match=r"^--import '' is an empty module name; expected a module name, e\.g\. "
                                         r"--import my_options$"):
        check_imports(["ok", ""], where="--import")


def test_a_recipe_whose_imports_are_not_a_list_is_refused(plugin_path):
    """``imports: ""`` was read as no imports; ``[""]`` names its empty entry."""
    from energyformer.runs.config import load_config

    model = {"arch": "cem", "vocab_size": 11}
    for imports, message in (("", "imports='' must be a list of module names"),
                             ([""], "imports=[''] has an empty module name (entry 1)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config({"imports": imports, "model": model})
    assert load_config({"imports": None, "model": model}).imports == []
    assert load_config({"imports": [], "model": model}).imports == []


def test_an_empty_imports_key_in_a_recipe_file_means_none(plugin_path, tmp_path):
    """``imports:`` with nothing after it (YAML null) is no imports, not "imports={} must be a list"; in a
    recipe that extends another, the base's imports stay."""
    from energyformer.runs.config import load_config

    (tmp_path / "empty.yaml").write_text("imports:\nmodel:\n  arch: cem\n  vocab_size: 11\n")
    assert load_config(tmp_path / "empty.yaml").imports == []
    (tmp_path / "base.yaml").write_text("imports: [json]\nmodel:\n  arch: cem\n  vocab_size: 11\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nimports:\n")
    assert load_config(tmp_path / "child.yaml").imports == ["json"]
    assert load_config({"base": str(tmp_path / "base.yaml"), "imports": None}).imports == ["json"]


def test_a_plugin_error_shows_its_own_exception_and_says_where_the_module_was_given(plugin_path, tmp_path):
    """The module's own error (type and message) in every case; the PYTHONPATH hint only when the
    module itself is not found; ``where`` names the source (``--import``, a run's config.yaml)."""
    from energyformer.runs.rundir import load_run_plugins
    from energyformer.utils.plugins import PluginError, load_plugins

    _toy_module(plugin_path, "toy_plugin_bad", "raise RuntimeError('boom\\nsecond line')\n")
    _toy_module(plugin_path, "toy_plugin_needs", "import no_such_dependency_xyz\n")  # its dependency is missing
    hint = "its directory must be on PYTHONPATH"
    with pytest.raises(PluginError) as err:
        load_plugins(["toy_plugin_bad"])
    assert str(err.value) == "imports: plugin module 'toy_plugin_bad' failed to import (RuntimeError: boom second line)"
    with pytest.raises(PluginError) as err:
        load_plugins(["toy_plugin_needs"], where="--import")
    assert str(err.value) == ("--import: plugin module 'toy_plugin_needs' failed to import (ModuleNotFoundError: "
                              "No module named 'no_such_dependency_xyz')")
    for name, missing in (("no_such_plugin_module", "no_such_plugin_module"),
                          ("no_such_pkg_xyz.sub", "no_such_pkg_xyz")):
        with pytest.raises(PluginError) as err:
            load_plugins([name], where="--import")
        assert str(err.value) == (f"--import: plugin module {name!r} failed to import (ModuleNotFoundError: No "
                                  f"module named {missing!r}); {hint} (or the module installed)")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("imports: [no_such_plugin_module]\n")
    with pytest.raises(PluginError, match=re.escape(f"{str(run / 'config.yaml')!r}: imports: plugin module "
                                                    "'no_such_plugin_module' failed to import")):
        load_run_plugins(run)
    (run / "config.yaml").write_text("imports: ''\n")
    with pytest.raises(ValueError, match=re.escape(f"{str(run / 'config.yaml')!r}: imports='' must be a list")):
        load_run_plugins(run)
    # every command that reads a run (sample, info, export, eval, compare: read_run_config) names its file
    from energyformer.commands import sample
    from energyformer.runs.config import load_config

    (run / "config.yaml").write_text("imports: [no_such_plugin_module]\nmodel: {arch: gpt, vocab_size: 11}\n")
    with pytest.raises(PluginError, match=re.escape(f"{str(run / 'config.yaml')!r}: imports: plugin module "
                                                    "'no_such_plugin_module' failed to import")):
        sample(str(run), prompt="a", max_new_tokens=1)
    with pytest.raises(PluginError, match=re.escape(f"{str(run / 'config.yaml')!r}: imports:")):
        load_config(run / "config.yaml")
    # a base recipe's imports: named by the base, the file that lists them
    (tmp_path / "base.yaml").write_text("imports: [no_such_plugin_module]\nmodel: {arch: gpt, vocab_size: 11}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain: {max_steps: 3}\n")
    with pytest.raises(PluginError, match=re.escape(f"{str(tmp_path / 'base.yaml')!r}: imports:")):
        load_config(tmp_path / "child.yaml")
    # a file given for a module: the hint names the module
    hint = ("give a module name, not a file: 'myopts', with its directory on PYTHONPATH "
            "(e.g. PYTHONPATH=plugins energyformer --import myopts")
    with pytest.raises(PluginError, match=re.escape(hint)):
        load_plugins(["plugins/myopts.py"], where="--import")


def test_a_run_configs_imports_are_checked_and_imported_by_load_plugins_alone(plugin_path, monkeypatch):
    """One home for "check and import a run's plugin modules": ``load_config`` hands the recipe's
    ``imports`` and its extra ones to ``load_plugins`` and records what it returns; a Hugging Face
    config does the same with its ``imports``; so a bad value reads the same in both."""
    pytest.importorskip("transformers")
    from energyformer.hf import configuration
    from energyformer.runs import config as run_config
    from energyformer.utils import plugins

    mod = _toy_module(plugin_path, "toy_plugin_ok", _TOY)
    calls, real = [], plugins.load_plugins

    def spy(*lists):
        calls.append(lists)
        return real(*lists)

    monkeypatch.setattr(run_config, "load_plugins", spy)
    monkeypatch.setattr(configuration, "load_plugins", spy)
    model = {"arch": "cem", "vocab_size": 11, "interaction": "warm_diag_plugin"}
    cfg = run_config.load_config({"imports": [mod], "model": model}, imports=[f" {mod} "])
    assert calls == [([mod], [f" {mod} "])] and cfg.imports == [mod]
    hf = configuration.config_for(cfg.model, imports=[mod])
    assert calls[1:] == [([mod],)] and hf.imports == [mod]
    messages = []
    for make in (lambda: run_config.load_config({"imports": mod, "model": model}),
                 lambda: configuration.config_for(cfg.model, imports=mod)):
        with pytest.raises(ValueError, match="must be a list of module names") as err:
            make()
        messages.append(str(err.value))
    assert messages == [f"imports={mod!r} must be a list of module names, e.g. [my_options]"] * 2


def test_entry_point_group_is_loaded_once(plugin_path, monkeypatch):
    import importlib.metadata

    from energyformer.utils import plugins

    _toy_module(plugin_path, "toy_plugin_ep", _TOY)
    calls = []

    def fake_entry_points(group):
        calls.append(group)
        return [importlib.metadata.EntryPoint("toy", "toy_plugin_ep", group)]

    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    plugins.load_plugins()
    plugins.load_plugins()
    assert calls == ["energyformer.plugins"] and "warm_diag_plugin" in INTERACTIONS
