"""Many processes on CPU (gloo), launched the way users launch them: ``torchrun -m energyformer train``.

- DDP over 2 ranks ≡ 1 process with 2× gradient accumulation over the same windows (loss and
  weights to 1e-6 after 10 steps), also with randomized depth and truncated back-propagation (one
  draw on every rank); FSDP2 the same (on NRGPT: a reused block, scalar parameters);
- a checkpoint written by FSDP2 loads in one process and resumes under DDP, and one written by
  DDP resumes under FSDP2, both continuing the single-process curve;
- killing one rank stops the job with a message and leaves the last complete checkpoint intact;
- a user error that every rank meets is printed once, not once per rank;
- the gradients after one backward and the weights after one SGD step (an update proportional
  to the gradient, unlike AdamW's) are equal on 1 and 2 ranks, DDP and FSDP2;
- FSDP2's sharded checkpoints (``train.fsdp_checkpoint: sharded``): each rank writes its own DCP
  shards, N/2 steps + resume for N/2 equals N steps (and equals ``full`` checkpoints), the shards
  of 2 ranks resume in one process, and a checkpoint without the single-file export (a run
  still training or killed) loads in one process without a process group (``load_run``, ``sample``).
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_config_dict

from energyformer.runs import find_checkpoint, load_run, read_metrics

GPT = {"arch": "gpt", "d_model": 32, "n_layers": 2, "n_heads": 2, "block_size": 16, "dropout": 0.0}
NRGPT = {"arch": "nrgpt", "d_model": 32, "n_heads": 2, "n_steps": 2, "block_size": 16}


def recipe(tmp_path, data_dir, model, **train):
    path = tmp_path / f"{model['arch']}.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(data_dir, None, model, **{"eval_iters": 3, "num_threads": 1,
                                                                               **train})))
    return path


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(recipe_path, *overrides, nproc=2, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "energyformer", "train", str(recipe_path), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


def single(recipe_path, *overrides):
    cmd = [sys.executable, "-m", "energyformer", "train", str(recipe_path), *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())


def assert_same_run(a, b, atol=1e-6):
    la = [(r["step"], r["train_loss"]) for r in read_metrics(a)]
    lb = [(r["step"], r["train_loss"]) for r in read_metrics(b)]
    assert [s for s, _ in la] == [s for s, _ in lb]
    assert max(abs(x - y) for (_, x), (_, y) in zip(la, lb)) <= atol
    ma, _, _ = load_run(a)
    mb, _, _ = load_run(b)
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=name)


def test_ddp_two_ranks_equal_one_process_with_twice_the_accumulation(data_dir, tmp_path):
    r = recipe(tmp_path, data_dir, GPT)
    res = torchrun(r, "--train.out_dir", str(tmp_path / "ddp"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("done: 10 steps") == 1  # rank 0 prints, logs and writes
    res = single(r, "--train.out_dir", str(tmp_path / "one"), "--train.grad_accum_steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / "ddp", tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir())


def test_ddp_draws_one_depth_on_every_rank_and_truncates_like_one_process(data_dir, tmp_path):
    """Randomized depth under DDP: every rank runs the step's one draw (else the averaged gradients
    would differ from one process's), and truncated steps that leave the embeddings without a
    gradient do not stop DDP."""
    r = recipe(tmp_path, data_dir, NRGPT, max_steps=6, eval_interval=3, depth_sampler="poisson_lognormal",
               depth_mean=3.0, depth_max=6, backprop_steps=1)
    res = torchrun(r, "--train.out_dir", str(tmp_path / "ddp"))
    assert res.returncode == 0, res.stderr[-3000:]
    res = single(r, "--train.out_dir", str(tmp_path / "one"), "--train.grad_accum_steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / "ddp", tmp_path / "one")
    depths = [[m["depth"] for m in read_metrics(tmp_path / run)] for run in ("ddp", "one")]
    assert depths[0] == depths[1] and max(depths[0]) > 1


@pytest.mark.slow
def test_fsdp2_equals_one_process_and_checkpoints_cross_load(data_dir, tmp_path):
    r = recipe(tmp_path, data_dir, NRGPT, max_steps=6, eval_interval=3)
    res = torchrun(r, "--train.out_dir", str(tmp_path / "fsdp"), "--train.parallel", "fsdp")
    assert res.returncode == 0, res.stderr[-3000:]
    res = single(r, "--train.out_dir", str(tmp_path / "one"), "--train.grad_accum_steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / "fsdp", tmp_path / "one")

    # the FSDP2 checkpoint loads in one process and resumes under DDP; the single run goes on too
    more = ("--train.max_steps", "9", "--train.lr_decay_steps", "6")
    res = torchrun(r, "--train.out_dir", str(tmp_path / "fsdp"), *more)
    assert res.returncode == 0, res.stderr[-3000:]
    res = single(r, "--train.out_dir", str(tmp_path / "one"), "--train.grad_accum_steps", "2", *more)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / "fsdp", tmp_path / "one")

    # and a DDP checkpoint resumes under FSDP2
    more = ("--train.max_steps", "12", "--train.lr_decay_steps", "6")
    res = torchrun(r, "--train.out_dir", str(tmp_path / "fsdp"), "--train.parallel", "fsdp", *more)
    assert res.returncode == 0, res.stderr[-3000:]
    res = single(r, "--train.out_dir", str(tmp_path / "one"), "--train.grad_accum_steps", "2", *more)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(tmp_path / "fsdp", tmp_path / "one")


def test_an_error_every_rank_meets_is_printed_once(data_dir, tmp_path):
    res = torchrun(recipe(tmp_path, data_dir, GPT), "--train.out_dir", str(tmp_path / "o"), "--train.batch_size", "0")
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: train.batch_size=0 must be >= 1"], res.stderr[-3000:]


def test_first_report_lets_one_rank_print_each_message(monkeypatch, tmp_path):
    import uuid

    from energyformer.train.distributed import first_report

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert first_report("error: x") and first_report("error: x")  # one process prints everything
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", str(uuid.uuid4()))
    assert first_report("error: x")  # the first rank to fail with it
    assert not first_report("error: x")  # another rank failing the same way
    assert first_report("error: y")  # a rank failing differently
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", str(uuid.uuid4()))
    assert first_report("error: x")  # another job


def _rank_pids(parent: int) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun started under ``parent``."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid != parent:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(proc.name)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank processes through /proc")
def test_killing_one_rank_stops_the_job_and_keeps_the_last_checkpoint(data_dir, tmp_path):
    r = recipe(tmp_path, data_dir, GPT, max_steps=100000, eval_interval=1000, ckpt_interval=2, log_interval=50)
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "energyformer", "train", str(r), "--train.out_dir", str(out)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env())
    try:
        deadline = time.time() + 90
        while time.time() < deadline and ((find_checkpoint(out) or {}).get("step", 0) < 6):
            time.sleep(0.2)
        ranks = _rank_pids(job.pid)
        assert 1 in ranks, f"no rank 1 under torchrun {job.pid}: {ranks}"
        os.kill(ranks[1], signal.SIGKILL)
        output, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode != 0
    assert "local_rank: 1" in output and "SIGKILL" in output, output[-2000:]
    marker = find_checkpoint(out)
    assert marker is not None and marker["step"] >= 6
    load_run(out)  # the last complete checkpoint loads
    # and the run resumes (here in one process, to a step just after it)
    res = single(r, "--train.out_dir", str(out), "--train.max_steps", str(marker["step"] + 2),
                 "--train.lr_decay_steps", "100000")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from step {marker['step']}" in res.stdout


GRADS = r"""
import sys, torch
from energyformer.models.registry import build_model
from energyformer.train import distributed as dist
from energyformer.train.parallelize import parallelize
parallel, arch, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
cfg = {"gpt": dict(arch="gpt", vocab_size=11, block_size=16, d_model=32, n_layers=2, n_heads=2, dropout=0.0),
       "nrgpt": dict(arch="nrgpt", vocab_size=11, block_size=16, d_model=32, n_heads=2, n_steps=2)}[arch]
model = build_model(cfg)
info = dist.init_distributed("cpu", parallel)
wrapped, fwd = parallelize(model, info)
g = torch.Generator().manual_seed(1)
x, y = torch.randint(0, 11, (4, 16), generator=g), torch.randint(0, 11, (4, 16), generator=g)
n = 4 // info.world_size
sl = slice(info.rank * n, (info.rank + 1) * n)
_, loss = fwd(x[sl], y[sl])
loss.backward()
dist.reduce_replicated_grads(model, info)
full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
grads = {k: full(p.grad).detach().clone() for k, p in model.named_parameters()}
torch.optim.SGD(model.parameters(), lr=0.5).step()
params = {k: full(p.data).detach().clone() for k, p in model.named_parameters()}
if info.rank == 0:
    torch.save({"grads": grads, "params": params}, out)
dist.shutdown(info)
"""


@pytest.mark.parametrize("parallel,arch", [("ddp", "gpt"), ("fsdp", "nrgpt")])
def test_gradients_and_an_sgd_step_equal_across_one_and_two_ranks(tmp_path, parallel, arch):
    """After one backward (and one SGD step, whose update is proportional to the gradient, unlike
    AdamW's), 2 ranks on halves of a batch give the gradients of 1 process on the whole batch:
    a reduction that sums instead of averaging (or skips FSDP2's replicated parameters) fails."""
    script = tmp_path / "grads.py"
    script.write_text(GRADS)
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"{nproc}.pt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), parallel, arch, str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
        assert res.returncode == 0, res.stderr[-3000:]
        runs[nproc] = torch.load(out, weights_only=True)
    assert runs[1]["grads"].keys() == runs[2]["grads"].keys()
    for kind in ("grads", "params"):
        for name, t in runs[1][kind].items():
            assert t.abs().max() > 0 or kind == "params", name
            torch.testing.assert_close(runs[2][kind][name], t, atol=1e-6, rtol=1e-5, msg=f"{kind} {name}")


def _shards(run_dir):
    folder = run_dir / find_checkpoint(run_dir)["dir"]
    return folder, sorted(p.name for p in (folder / "dcp").iterdir()) if (folder / "dcp").is_dir() else []


@pytest.mark.slow
def test_fsdp2_sharded_checkpoints_resume_exactly_also_in_one_process(data_dir, tmp_path):
    r = recipe(tmp_path, data_dir, GPT, max_steps=4, eval_interval=2, ckpt_interval=2)
    whole, half = tmp_path / "whole", tmp_path / "half"
    res = torchrun(r, "--train.out_dir", str(whole), "--train.parallel", "fsdp", "--train.fsdp_checkpoint", "full")
    assert res.returncode == 0, res.stderr[-3000:]
    folder, shards = _shards(whole)
    assert shards == [] and (folder / "model.safetensors").is_file()  # full: today's single file
    res = torchrun(r, "--train.out_dir", str(half), "--train.parallel", "fsdp", "--train.max_steps", "2",
                   "--train.lr_decay_steps", "4")
    assert res.returncode == 0, res.stderr[-3000:]
    folder, shards = _shards(half)
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # every rank wrote its own shards
    assert torch.load(folder / "train_state.pt", weights_only=True)["optimizer"] is None  # nothing gathered
    assert os.path.samefile(half / "model.safetensors", folder / "model.safetensors")  # the finished run's export
    shutil.copytree(half, tmp_path / "one")
    res = torchrun(r, "--train.out_dir", str(half), "--train.parallel", "fsdp")  # resumed from the shards
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming from" in res.stdout + res.stderr
    assert_same_run(whole, half, atol=0)
    # DCP reshards: the 2 ranks' shards resume in one process (2x accumulation: the same windows)
    res = single(r, "--train.out_dir", str(tmp_path / "one"), "--train.grad_accum_steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert_same_run(whole, tmp_path / "one")


SHARDED_SAVE = r"""
import json, sys, torch
from pathlib import Path
from energyformer.models.registry import build_model
from energyformer.runs import checkpoint as ckpt, rundir
from energyformer.runs.config import load_config
from energyformer.train import distributed as dist
from energyformer.train.optim import build_optimizer
from energyformer.train.parallelize import parallelize
out, data_dir = Path(sys.argv[1]), Path(sys.argv[2])
meta = json.loads((data_dir / "meta.json").read_text())
model_cfg = dict(arch="gpt", vocab_size=meta["vocab_size"], block_size=16, d_model=32, n_layers=2, n_heads=2)
cfg = load_config({"model": model_cfg, "data": {"data_dir": str(data_dir)}, "train": {"out_dir": str(out)}})
torch.manual_seed(0)
model = build_model(cfg.model)
info = dist.init_distributed("cpu", "fsdp")
wrapped, fwd = parallelize(model, info)
opt = build_optimizer(model, cfg.train)
x = torch.randint(0, meta["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(info.rank))
fwd(x, x)[1].backward()
dist.reduce_replicated_grads(model, info)
opt.step()
if info.is_main:
    rundir.write_run_files(out, cfg, meta)
info.barrier()
ckpt.save_sharded_checkpoint(out, model, opt, 1, None, torch.Generator(), is_main=info.is_main,
                             broadcast=info.broadcast)
full = lambda m: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                  for k, v in m.state_dict().items()}
saved = full(model)
# resume on the 2 ranks: a fresh model and optimizer take the shards; one more step on both
torch.manual_seed(1)
again = build_model(cfg.model)
_, fwd_again = parallelize(again, info)
opt_again = build_optimizer(again, cfg.train)
ckpt.restore_train_state(again, opt_again, torch.Generator(), ckpt.load_train_state(out), ckpt.checkpoint_dir(out))
for f, m, o in ((fwd, model, opt), (fwd_again, again, opt_again)):
    o.zero_grad(set_to_none=True)
    f(x, x)[1].backward()
    dist.reduce_replicated_grads(m, info)
    o.step()
states = {"saved": saved, "continued": full(model), "resumed": full(again)}  # (full_tensor: every rank)
if info.is_main:
    torch.save(states, out.parent / "reference.pt")
dist.shutdown(info)
"""


def test_a_sharded_checkpoint_resumes_on_two_ranks_and_loads_in_one_process(data_dir, tmp_path, capsys):
    """What a killed FSDP2 run leaves (shards, no model.safetensors) resumes on 2 ranks (the
    next step equals the saving ranks' own) and is what load_run and sample use, consolidated
    without a process group: the weights the 2 ranks held."""
    script = tmp_path / "save.py"
    script.write_text(SHARDED_SAVE)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(out), str(data_dir)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env())
    assert res.returncode == 0, res.stderr[-3000:]
    assert "returned a view tensor" not in res.stderr  # FSDP2's view warning does not apply (parallelize)
    folder, shards = _shards(out)
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (folder / "model.safetensors").exists() and not (out / "model.safetensors").exists()
    model, _, _ = load_run(out)
    runs = torch.load(tmp_path / "reference.pt", weights_only=True)
    reference = runs["saved"]
    assert reference.keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert torch.equal(t, reference[name]), name
        # the ranks resumed from the shards (weights and AdamW state) step exactly as the saving ones
        assert torch.equal(runs["resumed"][name], runs["continued"][name]), name
    assert all(not torch.equal(runs["continued"][k], reference[k]) for k, _ in model.named_parameters())
    from energyformer.cli import main

    assert main(["sample", str(out), "--max_new_tokens", "5", "--seed", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip()
