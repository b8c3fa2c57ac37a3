"""A new *architecture* is a plugin of two files outside the package: a module with its config dataclass
and model class, and a module that registers its :class:`~energyformer.models.registry.ArchSpec`.
Named in a recipe's ``imports:``, it trains, samples and exports like the package's own families, and
its spec answers the questions the commands ask (inference options, training keys, accounting).

The in-process test runs in the default suite; the fresh-process one (the CLI, each command in a new
Python that learns of the plugin only from the run's config.yaml) is marked slow.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers import on_sys_path

from energyformer.models import registry

ROOT = Path(__file__).resolve().parents[2]
ARCH, MODULE = "toy_steps", "toy_steps_arch"

#: file 1: the config dataclass and the model (a per-token recurrent MLP: each token's state is refined
#: ``n_steps`` times, with no mixing across positions, so a KV cache has nothing to keep)
MODEL_FILE = '''
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from energyformer._validate import check_int
from energyformer.models.base import CausalLM, init_weights
from energyformer.models.config import ModelConfig


@dataclass
class ToyStepsConfig(ModelConfig):
    arch: ClassVar[str] = "toy_steps"
    positive_ints: ClassVar[tuple[str, ...]] = ("d_model", "n_steps")
    d_model: int = 16
    n_steps: int = 2
    d_ff: int | None = None
    derived: ClassVar[dict] = {"d_ff": lambda c: 2 * c.d_model}  # filled by ModelConfig.__post_init__

    def __post_init__(self):
        super().__post_init__()
        check_int("d_ff", self.d_ff, 1)


class ToySteps(CausalLM):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.norm = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, config.d_ff), nn.GELU(),
                                 nn.Linear(config.d_ff, config.d_model))
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self)

    def embedding_params(self):
        return [self.embed.weight]

    def forward(self, idx, targets=None, *, n_steps=None, cache=None):
        self.check_input(idx, targets)
        h = self.embed(idx)
        for _ in range(n_steps or self.config.n_steps):
            h = h + self.mlp(self.norm(h))
        logits = self.lm_head(h)
        return logits, self.lm_loss(logits, targets)
'''

#: file 2: the registry entry (the module a recipe's ``imports:`` names)
SPEC_FILE = f'''
from energyformer.models.registry import ArchSpec, register_arch

register_arch(ArchSpec({ARCH!r}, module="toy_steps_model", model_class="ToySteps", config_class="ToyStepsConfig"))
'''

MODEL = {"arch": ARCH, "block_size": 16, "d_model": 16, "n_steps": 2}
TRAIN = {"max_steps": 10, "batch_size": 4, "eval_interval": 10, "eval_iters": 1, "warmup_steps": 1,
         "log_interval": 5, "device": "cpu"}


def write_plugin(folder: Path) -> Path:
    """The two plugin files in ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "toy_steps_model.py").write_text(textwrap.dedent(MODEL_FILE))
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SPEC_FILE))
    return folder


def write_data(folder: Path) -> Path:
    from energyformer.data.prepare import prepare_text

    text = folder / "tiny.txt"
    text.write_text("the cat sat on the mat. the dog ran. " * 60)
    prepare_text(text, folder / "data")
    return folder / "data"


@pytest.fixture
def plugin(tmp_path):
    """The plugin imported in this process (its arch registered), removed afterwards."""
    folder = write_plugin(tmp_path / "plugin")
    with on_sys_path(folder, MODULE, "toy_steps_model"):
        try:
            yield folder
        finally:
            registry.unregister_arch(ARCH)


def test_a_plugin_arch_trains_samples_and_exports_in_process(plugin, tmp_path):
    from energyformer.commands import sample
    from energyformer.hf.export import export_run
    from energyformer.models.accounting import parameter_counts
    from energyformer.runs.config import load_config
    from energyformer.runs.rundir import read_summary
    from energyformer.train import train

    data = write_data(tmp_path)
    run = tmp_path / "run"
    cfg = load_config({"imports": [MODULE], "model": MODEL, "data": {"data_dir": str(data)},
                       "train": {**TRAIN, "out_dir": str(run)}})
    spec = registry.get_spec(ARCH)
    assert spec.language_model and spec.inference_options == ("n_steps",) and ARCH in registry.LANGUAGE_MODELS
    assert registry.ARCHS[ARCH] == ("toy_steps_model", "ToySteps", "ToyStepsConfig")
    assert parameter_counts(cfg.model)["total"] > 0  # the "totals" accounting view
    train(cfg, progress=False)
    assert read_summary(run)["steps"] == 10
    texts = sample(str(run), prompt="the", max_new_tokens=6, n_steps=3, seed=0, device="cpu")
    assert len(texts) == 1 and texts[0].startswith("the") and len(texts[0]) == 3 + 6
    refused = r"--stop-tol is not an option of the 'toy_steps' model; it takes \['--n-steps'\]"
    with pytest.raises(ValueError, match=refused):
        sample(str(run), prompt="the", max_new_tokens=2, stop_tol=0.1, device="cpu")
    out = export_run(run, tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3]])
    model = registry.build_model(cfg.model)
    model.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()})
    torch.testing.assert_close(hf(ids).logits, model(ids)[0])


def _forget_plugin():
    """As in a fresh process: the arch unregistered, its modules not imported."""
    registry.unregister_arch(ARCH)
    for m in (MODULE, "toy_steps_model"):
        sys.modules.pop(m, None)


def test_import_hf_of_a_plugin_export_imports_its_plugins_and_keeps_them(plugin, tmp_path):
    """An export of a plugin run lists its ``imports`` in config.json: ``import-hf`` imports them first (the
    plugin's arch, unknown to transformers until then) and writes them into the new run's config.yaml, so
    that ``sample`` on it works; without the list it is one error naming ``--import``."""
    import json

    from energyformer.commands import sample
    from energyformer.hf.export import export_run, import_hf
    from energyformer.runs.config import load_config
    from energyformer.train import train

    run = tmp_path / "run"
    train(load_config({"imports": [MODULE], "model": MODEL, "data": {"data_dir": str(write_data(tmp_path))},
                       "train": {**TRAIN, "max_steps": 2, "out_dir": str(run)}}), progress=False)
    hf = export_run(run, tmp_path / "hf")
    _forget_plugin()
    back = import_hf(hf, tmp_path / "back")
    assert yaml.safe_load((back / "config.yaml").read_text())["imports"] == [MODULE]
    _forget_plugin()
    assert sample(str(back), prompt="the", max_new_tokens=3, seed=0, device="cpu")[0].startswith("the")
    _forget_plugin()
    config = json.loads((hf / "config.json").read_text())
    del config["imports"]
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"arch 'toy_steps', which is not a registered .*--import MODULE"):
        import_hf(hf, tmp_path / "back2")


def test_a_run_trained_with_import_resumes_and_fine_tunes_without_it(plugin, tmp_path, capsys):
    """``--import`` is recorded in the run's config.yaml; a later ``train`` of a recipe that does not
    name the plugin imports the run's plugins first (resuming train.out_dir, or train.init_from)."""
    from energyformer.cli import main

    data = write_data(tmp_path)
    run, tuned = tmp_path / "run", tmp_path / "tuned"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": MODEL, "data": {"data_dir": str(data)},
                                      "train": {**TRAIN, "max_steps": 4, "out_dir": str(run)}}))
    assert main(["--import", MODULE, "train", str(recipe)]) == 0
    _forget_plugin()
    assert main(["train", str(recipe), "--train.max_steps", "6"]) == 0, capsys.readouterr().err
    assert "resumed from step 4" in capsys.readouterr().out
    assert yaml.safe_load((run / "config.yaml").read_text())["imports"] == [MODULE]  # still recorded
    _forget_plugin()
    assert main(["train", str(recipe), "--train.init_from", str(run), "--train.out-dir", str(tuned),
                 "--train.max_steps", "2"]) == 0, capsys.readouterr().err
    assert yaml.safe_load((tuned / "config.yaml").read_text())["imports"] == [MODULE]
    _forget_plugin()
    assert main(["sample", str(tuned), "--prompt", "the", "--max-new-tokens", "2"]) == 0


def test_an_unregistered_arch_is_one_line_naming_the_registered_ones():
    """... and saying how a plugin's name becomes known (an interaction's or any registry's name too)."""
    from energyformer.runs.config import load_config

    hint = ("(a plugin's name is known once its module is imported: the recipe's imports: [MODULE] or "
            "energyformer --import MODULE)")
    with pytest.raises(ValueError, match=r"model.arch='toy_steps' is not valid; expected one of 'gpt', ") as err:
        registry.get_spec(ARCH)
    assert str(err.value).endswith(hint) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"interaction='quad' is not valid; expected one of 'lowrank'") as err:
        load_config({"model": {"arch": "cem", "vocab_size": 11, "interaction": "quad"}})
    assert str(err.value).endswith(hint)


def test_a_second_spec_under_a_taken_name_is_refused(plugin):
    import importlib

    importlib.import_module(MODULE)
    importlib.reload(sys.modules[MODULE])  # the same spec again: a no-op
    with pytest.raises(ValueError, match="arch 'toy_steps' is already registered"):
        registry.register_arch(registry.ArchSpec(ARCH, "elsewhere", "M", "C"))


def _cli(args, cwd, plugin_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_dir)]), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "energyformer", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_a_plugin_arch_trains_samples_and_exports_in_fresh_processes(tmp_path):
    plugin_dir = write_plugin(tmp_path / "plugin")
    data = write_data(tmp_path)
    recipe = {"imports": [MODULE], "model": MODEL, "data": {"data_dir": str(data)},
              "train": {**TRAIN, "out_dir": str(tmp_path / "run")}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    _cli(["train", "recipe.yaml"], tmp_path, plugin_dir)
    assert yaml.safe_load((run / "config.yaml").read_text())["imports"] == [MODULE]
    out = _cli(["sample", run, "--max_new_tokens", "8", "--prompt", "the", "--seed", "0", "--n-steps", "3"],
               tmp_path, plugin_dir).stdout
    assert out.strip().startswith("the")
    _cli(["export", run, "--to", tmp_path / "hf"], tmp_path, plugin_dir)
    _cli(["import-hf", tmp_path / "hf", "--out", tmp_path / "back"], tmp_path, plugin_dir)  # no --import
    assert yaml.safe_load((tmp_path / "back" / "config.yaml").read_text())["imports"] == [MODULE]
    _cli(["sample", tmp_path / "back", "--max_new_tokens", "4", "--prompt", "the"], tmp_path, plugin_dir)
    load_hf = (f"import sys, torch, {MODULE}, energyformer.hf; from transformers import AutoModelForCausalLM; "
               "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
               "print(m.config.imports, tuple(m(torch.zeros(1, 4, dtype=torch.long)).logits.shape))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_dir)]), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", load_hf, str(tmp_path / "hf")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"['{MODULE}']" in r.stdout and "(1, 4, " in r.stdout, r.stdout + r.stderr[-3000:]


def test_inference_options_are_read_once_from_forward_and_every_check_uses_them():
    from energyformer.models.config import forward_options

    takes = {arch: registry.get_spec(arch).inference_options for arch in registry.ARCHS}
    assert takes["gpt"] == takes["llama"] == takes["regressor"] == ()
    assert takes["nrgpt"] == ("n_steps", "stop_tol", "exit", "accept_lower_energy", "backprop_steps")
    assert "stop_tol" not in takes["cem"] and "n_steps" in takes["cem"] and "accept_lower_energy" in takes["cem"]
    assert all(takes[a] == forward_options(registry.get_arch(a)[0]) for a in takes)
    cem = registry.build_model({"arch": "cem", "d_model": 16, "n_heads": 2, "n_layers": 1, "block_size": 8})
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"stop_tol is not an option of the 'cem' model's forward"):
        cem.generate(ids, 2, stop_tol=0.1)
    listed = r"it takes \['accept_lower_energy', 'exit', 'n_steps'\]"  # the spec's own spelling, sorted
    with pytest.raises(ValueError, match=r"stop_tol is not an option of the 'cem' model; " + listed):
        registry.get_spec("cem").check_inference_options(["n_steps", "stop_tol"])
    assert cem.generate(ids, 2, n_steps=2).shape == (1, 4)
