"""The one typed parse: ArgParser's conventions, prepare's per-dataset subcommands, `--import`
plugins recorded in the run config, and `energyformer.train.train` choosing the loop by arch."""
import json
import re
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import yaml
from helpers import make_data_dir

from energyformer.cli import main, parse_command_line
from energyformer.runs.parser import ArgParser

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Opts:
    steps: int = 3
    rate: float = 1e-3
    floor: float | None = None
    flag: bool = False
    width: int | None = 8
    rope: str | None = "exact"
    name: str = "x"


def export_like(run_dir: str, as_: str = "energyformer", temperature: float = 1.0, force: bool = False) -> None:
    """A command whose flag is a Python keyword."""


def parse(*argv):
    parser = ArgParser(prog="t")
    parser.add_class_arguments(Opts, "opts")
    return parser.parse_args(list(argv)).opts.as_dict()


def test_conventions_are_hooks_of_the_one_parser():
    assert parse("--opts.flag", "--opts.steps", "4") == {**parse(), "flag": True, "steps": 4}  # bare flag: true
    assert parse("--opts.flag", "false")["flag"] is False
    assert parse("--opts.rate", "-1e-3")["rate"] == -1e-3  # a negative number is a value, not a flag
    assert parse("--opts.rate", "inf")["rate"] == float("inf")
    assert parse("--opts.floor", "-inf")["floor"] == float("-inf")
    assert parse("--opts.rate=NaN")["rate"] != parse("--opts.rate=NaN")["rate"]  # nan
    assert parse("--opts.width", "none")["width"] is None and parse("--opts.rope", "None")["rope"] is None
    assert parse("--opts.name", "none")["name"] == "none"  # a plain str keeps the word
    assert parse("--opts.steps", "-2")["steps"] == -2


@pytest.mark.parametrize("argv, message", [
    (["--opts.steps", "2.5"], "opts.steps='2.5' must be an integer"),
    (["--opts.width", "w"], "opts.width='w' must be an integer or null"),
    (["--opts.steps"], "--opts.steps needs a value (an integer)"),
    (["--opts.stepz", "1"], "unrecognized arguments: --opts.stepz 1"),
])
def test_errors_are_one_line(argv, message):
    with pytest.raises(ValueError) as info:
        parse(*argv)
    assert str(info.value) == message


def test_function_flags_kebab_keyword_and_config():
    parser = ArgParser(prog="t")
    parser.add_function_arguments(export_like, as_positional=True)
    ns = parser.parse_args(["run", "--as", "llama", "--temperature", "-inf", "--force"])
    assert (ns.run_dir, ns.as_, ns.temperature, ns.force) == ("run", "llama", float("-inf"), True)
    parser.config_flag = "config"
    assert parser.parse_args(["--config", "other"]).run_dir == "other"
    with pytest.raises(ValueError, match="unrecognized arguments: --config"):  # only in the recipe's place
        parser.parse_args(["run", "--config", "other"])
    with pytest.raises(ValueError, match=r"^--temperature='warm' must be a number$"):
        parser.parse_args(["run", "--temperature", "warm"])


@pytest.mark.parametrize("dataset, settings", [("listops", "ListOpsSettings"), ("gp", "GPSettings")])
def test_prepare_flags_come_from_the_settings_dataclass(dataset, settings, capsys):
    import importlib

    cls = getattr(importlib.import_module(f"energyformer.data.{dataset}"), settings)
    assert main(["prepare", dataset, "--help"]) == 0
    out = capsys.readouterr().out
    for f in fields(cls):
        assert f"--{f.name}" in out
    name, kwargs = parse_command_line(["prepare", dataset, "--seed", "3", "--force"])
    assert name == "prepare" and kwargs["name"] == dataset and kwargs["seed"] == 3 and kwargs["force"] is True


def test_prepare_subcommands(tmp_path, capsys):
    assert main(["prepare", "gp", "--out", str(tmp_path / "gp"), "--x-dim", "3", "--n_train", "8", "--n_val", "4",
                 "--n_test", "4", "--n_points", "4"]) == 0
    assert json.loads((tmp_path / "gp" / "meta.json").read_text())["settings"]["x_dim"] == 3
    src = tmp_path / "corpus.txt"
    src.write_text("to be or not to be, that is the question.\n" * 20)
    assert main(["prepare", "text", str(src), "--out", str(tmp_path / "t")]) == 0  # the file as a positional
    assert (tmp_path / "t" / "train.bin").is_file()
    capsys.readouterr()
    assert main(["prepare", "listops", "--tokenizer", "gpt2"]) == 2  # english's flag is not listops's
    assert "unrecognized arguments: --tokenizer gpt2" in capsys.readouterr().err


PLUGIN = '''
import os
from pathlib import Path
Path(os.environ["PLUGIN_MARK"]).write_text(__name__)
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "my_plugin_mod.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path / "plug"))
    monkeypatch.setenv("PLUGIN_MARK", str(tmp_path / "mark"))
    yield tmp_path
    sys.modules.pop("my_plugin_mod", None)


def tiny_recipe(plugin: Path) -> Path:
    """A one-step gpt recipe under ``plugin`` that trains into ``plugin / "run"``."""
    recipe = plugin / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"arch": "gpt", "d_model": 16, "n_layers": 1, "n_heads": 2, "block_size": 8},
        "data": {"data_dir": str(make_data_dir(plugin / "data"))},
        "train": {"out_dir": str(plugin / "run"), "max_steps": 1, "batch_size": 2, "eval_interval": 1,
                  "eval_iters": 1, "warmup_steps": 0, "device": "cpu"}}))
    return recipe


def test_import_flag_loads_the_plugin_and_the_run_records_it(plugin, capsys):
    recipe = tiny_recipe(plugin)
    assert main(["--import", "my_plugin_mod", "train", str(recipe)]) == 0
    assert (plugin / "mark").read_text() == "my_plugin_mod"
    saved = yaml.safe_load((plugin / "run" / "config.yaml").read_text())
    assert saved["imports"] == ["my_plugin_mod"]
    (plugin / "mark").unlink()
    # a fresh process reading the run's config imports the plugin again
    code = f"from energyformer.runs import read_run_config; read_run_config({str(plugin / 'run')!r})"
    env = {"PYTHONPATH": f"{plugin / 'plug'}:{ROOT}", "PLUGIN_MARK": str(plugin / "mark"), "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert (plugin / "mark").read_text() == "my_plugin_mod"


def test_import_flag_after_the_command_is_the_same(plugin, capsys):
    """``--import MODULE`` is taken after the command too (it was read as an unknown ``--import_``)."""
    recipe = tiny_recipe(plugin)
    assert main(["train", str(recipe), "--import", "my_plugin_mod", "--train.max_steps", "1"]) == 0
    assert (plugin / "mark").read_text() == "my_plugin_mod"
    assert yaml.safe_load((plugin / "run" / "config.yaml").read_text())["imports"] == ["my_plugin_mod"]
    capsys.readouterr()
    assert main(["info", str(recipe), "--import=no_such_plugin_xyz"]) == 2
    assert "'no_such_plugin_xyz'" in capsys.readouterr().err
    for argv in (["info", str(recipe), "--import"], ["--import"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == "error: --import needs a value (a module name, e.g. --import my_options)\n"


def test_unknown_plugin_is_one_error_line(capsys):
    assert main(["--import", "no_such_plugin_xyz", "info", "missing.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --import: plugin module 'no_such_plugin_xyz' failed to import")
    assert err.count("\n") == 1 and "its directory must be on PYTHONPATH" in err


def test_train_dispatches_on_the_arch(monkeypatch):
    import energyformer.train.loop as loop
    import energyformer.train.regression as regression
    from energyformer.runs.config import load_config
    from energyformer.train import train

    called = []
    monkeypatch.setattr(regression, "train_regressor", lambda cfg, progress=None: called.append("regression"))
    monkeypatch.setattr(loop, "train", lambda cfg, progress=None: called.append("language model"))
    train(load_config({"model": {"arch": "regressor", "d_model": 16, "n_heads": 2, "n_layers": 1}}))
    train(load_config({"model": {"arch": "gpt", "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 5}}))
    assert called == ["regression", "language model"]


def test_recipe_values_follow_the_same_conventions():
    from energyformer.runs.config import load_config

    model = {"arch": "cem", "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 5, "rope": "none"}
    assert load_config({"model": model}).model.rope is None
    with pytest.raises(ValueError, match=r"^train\.learning_rate=inf must be a finite number > 0\.0$"):
        load_config({"model": model, "train": {"learning_rate": "inf"}})  # YAML reads `inf` as a string


def test_an_integer_option_takes_scientific_notation(tmp_path):
    """`--train.max_steps 1e9` is the integer 10**9 (on the command line and in a recipe);
    a number that is not whole stays a one-line error."""
    from energyformer.runs.config import load_config

    base = {"model": {"arch": "gpt", "vocab_size": 11, "block_size": 8, "d_model": 16, "n_layers": 1,
                      "n_heads": 2}, "train": {"out_dir": str(tmp_path)}}
    for tokens in (["--train.max_steps", "1e9"], ["--train.max_steps=1E+9"]):
        cfg = load_config(base, tokens)
        assert cfg.train.max_steps == 10 ** 9 and type(cfg.train.max_steps) is int
    assert load_config({**base, "train": {"out_dir": str(tmp_path), "max_steps": 1.0e+4}}).train.max_steps == 10000
    with pytest.raises(ValueError, match=r"train.max_steps.*must be an integer") as e:
        load_config(base, ["--train.max_steps", "1.5e0"])
    assert "\n" not in str(e.value)


def test_help_shows_a_blank_string_default_as_its_literal(capsys):
    assert main(["inspect", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the help is wrapped to the terminal
    assert "type: str, default: '\\n')" in out  # --prompt's newline, not an empty "default: "
    assert "type: str, default: auto)" in out  # a printable string default stays as it was


def test_a_command_line_without_a_command_lists_every_command_with_a_usage_line(capsys):
    from energyformer.cli import COMMANDS
    from energyformer.commands import _prepare_table

    for argv, names, noun in (([], COMMANDS, "command"), (["--import", "json"], COMMANDS, "command"),
                              (["prepare"], _prepare_table(), "dataset")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        prog = " ".join(["energyformer", *argv[:1]]) if argv[:1] == ["prepare"] else "energyformer"
        assert len(err) == 1 and err[0].startswith(f"error: {prog} needs a {noun}, one of: {', '.join(names)} ")
        assert f"(usage: {prog} [options] {noun.upper()} ...;" in err[0]


@pytest.mark.parametrize("tokens, message", [
    (["--train.max_steps", "1e400"], "train.max_steps='1e400' is too large; expected an integer of magnitude at most "
                                     "2**63 - 1 (9223372036854775807)"),
    (["--train.max_steps=1e30"], "train.max_steps='1e30' is too large; expected an integer"),
    (["--train.max-steps", "-1e30"], "train.max_steps='-1e30' is too large; expected an integer"),
    (["--train.max_steps", "123456789012345678901234567890"], "train.max_steps='123456789012345678901234567890' is "
                                                              "too large; expected an integer"),
    (["--train.max_steps", "1.5e0"], "train.max_steps='1.5e0' must be an integer"),
    (["--train.max_steps", "1.5"], "train.max_steps='1.5' must be an integer"),
    (["--train.learning_rate", "1e400"], "train.learning_rate='1e400' is too large; expected a number of magnitude "
                                         "at most 1.798e+308 (or inf)"),
])
def test_number_errors_name_the_value_as_typed(tmp_path, tokens, message):
    from energyformer.runs.config import load_config

    base = {"model": {"arch": "gpt", "vocab_size": 11, "block_size": 8, "d_model": 16, "n_layers": 1,
                      "n_heads": 2}, "train": {"out_dir": str(tmp_path)}}
    with pytest.raises(ValueError) as info:
        load_config(base, tokens)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)
    assert load_config(base, ["--train.max_steps", "9.2e18"]).train.max_steps == 9_200_000_000_000_000_000


@pytest.mark.parametrize("argv, message", [
    (["sample", "run", "--max-new-tokens", "2.5e0"], "--max-new-tokens='2.5e0' must be an integer"),
    (["sample", "run", "--top-k=1.5"], "--top-k='1.5' must be an integer or null"),
    (["sample", "run", "--max_new_tokens", "1e30"], "--max_new_tokens='1e30' is too large; expected an integer"),
    (["sample", "run", "--temperature", "1e999"], "--temperature='1e999' is too large; expected a number"),
    (["prepare", "gp", "--n-train", "1e30"], "--n-train='1e30' is too large; expected an integer"),
])
def test_flag_errors_name_the_flag_and_the_value_as_typed(argv, message):
    with pytest.raises(ValueError) as info:
        parse_command_line(argv)
    assert str(info.value).startswith(message), str(info.value)


def test_the_help_of_a_recipe_marks_the_derived_keys(tmp_path, capsys):
    """``train RECIPE --help``: a key whose default is derived from others says from which (its rule's
    inputs); one the recipe gives shows that value and what null would mean."""
    from energyformer.models.cem import CEMConfig
    from energyformer.models.nrgpt import NRGPTConfig
    from energyformer.runs.config import run_config_parser

    def shown(parser):
        return " ".join(parser.format_help().split())

    text = shown(run_config_parser(CEMConfig))
    for key, reads in (("model.head_dim", "d_model, n_heads"), ("model.d_ff", "d_model"),
                       ("model.attn_n_steps", "n_steps"), ("train.min_lr", "learning_rate"),
                       ("train.lr_decay_steps", "max_steps"), ("train.cooldown_steps", "lr_schedule, lr_decay_steps"),
                       ("train.ckpt_interval", "eval_interval")):
        one_option = rf"--{re.escape(key)} [A-Z_]+ (?:(?!\s\[?--).)*?"  # its help, up to the next option
        assert re.search(one_option + rf"\(type: [^()]*, default: derived from {reads}\)", text), key
    assert "--model.n_steps N_STEPS (type: int, default: 1)" in text  # not derived
    assert "default: auto (derived from preset)" in shown(run_config_parser(NRGPTConfig))  # model.norm's sentinel
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"arch": "cem", "vocab_size": 11, "d_ff": 40}}))
    assert main(["train", str(recipe), "--help"]) == 0
    assert "--model.d_ff D_FF (type: int | null, default: 40 (null: derived from d_model))" in " ".join(
        capsys.readouterr().out.split())

