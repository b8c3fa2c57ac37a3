"""A new interaction *energy* (new math, not a tweak of an entry) is a plugin of two files outside the
package (tests/layers/plugin_quadratic/: the energy file and the registry-entry file). Named in a recipe's
``imports:``, it is trained, resumed, sampled, evaluated and exported through the CLI, each command in
a fresh process that learns of the plugin only from the run's config.yaml (the exported folder's
config.json keeps it too, for ``from_pretrained``); its analytic gradient
equals autograd in float64 (also with a KV cache).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import on_sys_path

from energyformer.layers.cem_options import INTERACTIONS
from energyformer.runs.rundir import read_summary

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = Path(__file__).resolve().parent / "plugin_quadratic"
MODULE = "quadratic_interaction"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    """The two plugin files, copied to a folder outside the repository."""
    d = tmp_path_factory.mktemp("plugin")
    for f in ("quadratic_energy.py", "quadratic_interaction.py"):
        shutil.copy(PLUGIN / f, d / f)
    return d


def _cli(args, cwd, plugin_dir=None):
    paths = [str(ROOT)] + ([str(plugin_dir)] if plugin_dir is not None else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "energyformer", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def _ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def registered(plugin_dir):
    with on_sys_path(plugin_dir, "quadratic_interaction", "quadratic_energy"):
        try:
            import quadratic_interaction  # noqa: F401 - registers "quadratic"
            yield INTERACTIONS.get("quadratic")
        finally:
            INTERACTIONS.unregister("quadratic")


def test_plugin_energy_gradient_is_autograd_in_float64(registered):
    from energyformer.layers.cem import CEMAttention
    from energyformer.layers.kv_cache import KVCache

    torch.manual_seed(0)
    layer = CEMAttention(8, 2, n_steps=3, interaction="quadratic").double()
    gen = torch.Generator().manual_seed(1)
    x, h = (torch.randn(2, 7, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    g, h_hat = layer._normalize(x), layer._normalize(h)
    ctx = layer.interaction.context(h_hat)
    gg = g.detach().clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(layer.interaction.energy(gg, h_hat).sum(), gg)
    analytic = layer.interaction.grad(g, h_hat, ctx)
    torch.testing.assert_close(analytic, auto, atol=1e-10, rtol=0)
    assert analytic.abs().max() > 1e-3
    # cached decoding: the base class's cache layout serves the plugin; prefill 4 then 3 tokens
    cache = KVCache()
    with torch.no_grad():
        full = layer(x)
        parts = [layer(x[:, :4], cache, 0, 0), layer(x[:, 4:], cache, 0, 4)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)


def test_plugin_energy_trains_resumes_samples_evals_and_exports_in_fresh_processes(plugin_dir, tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("the cat sat on the mat. the dog ran. " * 60)
    _ok(_cli(["prepare", "text", "--input", text, "--out", tmp_path / "data"], tmp_path))
    recipe = {"imports": [MODULE],
              "model": {"arch": "cem", "block_size": 16, "d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 24,
                        "interaction": "quadratic", "rope": None, "n_steps": 2},
              "data": {"data_dir": str(tmp_path / "data")},
              "train": {"max_steps": 3, "batch_size": 4, "eval_interval": 3, "eval_iters": 1, "warmup_steps": 1,
                        "log_interval": 1, "device": "cpu", "out_dir": str(tmp_path / "run")}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    _ok(_cli(["train", "recipe.yaml"], tmp_path, plugin_dir))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["imports"] == [MODULE] and saved["model"]["interaction"] == "quadratic"
    _ok(_cli(["train", "recipe.yaml", "--train.max_steps", "5"], tmp_path, plugin_dir))  # resume 3 -> 5
    summary = read_summary(run)
    assert summary["steps"] == 5 and summary["steps_this_run"] == 2 and summary["resumed_from"] is not None
    out = _ok(_cli(["sample", run, "--max_new_tokens", "8", "--prompt", "the", "--seed", "0"], tmp_path,
                   plugin_dir)).stdout
    assert out.strip()
    _ok(_cli(["eval", run, "--tasks", "val_loss", "--limit", "2"], tmp_path, plugin_dir))
    _ok(_cli(["export", run, "--to", tmp_path / "hf"], tmp_path, plugin_dir))
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    load_hf = ("import sys, torch, energyformer.hf; from transformers import AutoModelForCausalLM; "
               "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
               "print(m.config.imports, tuple(m(torch.zeros(1, 4, dtype=torch.long)).logits.shape))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_dir)]), "HF_HUB_OFFLINE": "1"}
    r = _ok(subprocess.run([sys.executable, "-c", load_hf, str(tmp_path / "hf")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600))
    assert f"['{MODULE}']" in r.stdout and "(1, 4, " in r.stdout, r.stdout
    # without the plugin on the path: one line naming the module, exit 2
    r = _cli(["sample", run, "--max_new_tokens", "2"], tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and err.count("\n") == 0 and err.startswith("error:"), err
    assert f"plugin module {MODULE!r} failed to import" in err and "PYTHONPATH" in err, err
