"""lm-eval's own ``hf`` model on an exported NRGPT folder with ``trust_remote_code=True``, in a Python
where importing energyformer fails (docs/hf.md): its log-likelihoods equal our adapter's. By default
through ``simple_evaluate`` without lm-eval's own task index; the stock ``lm_eval`` command line
(which indexes every lm-eval task first, about 2 minutes here) is the slow test."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from run_helpers import CHARS, local_task, make_run  # noqa: E402

from energyformer.eval.harness import EnergyformerLM, run_tasks  # noqa: E402
from energyformer.hf.export import export_run  # noqa: E402

DOCS = [{"q": "the cat sat on a", "choices": [" mat.", " dog", " cat"], "answer": 0},
        {"q": "the dog ran", "choices": [" to", " on", " a"], "answer": 1}]


SCRIPT = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
import lm_eval.models  # noqa: F401
manager = TaskManager(include_path=sys.argv[2], include_defaults=False)
res = simple_evaluate(model="hf", model_args=sys.argv[1], tasks=["tiny_local_mc"], task_manager=manager,
                      log_samples=True, bootstrap_iters=0, batch_size=2, device="cpu")
print(json.dumps([s["resps"] for s in sorted(res["samples"]["tiny_local_mc"], key=lambda s: s["doc_id"])]))
"""


@pytest.fixture()
def setup(tmp_path):
    """(run, model_args, tasks folder, environment without energyformer)"""
    run = make_run(tmp_path / "nrgpt", {"arch": "nrgpt"})
    folder = export_run(run, tmp_path / "hf_nrgpt")
    tasks = local_task(tmp_path / "tasks", DOCS)
    block = tmp_path / "block"  # a sitecustomize that makes `import energyformer` fail
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['energyformer'] = None\n")
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "PYTHONPATH": str(block), "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    # no BOS in our tokenizers: lm-eval's hf model needs the prefix token our adapter defaults to ("\n")
    model_args = f"pretrained={folder},trust_remote_code=True,prefix_token_id={CHARS.index(chr(10))}"
    return run, model_args, tasks, env


def _ours(run, tasks):
    ours = run_tasks(EnergyformerLM(run=str(run)), tasks=["tiny_local_mc"], include_path=str(tasks),
                     include_defaults=False, log_samples=True)
    return torch.tensor([[float(r[0][0]) for r in s["resps"]] for s in ours["samples"]["tiny_local_mc"]])


def _check(res):
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]


def test_lm_evals_hf_model_scores_an_export_without_energyformer(setup, tmp_path):
    run, model_args, tasks, env = setup
    res = subprocess.run([sys.executable, "-c", SCRIPT, model_args, str(tasks)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)
    _check(res)
    resps = json.loads(res.stdout.strip().splitlines()[-1])
    theirs = torch.tensor([[float(r[0][0]) for r in doc] for doc in resps])
    torch.testing.assert_close(theirs, _ours(run, tasks), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_stock_lm_eval_cli_scores_an_export_without_energyformer(setup, tmp_path):
    run, model_args, tasks, env = setup
    res = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", model_args,
                          "--device", "cpu", "--tasks", "tiny_local_mc", "--include_path", str(tasks),
                          "--batch_size", "2", "--output_path", str(tmp_path / "results"), "--log_samples"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    _check(res)
    samples = [json.loads(line) for f in sorted((tmp_path / "results").rglob("samples_tiny_local_mc_*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    assert len(samples) == len(DOCS)
    theirs = torch.tensor([[float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])])
    torch.testing.assert_close(theirs, _ours(run, tasks), atol=1e-4, rtol=0)
