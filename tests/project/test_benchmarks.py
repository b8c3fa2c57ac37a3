"""The benchmark suite (benchmarks/): every script's --quick path writes the JSON fields report.py
reads, report.py renders them, and the arithmetic behind MFU and activation memory is right.

The scripts run in-process on tiny shapes (one thread, see conftest.py); their timings mean
nothing here, only the fields, the goals and the exit codes are checked."""
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import on_sys_path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules, imported from benchmarks/ (a folder of scripts, not a package)."""
    with on_sys_path(BENCH):
        yield {name: importlib.import_module(name)
               for name in ("common", "bench_layers", "bench_models", "bench_generate", "bench_depth", "report")}


def _load(path):
    data = json.loads(Path(path).read_text())
    assert {"script", "env", "settings", "rows"} <= data.keys()
    assert {"torch", "threads", "device"} <= data["env"].keys()
    return data


def _goals(rows):
    return {g["goal"] for r in rows for g in r.get("goals", [])}


# ------------------------------------------------------------------------------------------------
# arithmetic


def test_mfu_arithmetic_on_a_hand_made_number(bench):
    c = bench["common"]
    assert c.matmul_flops(1000) == 2_000_000_000
    peak = c.flops_per_s(c.matmul_flops(1000), ms=20.0)  # 2 GFLOP in 20 ms
    assert peak == pytest.approx(1e11)
    # 1 MFLOP per token at 40 000 tokens/s is 40 GFLOP/s: 40 % of that peak
    assert c.mfu(1e6, 4e4, peak) == pytest.approx(0.40)
    with pytest.raises(ValueError, match="ms=0"):
        c.flops_per_s(1.0, 0)
    with pytest.raises(ValueError, match="peak_flops_per_s=0"):
        c.mfu(1.0, 1.0, 0)


def test_matmul_peak_warms_up_then_times_a_stream(bench):
    """The MFU peak: products issued for at least ``warmup_s`` before ``iters`` timed ones."""
    c = bench["common"]
    r = c.matmul_peak(64, "cpu", "fp32", warmup_s=0.05, iters=4)
    assert r["n"] == 64 and r["iters"] == 4 and r["warmup_iters"] >= 10 and r["warmup_s"] >= 0.04
    assert r["flops_per_s"] == pytest.approx(c.matmul_flops(64) / (r["ms"] / 1e3))
    with pytest.raises(ValueError, match="iters=0"):
        c.matmul_peak(8, "cpu", iters=0)


def test_saved_tensor_bytes_counts_a_tensor_once(bench):
    count = bench["common"].saved_tensor_bytes
    x = torch.randn(1000, requires_grad=True)  # 4000 bytes
    assert count(lambda: (x * x).sum()) == 4000  # mul saves x twice: one storage
    assert count(lambda: (x.view(10, 100) * x.view(100, 10).t()).sum()) == 4000  # views share it
    assert count(lambda: (x * x.exp()).sum()) == 8000  # x and exp(x): two storages
    assert count(lambda: (x * x).sum(), exclude=[x]) == 0  # e.g. parameters left out
    with torch.no_grad():
        assert count(lambda: (x * x).sum()) == 0


def test_goals_and_check_name_each_miss_with_its_numbers(bench, capsys):
    c = bench["common"]
    rows = [{"row": "a", "goals": [c.goal("cost / bound", 1.25, "<=", 1.10)]},
            {"row": "b", "goals": [c.goal("speed-up", 1.6, ">=", 1.5)]}]
    assert [g["met"] for r in rows for g in r["goals"]] == [False, True]
    assert c.check_exit(rows, check=False) == 0
    assert c.check_exit(rows, check=True) == 1
    err = capsys.readouterr().err
    assert "a: cost / bound = 1.250, goal <= 1.1" in err and "b:" not in err
    assert c.check_exit(rows[1:], check=True) == 0
    with pytest.raises(ValueError, match="op='<'"):
        c.goal("x", 1, "<", 2)


def test_shape_registry(bench):
    c = bench["common"]
    assert c.LAYER_SHAPES["cpu"] == [(128, 4, 128, 32), (256, 8, 256, 4), (512, 8, 256, 4), (768, 12, 512, 2)]
    assert c.LAYER_SHAPES["gpu"] == [(768, 12, 1024, 16)]
    gpu = c.MODEL_SHAPES["gpu"]
    assert (gpu.d_model, gpu.n_heads, gpu.block_size, gpu.batch_size) == (768, 12, 1024, 16)
    assert (c.MODEL_SHAPES["d128"].n_heads, c.MODEL_SHAPES["d128"].d_ff) == (4, 352)
    assert c.model_shape(256).n_heads == 8 and c.model_shape(512).n_heads == 8
    with pytest.raises(ValueError, match="d_model=100"):
        c.heads_for(100)


# ------------------------------------------------------------------------------------------------
# the scripts' --quick paths


def test_bench_layers_quick_nrgpt_rows(bench, tmp_path):
    out = tmp_path / "layers.json"
    assert bench["bench_layers"].main(["--quick", "--rows", "reference,ff1", "--out", str(out)]) == 0
    data = _load(out)
    assert data["script"] == "bench_layers"
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"gpt_rec_parallel block", "nrgpt ff1 full J", "nrgpt ff1 full J (torch.func.grad)",
                         "nrgpt reference (ff2w full J)", "nrgpt reference (ff2w full J) (torch.func.grad)"}
    for r in rows.values():
        assert {"shape", "peer", "ms", "gflop", "time_ratio", "flop_ratio", "cost_over_bound", "goals"} <= r.keys()
        assert r["cost_over_bound"] == pytest.approx(r["time_ratio"] / r["flop_ratio"])
    twin = rows["nrgpt reference (ff2w full J) (torch.func.grad)"]
    assert twin["max_abs_diff"] < 1e-4  # the torch.func.grad twin computes the same block
    assert _goals(rows.values()) == {"cost / bound", "reference speed-up vs torch.func.grad"}


def test_bench_layers_quick_every_row(bench, tmp_path):
    """Every row, the transformers Llama layer and its CEM peers included."""
    out = tmp_path / "layers.json"
    bench["bench_layers"].main(["--quick", "--out", str(out)])
    rows = _load(out)["rows"]
    assert len(rows) == len(bench["bench_layers"].row_names())
    assert "speed-up vs Llama layer" in _goals(rows)


def test_bench_layers_aggregates_processes_by_median(bench):
    """``--processes``: each row's median over the processes, every process's cost / bound kept,
    the goals judged on the medians; runs with different rows are refused."""
    bl = bench["bench_layers"]

    def row(ms, ratio, name="cem T=2 tied"):
        return {"shape": [8, 2, 4, 1], "row": name, "peer": bl.LLAMA, "ms": ms, "gflop": 1.0, "time_ratio": ratio,
                "flop_ratio": 1.0, "cost_over_bound": ratio, "goals": []}

    runs = [[row(10.0, 1.20)], [row(12.0, 1.05)], [row(11.0, 1.12)]]
    (agg,) = bl.aggregate_runs(runs)
    assert (agg["ms"], agg["time_ratio"], agg["cost_over_bound"]) == (11.0, 1.12, 1.12)
    assert agg["cost_over_bound_runs"] == [1.20, 1.05, 1.12]
    assert [(g["goal"], g["met"]) for g in agg["goals"]] == [("cost / bound", False)]
    assert "1.05–1.20" in bl.format_table([agg])
    with pytest.raises(ValueError, match="different rows"):
        bl.aggregate_runs([[row(1.0, 1.0)], [row(1.0, 1.0, name="cem T=4 tied")]])


def test_bench_layers_rejects_zero_processes(bench):
    with pytest.raises(ValueError, match="--processes 0 must be at least 1"):
        bench["bench_layers"].main(["--quick", "--processes", "0"])


@pytest.mark.slow  # two fresh interpreters importing torch and transformers: 30-80 s on 2 cores
def test_bench_layers_processes_end_to_end(bench, tmp_path):
    out = tmp_path / "layers.json"
    assert bench["bench_layers"].main(["--quick", "--rows", "cem T=1", "--processes", "2", "--out", str(out)]) == 0
    rows = _load(out)["rows"]
    assert {r["row"] for r in rows} == {"transformers LlamaDecoderLayer", "cem T=1 tied"}
    assert all(len(r["cost_over_bound_runs"]) == 2 for r in rows)


def test_bench_layers_rejects_an_unknown_row(bench):
    with pytest.raises(ValueError, match="'nope' matches no row"):
        bench["bench_layers"].select_rows(["nope"])
    with pytest.raises(ValueError, match="four positive integers"):
        bench["bench_layers"].parse_shape("1,2,3")


def test_bench_layers_profile_prints_the_op_table(bench, capsys):
    assert bench["bench_layers"].main(["--profile", "nrgpt ff1 full J", "--profile-shape", "32,4,16,2"]) == 0
    out = capsys.readouterr().out
    assert "profile of 'nrgpt ff1 full J' at (d, H, N, B) = (32, 4, 16, 2)" in out
    assert "Self CPU" in out and "aten::" in out


def test_bench_models_and_generate_profile_one_row(bench, capsys):
    assert bench["bench_models"].main(["--quick", "--profile", "nrgpt ff1"]) == 0
    out = capsys.readouterr().out
    assert "profile of 'nrgpt ff1' at" in out and "training step" in out and "aten::" in out
    assert bench["bench_generate"].main(["--quick", "--profile", "llama", "--lengths", "4"]) == 0
    out = capsys.readouterr().out
    assert "profile of 'llama': 4 new tokens with the cache" in out and "aten::" in out
    with pytest.raises(ValueError, match="'cem' matches several rows"):
        bench["bench_models"].main(["--quick", "--profile", "cem"])


def test_bench_models_quick(bench, tmp_path):
    out = tmp_path / "models.json"
    assert bench["bench_models"].main(["--quick", "--rows", "cem T=1,nrgpt ff1", "--out", str(out)]) == 0
    data = _load(out)
    assert data["script"] == "bench_models" and data["settings"]["peak_flops"] > 0
    fam = {r["name"]: r for r in data["rows"] if "baseline" in r}
    assert set(fam) == {"llama", "cem T=1", "gpt_rec_parallel", "nrgpt ff1"}
    for r in fam.values():
        assert {"train_tok_s", "train_ratio", "flops_per_token", "mfu", "saved_mb", "flop_ratio",
                "cost_over_bound", "infer_ratio"} <= r.keys()
        assert 0 < r["mfu"] and r["saved_mb"] > 0
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["train_tok_s"] / data["settings"]["peak_flops"])
    assert fam["llama"]["train_ratio"] == 1.0
    ck = [r for r in data["rows"] if "family" in r]
    assert {r["family"] for r in ck} == {"cem", "nrgpt", "gpt_rec_parallel"}
    for r in ck:
        assert r["t4_saved_mb"] > 2 * r["t1_saved_mb"] > 0  # without checkpointing memory grows with T
        assert r["t4_ckpt_over_t1"] == pytest.approx(r["t4_ckpt_saved_mb"] / r["t1_saved_mb"])
    assert _goals(ck) == {"T=4 checkpointed / T=1 memory"}
    assert not _goals(fam.values())  # the MFU goal applies from d_model 256


def test_bench_models_mfu_goal_at_d256(bench, tmp_path):
    out = tmp_path / "models.json"
    bench["bench_models"].main(["--quick", "--d-model", "256", "--rows", "gpt", "--no-checkpointing",
                                "--out", str(out)])
    data = _load(out)
    assert data["settings"]["model_shape"]["d_model"] == 256 and data["settings"]["model_shape"]["n_heads"] == 8
    assert _goals(data["rows"]) == {"MFU"}


@pytest.mark.slow
def test_bench_models_quick_compile(bench, tmp_path):
    """torch.compile with inductor: tens of seconds even at the tiny shape."""
    out = tmp_path / "models.json"
    bench["bench_models"].main(["--quick", "--d-model", "256", "--compile", "--rows", "gpt_rec",
                                "--no-checkpointing", "--out", str(out)])
    (row,) = _load(out)["rows"]
    assert "compile_error" not in row, row.get("compile_error")
    assert {"compiled_ms", "compiled_mfu", "compile_speedup", "compile_s"} <= row.keys()
    assert _goals([row]) == {"MFU (best of eager, compiled)", "compiled speed-up"}


def test_bench_depth_quick_memory_is_flat_in_the_depth_for_a_fixed_k(bench, tmp_path):
    out = tmp_path / "depth.json"
    assert bench["bench_depth"].main(["--quick", "--out", str(out)]) == 0
    data = _load(out)
    assert data["script"] == "bench_depth" and data["settings"]["depths"] == [2, 4, 8]
    rows = {(r["family"], r["depth"]): r for r in data["rows"]}
    assert {f for f, _ in rows} == {"nrgpt ff2w", "gpt_rec_parallel", "cem"}
    for family in ("nrgpt ff2w", "gpt_rec_parallel", "cem"):
        at = {d: rows[family, d] for d in (2, 4, 8)}
        assert at[2]["truncated_saved_mb"] == at[2]["full_saved_mb"]  # k = depth: nothing truncated
        # equal up to a storage address reused by chance (the embeddings' saved ids are freed once the
        # truncation cuts them off, and the count is by address): a few hundred bytes (up to 0.12% seen
        # on a clean checkout), far below the full graph's growth with depth checked next
        assert at[8]["truncated_saved_mb"] == pytest.approx(at[4]["truncated_saved_mb"], rel=1e-2)
        assert at[8]["full_saved_mb"] > 1.5 * at[4]["full_saved_mb"]
        assert at[8]["truncated_over_full"] == pytest.approx(at[8]["truncated_saved_mb"] / at[8]["full_saved_mb"])
    assert _goals(data["rows"]) == {"k=2: memory at depth 8 / depth 4"}
    assert all(g["met"] for r in data["rows"] for g in r["goals"])

def test_bench_generate_quick_and_its_goal(bench, tmp_path):
    out = tmp_path / "generate.json"
    assert bench["bench_generate"].main(["--quick", "--out", str(out)]) == 0
    rows = _load(out)["rows"]
    assert {r["family"] for r in rows} == {"gpt", "llama"}
    assert all({"new_tokens", "cached_tok_s", "uncached_tok_s", "ratio"} <= r.keys() and not r["goals"]
               for r in rows)
    (g,) = bench["bench_generate"].row_goals({"new_tokens": 512, "ratio": 4.0})
    assert (g["goal"], g["met"]) == ("cached speed-up at 512 tokens", False)


# ------------------------------------------------------------------------------------------------
# report.py


def test_report_renders_every_script(bench, tmp_path):
    c = bench["common"]
    rows_layers = [{"shape": [64, 4, 32, 2], "row": "cem T=1 tied", "peer": "L", "ms": 1.0, "gflop": 0.1,
                    "time_ratio": 0.9, "flop_ratio": 0.93, "cost_over_bound": 0.97,
                    "goals": [c.goal("cost / bound", 0.97, "<=", 1.10), c.goal("speed-up", 1.01, ">=", 1.05)]}]
    rows_models = [{"name": "llama", "baseline": "llama", "params": 10, "train_tok_s": 1e4, "train_ratio": 1.0,
                    "flop_ratio": 1.0, "cost_over_bound": 1.0, "flops_per_token": 2e6, "mfu": 0.3,
                    "infer_ratio": 1.0, "saved_mb": 1.5, "goals": [c.goal("MFU", 0.3, ">=", 0.4)]},
                   {"name": "cem T=4 checkpointed vs T=1", "family": "cem", "memory": "saved_mb",
                    "t1_saved_mb": 1.0, "t4_saved_mb": 4.0, "t4_ckpt_saved_mb": 1.2, "t4_over_t1": 4.0,
                    "t4_ckpt_over_t1": 1.2, "recompute_time_ratio": 1.3,
                    "goals": [c.goal("T=4 checkpointed / T=1 memory", 1.2, "<=", 1.3)]}]
    rows_generate = [{"family": "gpt", "new_tokens": 512, "cached_tok_s": 100.0, "uncached_tok_s": 10.0,
                      "ratio": 10.0, "goals": [c.goal("cached speed-up", 10.0, ">=", 5)]}]
    for script, rows in (("bench_layers", rows_layers), ("bench_models", rows_models),
                         ("bench_generate", rows_generate)):
        c.write_results(tmp_path / f"{script}-cpu.json", "cpu", {"quick": False}, rows, script=script)
    md = tmp_path / "tables.md"
    assert bench["report"].main(["--results", str(tmp_path), "--out", str(md)]) == 0
    text = md.read_text()
    sections = text.split("### ")[1:]
    assert [s.split(":")[0] for s in sections] == ["bench_layers", "bench_models", "bench_generate"]
    assert "| cem T=1 tied | L | 1.0 | 0.90 | 0.93 | 0.97 | cost / bound ≤ 1.1; speed-up ≥ 1.05 | " \
           "met (0.97); **missed** (1.01) |" in text
    assert "| cem | saved_mb | 1.0 | 4.0 | 1.2 | 4.00 | 1.20 | 1.30 |" in text
    assert "| 30.0% |" in text and "| 2.0 |" in text  # MFU and MFLOP per token
    assert "| gpt | 512 | 10.0 | 100.0 | 10.0 | cached speed-up ≥ 5 | met (10.00) |" in text
    assert text.count("Goals met: 1 of 2.") == 2 and "Goals met: 1 of 1." in text


def test_report_says_what_is_missing(bench, tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.json in"):
        bench["report"].main(["--results", str(tmp_path)])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        bench["report"].main(["--results", str(tmp_path)])


def test_bad_arguments_are_one_error_line(bench, tmp_path, capsys, monkeypatch):
    """A bad argument or input file is one ``error:`` line and exit 2, not a traceback."""
    run_main = bench["common"].run_main
    assert run_main(lambda: bench["bench_layers"].main(["--quick", "--profile", "nosuch"])) == 2
    assert run_main(lambda: bench["bench_layers"].main(["--quick", "--profile-shape", "1,2"])) == 2
    assert run_main(lambda: bench["report"].main(["--results", str(tmp_path / "missing")])) == 2
    (tmp_path / "x.json").write_text('{"a": 1}')
    assert run_main(lambda: bench["report"].main(["--results", str(tmp_path)])) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)
    assert "'nosuch' matches no row" in err[0] and "needs --profile ROW" in err[1]
    assert "does not exist" in err[2] and "is not a benchmark result" in err[3]
    monkeypatch.setenv("ENERGYFORMER_MALLOC", "bogus")  # the process set-up's errors too: one line, status 2
    assert run_main(lambda: 0) == 2
    assert capsys.readouterr().err.startswith("error: ENERGYFORMER_MALLOC='bogus'")


# ------------------------------------------------------------------------------------------------
# gpu_check.py (issues 17, 30): the CPU smoke run, a kill mid-row, and each section's row on its own


def _gpu_check_cmd(out, *extra):
    return [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--tiny", "--out", str(out), *extra]


def _gpu_check_env(**extra):
    return {**os.environ, "PYTHONPATH": str(BENCH.parent), "OMP_NUM_THREADS": "1", **extra}


def test_gpu_check_tiny_cpu_smoke(tmp_path):
    """``gpu_check.py --device cpu --tiny`` in a subprocess: the preflight and every section in
    results.json, the table and one goal line per goal. (Rows a loaded machine has no time for are
    stopped or skipped with a note by the script's own time limits; the rows are tested one by
    one below. No wall-time assertion: this 2-core machine's load decides it; the timeout only
    catches a hang.)"""
    out = tmp_path / "results.json"
    proc = subprocess.run(_gpu_check_cmd(out, "--budget", "20"), capture_output=True, text=True, timeout=600,
                          env=_gpu_check_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert list(data["sections"]) == ["env", "pytest", "train", "attention", "checkpointing", "generation",
                                      "compile"]
    for name, sec in data["sections"].items():
        assert "error" not in sec and "skipped" not in sec and "running" not in sec, (name, sec)
    assert data["preflight"]["fatal"] is None and data["preflight"]["checks"]["imports"]["ok"]
    assert data["sections"]["env"]["env"]["device"] == "cpu" and data["sections"]["env"]["peak_flops"] > 0
    assert data["sections"]["env"]["env"]["cudnn_sdpa_avoid_recompile"] == "1"
    pytest_sec = data["sections"]["pytest"]
    assert pytest_sec["timed_out"] or "skipped" in pytest_sec["summary"]
    assert "no goal on the CPU" in pytest_sec["note"]
    assert (tmp_path / "test_cuda.log").exists()
    assert data["elapsed_s"] <= 20 + 30  # the budget, plus pytest's 5 s minimum and a loaded machine's slack
    goal_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("goal ")]
    assert len(goal_lines) == len(data["goals"])
    assert all(" met " in ln or " MISSED " in ln for ln in goal_lines)
    assert f"goals: {sum(g['met'] for g in data['goals'])} of {len(data['goals'])} met" in proc.stdout


def test_gpu_check_killed_mid_row_keeps_every_finished_row(tmp_path):
    """SIGKILL while a row runs (the test hook makes the attention row 'cem diag_shared' sleep):
    results.json, rewritten atomically after every row, holds the preflight, env and the finished
    'nrgpt full J' row with its numbers and goal, and names the row that was running."""
    out = tmp_path / "results.json"
    proc = subprocess.Popen(_gpu_check_cmd(out, "--only", "env,attention", "--budget", "600"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_gpu_check_env(EF_GPU_CHECK_TEST_SLEEP="cem diag_shared:600"))
    try:
        deadline = time.monotonic() + 300
        data = {}
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                data = json.loads(out.read_text())  # never a half-written file: it is replaced atomically
                if data.get("sections", {}).get("attention", {}).get("running", {}).get("name") == "cem diag_shared":
                    break
            time.sleep(0.05)
        else:
            pytest.fail(f"the run never reached row 'cem diag_shared' (exit {proc.poll()}); last results: {data}")
    finally:
        proc.kill()
        proc.wait()
    data = json.loads(out.read_text())
    assert data["preflight"]["fatal"] is None and "peak_flops" in data["sections"]["env"]
    (row,) = data["sections"]["attention"]["rows"]
    assert row["name"] == "nrgpt full J" and row["sdpa_ms"] > 0 and row["scores_ms"] > 0 and row["seconds"] > 0
    assert [g["row"] for g in data["goals"]] == ["nrgpt full J"] and data["goals"] == row["goals"]
    assert data["sections"]["attention"]["running"]["name"] == "cem diag_shared"


@pytest.fixture(scope="module")
def gpu_check(bench):
    with on_sys_path(BENCH):
        yield importlib.import_module("gpu_check")


def _tiny_ctx(gc, tmp_path, out=None):
    ctx = gc.Ctx(device="cpu", tiny=True, shape=gc.MODEL_SHAPES["tiny"], vocab=gc.TINY_VOCAB, repeats=1, warmup=0,
                 backend="eager", log_dir=tmp_path, peak=1e9, datasheet_peak=2e9, out=out)
    ctx.results = {"sections": {}, "goals": ctx.goals}
    return ctx


def test_gpu_check_rows_and_goals(gpu_check, tmp_path):
    """Each section's row function on the tiny shape: the fields the table reads and the goals it
    adds (bf16 speed-up, math kernel, MFU; attention paths; compile; checkpointing), and the
    report's goal lines."""
    gc = gpu_check
    ctx = _tiny_ctx(gc, tmp_path)
    fams = dict(gc.train_families(ctx.shape))
    assert list(fams)[: len(gc.TRAIN_ORDER)] == list(gc.TRAIN_ORDER)
    row = gc.train_row(ctx, "gpt", fams["gpt"])
    assert {"fp32_ms", "bf16_ms", "bf16_tok_s", "bf16_mfu", "bf16_mfu_datasheet", "bf16_speedup", "peak_mb",
            "flops_per_token"} <= row.keys()
    assert row["bf16_mfu_datasheet"] == pytest.approx(row["bf16_mfu"] / 2)
    assert row["sdpa_kernels"] == {"flash_cpu": 4}  # forward + backward of 2 layers, read from the profiler
    assert [g["goal"] for g in row["goals"]] == ["bf16 speed-up over fp32", "math-kernel SDPA calls (bf16)",
                                                 "MFU (bf16, timed peak)"]
    assert row["goals"][1]["met"] and row["goals"][2]["target"] == 0.40
    assert gc.mfu_goal("nrgpt ff2w") == gc.mfu_goal("cem diag_shared") == 0.30
    assert gc.mfu_goal("gpt_rec_parallel") is None
    cases = gc.attention_cases(ctx.shape.d_model, ctx.shape.n_heads)
    att = gc.attention_row(ctx, "cem diag_per_head", cases["cem diag_per_head"])
    assert att["default_path"] == "sdpa" and att["sdpa_ms"] > 0 and att["scores_ms"] > 0  # the CPU keeps SDPA
    assert att["max_abs_diff"] <= 1e-4 * max(att["max_abs"], 1.0) and att["goals"][0]["met"]
    assert gc.attention_row(ctx, "cem diag_shared", cases["cem diag_shared"])["default_path"] == "scores"
    comp = gc.compile_row(ctx, "cem T=1", fams["cem T=1"])
    assert comp["speedup"] > 0 and comp["compile_s"] > 0 and comp["goals"][0]["target"] == 1.0
    ck = gc.checkpoint_row(ctx, "nrgpt T=4", 4)
    assert 0 < ck["saved_ratio"] <= 0.35 and ck["goals"][0]["met"]  # T = 4 recomputed: a fraction of the bytes
    assert ck["goals"][0]["goal"] == "checkpointed / plain saved bytes" and ck["plain_peak_mb"] is None
    gen = gc.generation_row(ctx, "nrgpt ff2w", fams["nrgpt ff2w"])
    assert gen["same_tokens"] and gen["speedup"] > 0 and set(gen["warmup_ms"]) == {"cached", "uncached"}
    text = gc.report({"sections": {"train": {"rows": [row, {"name": "llama", "skipped": "budget"}]},
                                   "compile": {"rows": [comp]}}}, ctx.goals)
    assert "| gpt |" in text and "| llama | budget |" in text and "compile: cem T=1:" in text
    assert text.count("\ngoal ") == len(ctx.goals) == 7


def test_gpu_check_rows_are_saved_stopped_at_their_share_and_errors_are_rows(gpu_check, tmp_path, monkeypatch):
    gc = gpu_check
    out = tmp_path / "r.json"
    ctx = _tiny_ctx(gc, tmp_path, out=out)
    items = [("a", 1), ("b", 2)]
    rows = gc.guarded_rows(ctx, "s1", time.monotonic() - 1, items, lambda c, n, i: {"name": n})
    assert [r["skipped"] for r in rows] == ["the section's time budget was spent"] * 2

    def boom(c, n, i):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

    rows = gc.guarded_rows(ctx, "s2", time.monotonic() + 60, items, boom)
    assert [r["error"] for r in rows] == ["RuntimeError: CUDA out of memory. Tried to allocate 2 GiB"] * 2
    saved = []
    monkeypatch.setattr(gc, "write_json", lambda path, res: saved.append(json.loads(json.dumps(res, default=str))))
    # row 'a' sleeps past its share (half of 8 s); 'b' still runs in the rest, with seconds to spare for
    # an alarm delivered late on loaded cores (at 4 s of budget a late one left 'b' nothing)
    monkeypatch.setenv(gc.SLEEP_HOOK, "a:30")
    t0 = time.monotonic()
    rows = gc.guarded_rows(ctx, "s3", time.monotonic() + 8.0, items, lambda c, n, i: {"name": n, "x": i})
    assert time.monotonic() - t0 < 16
    assert rows[0]["stopped"].startswith("stopped at its share of the budget") and rows[1] == {
        "name": "b", "x": 2, "seconds": rows[1]["seconds"]}
    s3 = [s["sections"]["s3"] for s in saved]  # before and after every row
    assert [s.get("running", {}).get("name") for s in s3] == ["a", None, "b", None]
    assert [len(s["rows"]) for s in s3] == [0, 1, 1, 2]
    assert s3[0]["running"]["limit_s"] == pytest.approx(4.0, abs=0.2)  # half of 8 s (equal weights)
    ctx.min_row_s = 3.0  # the first row gets at least this while the section has it
    gc.guarded_rows(ctx, "s4", time.monotonic() + 4.0, items, lambda c, n, i: {"name": n})
    first = next(s["sections"]["s4"] for s in saved if "s4" in s["sections"])  # saved before row 'a'
    assert first["running"]["limit_s"] == pytest.approx(3.0, abs=0.05)  # (how many saves follow depends on load)


def test_gpu_check_pytest_counts_only_passes(gpu_check):
    """On a GPU the CUDA tests count only when every one passed: a skip (the module skipped for
    want of CUDA) or a timeout misses the goal."""
    gc = gpu_check
    assert gc.pytest_counts("==== 40 passed, 2 skipped, 1 failed, 3 errors in 9.1s ====") == {
        "passed": 40, "skipped": 2, "failed": 1, "error": 3}
    assert gc.pytest_not_passed(gc.pytest_counts("44 passed in 50s"), False) == 0
    assert gc.pytest_not_passed(gc.pytest_counts("1 skipped in 2s"), False) == 2  # skipped, none passed
    assert gc.pytest_not_passed(gc.pytest_counts("43 passed, 1 skipped in 50s"), False) == 1
    assert gc.pytest_not_passed({}, True) == 2


def test_gpu_check_preflight_finds_what_is_missing(gpu_check, monkeypatch):
    gc = gpu_check
    real = gc.importlib.util.find_spec
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda n: None if n == "jsonargparse" else real(n))
    monkeypatch.setattr(gc.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    pre = gc.preflight("cpu", "inductor", tiny=True)
    assert pre["fatal"] is None
    assert not pre["checks"]["vendored_deps"]["ok"] and "jsonargparse" in pre["checks"]["vendored_deps"]["detail"]
    assert not pre["checks"]["c_compiler"]["ok"]
    assert set(pre["skip"]) == {"pytest", "compile"} and "C compiler" in pre["skip"]["compile"]
    assert "compile" not in gc.preflight("cpu", "eager", tiny=True)["skip"]  # only inductor compiles C
    if not torch.cuda.is_available():
        assert "CUDA is not available" in gc.preflight("cuda", "eager", tiny=True)["fatal"]


def test_gpu_check_compile_child_writes_its_row(gpu_check, tmp_path):
    """The subprocess of a compile row (``--compile-row``), run in-process: one row in its JSON."""
    out = tmp_path / "compile-gpt.json"
    assert gpu_check.main(["--compile-row", "gpt", "--device", "cpu", "--tiny", "--out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["name"] == "gpt" and row["speedup"] > 0 and row["goals"][0]["goal"] == "compiled speed-up over eager"


def test_gpu_check_bad_arguments(gpu_check, capsys):
    assert gpu_check.run_main(lambda: gpu_check.main(["--only", "trian"])) == 2
    assert "error: section 'trian' is unknown; expected one of: env, pytest" in capsys.readouterr().err
    assert gpu_check.run_main(lambda: gpu_check.main(["--device", "cpu", "--budget", "0"])) == 2
    assert "error: --budget 0.0 must be a positive" in capsys.readouterr().err


def test_sdpa_kernel_names(bench):
    of = bench["common"].sdpa_kernel_of
    assert of("aten::_scaled_dot_product_flash_attention") == of("aten::_flash_attention_backward") == "flash"
    assert of("aten::_scaled_dot_product_cudnn_attention") == "cudnn"
    assert of("aten::_efficient_attention_forward") == "efficient"
    assert of("aten::_scaled_dot_product_attention_math") == "math"
    assert of("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "flash_cpu"
    assert of("aten::scaled_dot_product_attention") is None and of("aten::mm") is None
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16)
    with sdpa_kernel(SDPBackend.MATH):
        kernels = bench["common"].sdpa_kernels(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
        assert kernels == {"math": 1}
