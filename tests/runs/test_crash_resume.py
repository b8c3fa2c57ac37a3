"""Crash safety: a training killed with SIGKILL anywhere (mid-step, between log lines, at every
stage of a checkpoint commit) resumes to the same loss curve and the same final weights as a run
that was never interrupted, bit for bit on CPU.

Each kill runs the real CLI in a child process whose chosen function (of the checkpoint commit
or the loop) sends SIGKILL to its own process on its n-th call; n is drawn at random (seeded,
printed on failure). The run is then resumed with the same command, and so on; the last command
runs to the end.
"""
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import make_data_dir

from energyformer.runs import find_checkpoint, load_run, read_metrics

# (module, function, when): SIGKILL before or after its n-th call
KILL_POINTS = {
    "after weights, before train state": ("energyformer.runs.checkpoint", "write_weights_file", "after"),
    "staged, folder not renamed": ("energyformer.runs.checkpoint", "_stage", "after"),
    "renamed, marker not switched": ("energyformer.runs.checkpoint", "_publish", "after"),
    "marker switched, weights not re-linked": ("energyformer.runs.checkpoint", "_commit", "after"),
    "re-linked, old folder not removed": ("energyformer.runs.checkpoint", "_link_weights", "after"),
    "mid-step": ("energyformer.train.loop", "lr_at", "before"),
    "after a log line": ("energyformer.train.metrics", "MetricsLogger.log", "after"),
}

DRIVER = r"""
import importlib, os, signal, sys
module, name, when, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
mod = importlib.import_module(module)
owner, attr = (getattr(mod, name.split(".")[0]), name.split(".")[1]) if "." in name else (mod, name)
original = getattr(owner, attr)
calls = [0]
def wrapper(*args, **kwargs):
    calls[0] += 1
    if when == "before" and calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    if when == "after" and calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
    return result
setattr(owner, attr, wrapper)
from energyformer.cli import main
sys.exit(main(sys.argv[5:]))
"""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    data = make_data_dir(root / "data" / "tiny")
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"arch": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "block_size": 16},
        "data": {"data_dir": str(data)},
        "train": {"max_steps": 40, "batch_size": 4, "eval_interval": 4, "eval_iters": 2, "log_interval": 1,
                  "ckpt_interval": 2, "warmup_steps": 2, "learning_rate": 3e-3, "device": "cpu",
                  "num_threads": 1}}))
    return path


def run(recipe, out, kill=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", str(recipe), "--train.out_dir", str(out)]
    if kill is None:
        cmd = [sys.executable, "-m", "energyformer", *args]
    else:
        cmd = [sys.executable, "-c", DRIVER, *map(str, kill), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def curve(out):
    return [(r["step"], r["train_loss"], r.get("val_loss")) for r in read_metrics(out)]


def crash_and_resume(recipe, tmp_path, points, seed):
    reference = tmp_path / "reference"
    res = run(recipe, reference)
    assert res.returncode == 0, res.stderr

    rng = random.Random(seed)
    out = tmp_path / "crashed"
    killed = []
    for name in points:
        module, func, when = KILL_POINTS[name]
        # a checkpoint happens every 2 of 40 steps, a log line and an lr every step
        nth = rng.randint(1, 3) if module.endswith("checkpoint") else rng.randint(1, 5)
        res = run(recipe, out, (module, func, when, nth))
        killed.append((name, nth, res.returncode))
        assert res.returncode == -9, (name, nth, res.returncode, res.stderr[-2000:])
        marker = find_checkpoint(out)
        if marker is not None:  # whatever is committed loads
            load_run(out)
    resumes = find_checkpoint(out) is not None
    res = run(recipe, out)
    assert res.returncode == 0, (killed, res.stderr[-2000:])
    assert ("resumed from step" in res.stdout) == resumes, killed

    assert curve(out) == curve(reference), killed  # bit-exact, every step
    a, _, _ = load_run(out)
    b, _, _ = load_run(reference)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), (name, killed)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000040"]
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["tokens_per_s"] > 0


def test_sigkill_inside_a_checkpoint_commit(recipe, tmp_path):
    crash_and_resume(recipe, tmp_path, ["renamed, marker not switched"], seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_every_kind_of_point(recipe, tmp_path, seed):
    crash_and_resume(recipe, tmp_path, list(KILL_POINTS), seed=seed)
