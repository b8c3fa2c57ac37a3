"""The fixed evaluation every reported number comes from, the kept weights, ``--rescore`` and
``--jobs`` (energyformer.experiments.scoring / parallel)."""
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from energyformer.experiments import common as ex
from energyformer.experiments import report, run_experiment, sweeps
from energyformer.experiments.scoring import FINAL_EVAL_FILE, WEIGHTS_FILE, cached_eval, final_eval, keep_weights


@pytest.fixture(scope="module")
def tiny_record(tmp_path_factory):
    """A finished quick Llama run, trained and recorded by train_or_resume."""
    tmp = tmp_path_factory.mktemp("scoring")
    ctx = ex.Context("x", quick=True, work_dir=tmp / "w", verbose=False)
    cfg = ex.resolve(ctx, "shakespeare_char/llama.yaml", {"train": {**ex.schedule(ctx, 20, 1e-3), "seed": 3}},
                     data=ex.char_data(ctx))
    summary = ex.train_or_resume(ctx, "r", cfg)
    return ctx, summary, ctx.records / "r"


def test_the_fixed_evaluation_is_the_whole_validation_split(tiny_record):
    from energyformer.data import load_split
    from energyformer.runs.rundir import load_run

    ctx, summary, rec = tiny_record
    assert (rec / "model.safetensors").is_file() and summary["seed"] == 3
    got = summary["final_eval"]
    assert got == json.loads((rec / FINAL_EVAL_FILE).read_text()) and got["metric"] == "val_loss"
    # an independent computation: consecutive windows of block_size, every validation token after the first
    model, run_cfg, _ = load_run(rec)
    val = np.asarray(load_split(run_cfg.data.path, "val"), dtype=np.int64)
    n, total = run_cfg.model.block_size, 0.0
    with torch.no_grad():
        for s in range(0, len(val) - 1, n):
            chunk = torch.from_numpy(val[s:s + n + 1])
            logits = model(chunk[None, :-1])[0]
            total += float(F.cross_entropy(logits[0].double(), chunk[1:], reduction="sum"))
    assert got["tokens"] == len(val) - 1 and got["value"] == pytest.approx(total / (len(val) - 1), rel=1e-5)
    # it does not depend on the run's seed: the curve's seeded estimate does
    assert got["value"] != summary["final_val_loss"]


def test_final_eval_is_cached_by_weights_and_recomputed_on_request(tiny_record, tmp_path):
    _, summary, rec = tiny_record
    copy = tmp_path / "rec"
    shutil.copytree(rec, copy)
    path = copy / FINAL_EVAL_FILE
    path.write_text(json.dumps({**summary["final_eval"], "value": 123.0}))
    assert final_eval(copy)["value"] == 123.0  # same weights: read, not recomputed
    assert final_eval(copy, force=True)["value"] == pytest.approx(summary["final_eval"]["value"])
    keep_weights(rec / "model.safetensors", copy / "model.safetensors", bf16_over=0)  # other weights: recomputed
    again = final_eval(copy)
    assert again["weights_sha256"] != summary["final_eval"]["weights_sha256"]
    assert again["value"] == pytest.approx(summary["final_eval"]["value"], abs=0.05)
    (copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="keeps no model.safetensors: it cannot be scored"):
        final_eval(copy)


def test_cached_eval_is_reused_only_for_the_same_weights_and_inputs(tmp_path):
    """A task evaluation kept beside the weights (listops_eval.json) is read back while the weights and
    what it read are the same, and computed again when either changes or when forced."""
    (tmp_path / WEIGHTS_FILE).write_bytes(b"weights 1")
    calls = []

    def compute():
        calls.append(1)
        return {"accuracy": 0.5 + len(calls)}

    first = cached_eval(tmp_path, "task.json", {"n": 20}, compute)
    assert first["accuracy"] == 1.5 and first["inputs"] == {"n": 20} and len(calls) == 1
    assert json.loads((tmp_path / "task.json").read_text()) == first
    assert cached_eval(tmp_path, "task.json", {"n": 20}, compute) == first and len(calls) == 1
    assert cached_eval(tmp_path, "task.json", {"n": 21}, compute)["accuracy"] == 2.5  # other test set
    assert cached_eval(tmp_path, "task.json", {"n": 21}, compute, force=True)["accuracy"] == 3.5  # --rescore
    (tmp_path / WEIGHTS_FILE).write_bytes(b"weights 2")
    again = cached_eval(tmp_path, "task.json", {"n": 21}, compute)
    assert again["accuracy"] == 4.5 and again["weights_sha256"] != first["weights_sha256"]
    (tmp_path / "task.json").write_text("{oops")  # unreadable: computed again, not an error
    assert cached_eval(tmp_path, "task.json", {"n": 21}, compute)["accuracy"] == 5.5
    (tmp_path / WEIGHTS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="keeps no model.safetensors"):
        cached_eval(tmp_path, "task.json", {"n": 21}, compute)


def test_keep_weights_stores_large_files_in_bfloat16(tiny_record, tmp_path):
    from safetensors import safe_open

    from energyformer.runs.rundir import load_run

    _, _, rec = tiny_record
    small = keep_weights(rec / "model.safetensors", tmp_path / "a.safetensors")
    assert small.read_bytes() == (rec / "model.safetensors").read_bytes()
    big = keep_weights(rec / "model.safetensors", tmp_path / "b" / "model.safetensors", bf16_over=1000)
    with safe_open(str(big), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert f.metadata()["energyformer_kept_dtype"] == "bfloat16" and "aliases" in f.metadata()
    assert big.stat().st_size < 0.6 * (rec / "model.safetensors").stat().st_size
    for name in ("config.yaml", "meta.json"):
        shutil.copyfile(rec / name, big.parent / name)
    model, _, _ = load_run(big.parent)  # loads into the float32 model
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(FileNotFoundError, match="no weights file"):
        keep_weights(tmp_path / "none.safetensors", tmp_path / "c.safetensors")


def _tiny_experiment(ctx):
    """Two LR-sweep runs, a barrier, two seeds at the best LR, a barrier, a table of the fixed evaluation."""
    def cfg(lr, steps, seed):
        return ex.resolve(ctx, "shakespeare_char/llama.yaml", {"train": {**ex.schedule(ctx, steps, lr), "seed": seed}},
                          data=ex.char_data(ctx))

    sweep = sweeps.lr_sweep(ctx, "tiny", lambda lr, steps: cfg(lr, steps, 1), (1e-3, 3e-3, 1e-2), 20, max_extend=0)
    ex.need_runs(ctx)
    runs = {seed: ex.train_or_resume(ctx, f"tiny_s{seed}", cfg(sweep["best_lr"], 20, seed)) for seed in (1, 2)}
    ex.need_runs(ctx)
    rows = [[seed, f"{r['final_eval']['value']:.6f}"] for seed, r in runs.items()]
    return report.write_results(ctx, report.markdown_table(["seed", "val loss"], rows), {"best_lr": sweep["best_lr"]})


def test_rescore_and_jobs_give_the_tables_of_the_fixed_evaluation(tmp_path, capsys):
    """The table reads each run's fixed evaluation; ``rescore`` recomputes it from the kept weights;
    two trainings at once (``jobs=2``, deferred runs behind ``need_runs`` barriers) give the same table
    as one at a time."""
    import types

    from energyformer.experiments.parallel import run_parallel, threads_per_job

    module = types.SimpleNamespace(run=_tiny_experiment)
    ctx = lambda w, **kw: ex.Context("tiny", quick=True, work_dir=tmp_path / w, verbose=True, **kw)  # noqa: E731
    one = module.run(ctx("w1"))
    rec = tmp_path / "w1" / "quick-results" / "tiny" / "runs" / "tiny_s1" / FINAL_EVAL_FILE
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "value": 7.0}))
    assert "| 1 | 7.000000 |" in module.run(ctx("w1"))["table"]  # the table reads the recorded evaluation
    assert module.run(ctx("w1", rescore=True))["table"] == one["table"]  # recomputed from the kept weights
    rec.write_text(json.dumps({**json.loads(rec.read_text()), "value": 7.0}))
    again = ex.rescore_records(ctx("w1", rescore=True))  # every record with weights, sweeps included
    assert set(again) == {"tiny_s1", "tiny_s2", "sweep_tiny_lr0.001", "sweep_tiny_lr0.003", "sweep_tiny_lr0.01"}
    assert f"| 1 | {again['tiny_s1']:.6f} |" in one["table"]
    capsys.readouterr()
    both = run_parallel(module, ctx("w2", jobs=2))
    said = capsys.readouterr().out
    assert "training 3 run(s), 2 at a time" in said and "training 2 run(s), 2 at a time" in said
    assert said.count("  LR sweep tiny:") == 1  # announced once, not at every barrier
    assert said.count("sweep_tiny_lr0.003: finished earlier") <= 1
    assert both["table"] == one["table"] and both["best_lr"] == one["best_lr"]
    assert threads_per_job(2, cores=2) == 1 and threads_per_job(3, cores=8) == 2 and threads_per_job(4, cores=2) == 1
    with pytest.raises(ValueError, match="jobs=0 must be >= 1"):
        run_experiment("gp_recursion", jobs=0)


def test_ctrl_c_under_jobs_stops_every_worker_with_one_line(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while ``--jobs 2`` trains:
    the workers ignore it, the driver stops them and exits 130 with one line, no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    # unbuffered: through a pipe the driver's stdout is block-buffered, and "training …" could arrive
    # only at exit, after the run had finished (CI saw exit 0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # energy_descent's first round trains 9 sweep runs (seconds each, with the workers' start-up), so the
    # signal lands while it trains; listops_transition's one-run first round could finish first (a race)
    proc = subprocess.Popen([sys.executable, "-m", "energyformer", "experiment", "energy_descent", "--quick",
                             "--jobs", "2", "--work_dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                            # a terminal's default: a shell's background job (`cmd &`) inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if line.startswith("training "):
            break
    assert proc.poll() is None, "the experiment ended before it was interrupted"
    time.sleep(0.5)  # the workers are starting (importing) or training
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err and err.strip().splitlines()[-1] == "interrupted"
    assert "interrupted" not in out  # one line, on stderr


def test_threads_sets_each_trainings_threads_and_restores_them(monkeypatch):
    """``threads`` (``--threads``) is each training's thread count, one at a time (set around the
    experiment, restored after, also when it raises) and under ``jobs`` (instead of cores ÷ jobs);
    ``threads < 1`` is refused by name."""
    import types

    import energyformer.experiments as experiments
    from energyformer.experiments import parallel

    seen = []

    def fake_run(ctx):
        seen.append((torch.get_num_threads(), ctx.threads))
        if ctx.name == "cem_ablation":
            raise RuntimeError("boom")
        return {"table": ""}

    monkeypatch.setattr(experiments.importlib, "import_module", lambda name: types.SimpleNamespace(run=fake_run))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run_experiment("gp_recursion", threads=1, verbose=False)
        assert seen[-1] == (1, 1) and torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"):
            run_experiment("cem_ablation", threads=1, verbose=False)
        assert seen[-1] == (1, 1) and torch.get_num_threads() == 2
        run_experiment("gp_recursion", verbose=False)  # no threads: torch's own count stands
        assert seen[-1] == (2, None)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        run_experiment("gp_recursion", threads=0)

    started = []
    monkeypatch.setattr(parallel, "ProcessPoolExecutor", None)  # never reached: no run is queued
    ctx = ex.Context("tiny", jobs=2, threads=3, verbose=False)
    monkeypatch.setattr(parallel, "threads_per_job", lambda jobs: started.append(jobs) or 1)
    result = parallel.run_parallel(types.SimpleNamespace(run=lambda c: {"table": "t"}), ctx)
    assert result == {"table": "t"} and started == []  # the given count, not cores ÷ jobs
    module = types.SimpleNamespace(run=lambda c: {"table": "t"})
    parallel.run_parallel(module, ex.Context("tiny", jobs=2, verbose=False))
    assert started == [2]  # without it: cores ÷ jobs
