"""`energyformer experiment NAME --quick` for every experiment: the pipeline (data, training, metrics,
results files, reusing finished runs), not the science (tiny sizes, seconds each); and the pieces
the protocols rest on: recipes + overrides, run records, LR sweeps, the convergence measure."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from energyformer.cli import main
from energyformer.experiments import EXPERIMENTS, common, run_experiment
from energyformer.experiments.common import Context, resolve, same_config, schedule
from energyformer.experiments.convergence import converged_cell, convergence
from energyformer.experiments.sweeps import lr_sweep, sweep_table

REPO = Path(__file__).resolve().parents[2]


def _untracked(root):
    """``git status`` of ``root`` (porcelain, every untracked file listed)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, check=True,
                          capture_output=True, text=True).stdout.splitlines()


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_quick(name, tmp_path, capsys, monkeypatch):
    # run as a user does, from the root of a checkout (a git repository with the project's .gitignore)
    # with every default path: --quick must leave `git status` clean
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    monkeypatch.chdir(tmp_path)
    results_dir = tmp_path / "results"
    args = ["experiment", name, "--quick", "--seeds", "1"]
    assert main(args) == 0
    capsys.readouterr()
    assert not results_dir.exists(), "--quick never writes into the results directory"
    assert _untracked(tmp_path) == ["?? .gitignore"], "--quick leaves git status clean"
    work = tmp_path / "out" / "experiments"
    out = work / "quick-results" / name
    table = (out / "table.md").read_text()
    assert table.count("|") > 10 and f"Reproduce: `energyformer experiment {name} --quick --seeds 1`" in table
    assert "converged" in table, "every table says whether its runs converged"
    assert "floor" in table.lower(), "every table stands beside its floors"
    results = json.loads((out / "results.json").read_text())
    assert results["experiment"] == name and results["quick"] is True
    assert list(out.glob("*.png")), "every experiment writes its plots"
    if name == "inference_steps":  # both NRGPT η arms and CEM T=2, each from its source experiment
        assert len(results["rows"]) == 3 and any("c_diag_gamma" in s for s in results["sources"])
        for label, (seed_entry,) in results["rows"].items():  # Δ = each K's loss − the trained K's, same seed
            trained = seed_entry["trained_steps"]
            ref = seed_entry["loss"][seed_entry["k"].index(trained)]
            assert f"| {label} | {trained} (trained) | {ref:.4f} | 0 (reference) |" in table
            for k, loss in zip(seed_entry["k"], seed_entry["loss"]):
                if k != trained:
                    assert f"| {label} | {k} | {loss:.4f} | {loss - ref:+.4f} (n=1) |" in table
    else:  # inference_steps trains nothing of its own: it reuses the runs of energy_descent and cem_ablation
        assert (out / "curves.png").is_file() or (out / "loss_curves.png").is_file()
        runs = sorted(p.name for p in (out / "runs").iterdir())
        assert runs and all((out / "runs" / r / "summary.json").is_file() for r in runs)
    if name == "gp_recursion":  # each arm against the arm one step back, paired by seed, from the per-seed RMSEs
        from energyformer.experiments.gp_recursion import PREVIOUS
        from energyformer.experiments.stats import format_difference

        rows = results["rows"]
        for label, before in PREVIOUS.items():
            d = rows[label]["vs_previous"]
            want = rows[label]["seeds"][0]["rmse_model"] - rows[before]["seeds"][0]["rmse_model"]
            assert d["arm"] == before and d["n"] == 1 and abs(d["mean"] - want) < 1e-12
            assert f"vs {before}: {format_difference(d)} |" in table
        assert rows["cem T=1"]["vs_previous"] is None and rows["llama"]["vs_previous"] is None
        # the val MSE column's floors are computed on the validation split itself, not read off the test RMSE
        f = results["floors"]
        assert 0 < f["val_mse_gp_floor"] < f["val_mse_prior"] and f["val_mse_gp_floor"] != f["rmse_gp_floor"] ** 2
        assert f"| GP posterior mean (Bayes floor) | – | – | – | – | – | {f['val_mse_gp_floor']:.4f} | " \
               f"{f['rmse_gp_floor']:.4f} |" in table
    if name in ("gp_recursion", "energy_descent", "shakespeare_scaling"):
        # the headline pair once more at twice the steps, beside the same pair (seed 1) at the main budget
        checks = results["budget_check"]
        assert len(checks) >= 2 and len({r["steps"] for r in checks}) == 1  # --quick: both budgets are 20 steps
        for r in checks:
            assert r["difference"] == r["b"] - r["a"]
            assert f"| {r['comparison']} | {r['steps']:,} | {r['a']:.4f} | {r['b']:.4f} | {r['difference']:+.4f} |" \
                in table
        assert sum("_2x_" in r for r in runs) == 2, runs
    if name == "gp_recursion":  # the base row is the main runs' seed 1 (--quick trains the 2× runs for the
        # same 20 steps, so their RMSE equals it)
        base, _ = results["budget_check"]
        assert base["a"] == results["rows"]["cem T=1"]["seeds"][0]["rmse_model"]
        assert base["b"] == results["rows"]["cem T=2"]["seeds"][0]["rmse_model"]
    if name == "energy_descent":  # the 2× rows read the 2× runs' fixed evaluation and trace their descent
        base, longer = results["budget_check"]
        rows = list(results["rows"].values())
        assert (base["a"], base["b"]) == (rows[0]["seeds"][0]["val_loss"], rows[1]["seeds"][0]["val_loss"])
        kept = [json.loads((out / "runs" / f"nrgpt_{eta}_2x_s1" / "final_eval.json").read_text())["value"]
                for eta in ("c_diag_gamma", "full")]
        assert [longer["a"], longer["b"]] == kept
        assert all(0 <= v <= 1 for v in longer["monotone_last_step"].values())
        for label, r in results["rows"].items():  # the base row's descent is seed 1's own trace at 4 steps
            assert base["monotone_last_step"][label] == r["seeds"][0]["trace"]["4"]["monotone_from"][-1]
    if name == "shakespeare_scaling":  # every width trains at its own checked LR (d 64's failed at d 128)
        from energyformer.runs.config import load_config

        best = {s["family"]: s["best_lr"] for s in results["lr_sweeps"]}
        for label, rows in results["rows"].items():
            slug = label.replace(" ", "_")
            for r in rows:
                want = best[slug] if r["width"] == 16 else best[f"{slug}_d{r['width']}"]
                cfg = load_config(out / "runs" / f"{slug}_d{r['width']}_s1" / "config.yaml")
                assert cfg.train.learning_rate == want
                assert f"| {label} | {r['width']} | {r['params']:,} | {want:g} |" in table
        # every model against GPT at each width, at equal width and at equal parameters, in the table
        from energyformer.experiments.stats import format_difference

        assert len(results["differences"]) == 6
        for d in results["differences"]:
            cells = [format_difference(x) for what in ("gap_growth", "val_same") for x in d[what]]
            assert f"| {d['comparison']} | {d['width']} | " + " | ".join(cells) + " |" in table
    # a second call, as on a fresh checkout (every trained run directory gone, only the records under
    # NAME/runs and the data left; inference_steps: those of its source experiments), reuses every
    # finished run from its record instead of training it again, and writes the same table
    for runs in work.glob("*-quick"):
        for d in runs.iterdir():
            if d.name != "data":
                shutil.rmtree(d)
    assert main(args) == 0
    again = capsys.readouterr().out
    assert "finished earlier" in again and ": best val " not in again
    assert (out / "table.md").read_text() == table
    assert _untracked(tmp_path) == ["?? .gitignore"]


def test_resolve_is_recipe_plus_overrides():
    ctx = Context("x")
    cfg = resolve(ctx, "shakespeare_char/nrgpt.yaml", {"model": {"d_model": 64}},
                  {"train": {**schedule(ctx, 1000, 3e-3), "seed": 7}})
    assert cfg["model"]["d_model"] == 64 and cfg["model"]["ff"] == "ff2w"  # the rest from the recipe
    assert cfg["train"]["lr_schedule"] == "wsd" and cfg["train"]["lr_decay_steps"] == 1000
    assert cfg["train"]["cooldown_steps"] == 100 and cfg["train"]["min_lr"] == pytest.approx(3e-4)
    assert cfg["train"]["eval_interval"] == 20 and cfg["train"]["seed"] == 7
    assert cfg["data"] == {"dataset": "shakespeare_char", "root": "data"} and cfg["train"]["device"] == "cpu"
    quick = resolve(Context("x", quick=True), "shakespeare_char/nrgpt.yaml")
    assert quick["model"]["d_model"] == 16 and "d_ff" not in quick["model"]  # only keys the model has
    assert quick["train"]["max_steps"] == common.QUICK["train"]["max_steps"]


def test_resolve_reads_the_bundled_recipes_of_an_installed_wheel(tmp_path, monkeypatch):
    """A wheel has no configs/ beside the package, only energyformer/configs/ (utils.bundled): the
    experiments read their recipes there, as ``train`` does, from any working directory."""
    from energyformer.utils import bundled

    package = tmp_path / "site-packages" / "energyformer"
    shutil.copytree(bundled.recipes_dir(), package / "configs")
    recipe = package / "configs" / "shakespeare_char" / "nrgpt.yaml"
    recipe.write_text(recipe.read_text().replace("n_steps:", "n_steps: 5  # was", 1))
    monkeypatch.setattr(bundled, "_PACKAGE", package)  # as installed: no ../configs
    monkeypatch.chdir(tmp_path)
    assert common.recipe_path("shakespeare_char/nrgpt.yaml") == recipe
    assert resolve(Context("x"), "shakespeare_char/nrgpt.yaml")["model"]["n_steps"] == 5
    monkeypatch.setattr(bundled, "_PACKAGE", tmp_path / "nowhere" / "energyformer")
    with pytest.raises(FileNotFoundError, match="no bundled recipes were found"):
        resolve(Context("x"), "shakespeare_char/nrgpt.yaml")


def _fake_run(tmp_path, vals, every=100, steps=1000, cooldown=100):
    from energyformer.runs.config import load_config, save_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config({"model": {"arch": "gpt", "vocab_size": 8, "d_model": 8, "n_heads": 2, "n_layers": 1,
                                 "block_size": 8},
                       "train": {"max_steps": steps, "lr_schedule": "wsd", "cooldown_steps": cooldown}})
    save_config(cfg, run / "config.yaml")
    with open(run / "metrics.jsonl", "w") as f:
        for i, v in enumerate(vals):
            f.write(json.dumps({"step": (i + 1) * every, "val_loss": v}) + "\n")
    return run


def test_convergence_slope_and_plateau(tmp_path):
    # falling 0.02 per 100 steps until the cooldown (step 900): window 630..900, drop 0.054 on ~2.86 > 1%,
    # an exact line, so its standard error is 0 and the whole interval is above the threshold: "no"
    falling = _fake_run(tmp_path, [3.0 - 0.02 * i for i in range(10)])
    c = convergence(falling)
    assert c["window"] == [630, 900] and c["evals_in_window"] == 3
    assert c["slope_per_1k"] == pytest.approx(-0.2) and c["slope_se_per_1k"] == pytest.approx(0, abs=1e-9)
    assert c["verdict"] == "no" and c["converged"] is False
    assert c["drop"] == pytest.approx(0.054) and c["drop_rel"] == pytest.approx(0.054 / 2.86)  # mean of 2.88..2.84
    shutil.rmtree(falling)
    # nearly flat (0.0001 per 100 steps) with little noise: the interval is below 1%: "yes"
    flat = _fake_run(tmp_path, [3.0, 2.5, 2.2, 2.1, 2.05, 2.0300, 2.0301, 2.0297, 2.0299, 1.9], every=100)
    c = convergence(flat)
    assert c["verdict"] == "yes" and c["converged"] is True and c["drop_rel_hi"] < 0.01
    shutil.rmtree(flat)
    # a noisy curve that rises across the window is not called converged (it was, under the 1% rule)
    noisy = _fake_run(tmp_path, [3.0, 2.5, 2.2, 2.1, 2.05, 1.90, 2.15, 1.95, 2.20, 1.8], every=100)
    c = convergence(noisy)
    assert c["slope_per_1k"] > 0 and c["verdict"] == "unclear" and c["converged"] is False
    shutil.rmtree(noisy)
    # a loss rising steadily (overfitting) is past its best, not flat
    rising = _fake_run(tmp_path, [3.0, 2.5, 2.2, 2.1, 2.0, 2.05, 2.1, 2.15, 2.2, 2.1], every=100)
    assert convergence(rising)["verdict"] == "rising" and convergence(rising)["converged"] is False
    shutil.rmtree(rising)
    c = convergence(_fake_run(tmp_path, [3.0, 2.0]))
    assert c["converged"] is None and c["verdict"] is None  # too few evaluations
    assert converged_cell([c]) == "–"


def test_converged_cell_counts_verdicts_and_pools_the_slope_errors():
    convs = [{"verdict": "no", "slope_per_1k": -0.02, "slope_se_per_1k": 0.003},
             {"verdict": "unclear", "slope_per_1k": -0.01, "slope_se_per_1k": 0.004},
             {"verdict": "no", "slope_per_1k": -0.03, "slope_se_per_1k": 0.0}]
    assert converged_cell(convs) == "2 no, 1 unclear (-0.020 ± 0.002/1k)"  # sqrt(9+16)/3 = 1.67e-3
    assert converged_cell(convs[:1]) == "no (-0.020 ± 0.003/1k)"


def test_lr_sweep_picks_lowest_and_a_diverged_run_loses(tmp_path, monkeypatch):
    ctx = Context("x", work_dir=tmp_path, results_dir=tmp_path / "r", verbose=False)
    outcomes = {1e-3: {"final_val_loss": 2.0}, 3e-3: {"diverged": True, "message": "nan"},
                3e-4: {"final_val_loss": 2.5}}
    monkeypatch.setattr(common, "train_or_resume", lambda ctx, name, cfg, **kw: outcomes[cfg["lr"]])
    got = lr_sweep(ctx, "fam", lambda lr, steps: {"lr": lr}, (3e-4, 1e-3, 3e-3), 10)
    assert got["best_lr"] == 1e-3 and got["final_val_loss"][2] == float("inf")
    assert got["lrs"] == [3e-4, 1e-3, 3e-3]  # the best is inside the grid: no extension
    assert got["steps"] == 10
    shrunk = lr_sweep(ctx, "fam", lambda lr, steps: {"lr": lr, "train": {"max_steps": 4}}, (3e-4, 1e-3, 3e-3), 10)
    assert shrunk["steps"] == 4  # the table shows what the runs trained (quick mode), not what was asked
    assert "diverged" in sweep_table([got])


def _sweep_with_losses(tmp_path, monkeypatch, losses, grid):
    """``lr_sweep`` over ``grid`` with the final losses ``losses`` (lr → loss); returns (result, LRs asked)."""
    ctx = Context("x", work_dir=tmp_path, results_dir=tmp_path / "r", verbose=False)
    asked = []

    def fake(ctx, name, cfg, **kw):
        asked.append(cfg["lr"])
        return {"final_val_loss": losses[cfg["lr"]]}

    monkeypatch.setattr(common, "train_or_resume", fake)
    return lr_sweep(ctx, "fam", lambda lr, steps: {"lr": lr}, grid, 10), asked


def test_lr_sweep_extends_upward_past_the_upper_edge(tmp_path, monkeypatch):
    """The best LR at the top of the grid: one more value above (never below); it stops once that loses."""
    losses = {1e-4: 3.0, 3e-4: 2.5, 1e-3: 2.2, 3e-3: 2.0, 1e-2: 2.1, 3e-2: 9.0}
    got, asked = _sweep_with_losses(tmp_path, monkeypatch, losses, (3e-4, 1e-3, 3e-3))
    assert got["best_lr"] == 3e-3 and got["lrs"] == [3e-4, 1e-3, 3e-3, 1e-2]
    assert asked == [3e-4, 1e-3, 3e-3, 1e-2] and 3e-2 not in asked and 1e-4 not in asked
    got, _ = _sweep_with_losses(tmp_path, monkeypatch, losses, (1e-3, 3e-3, 1e-2))
    assert got["best_lr"] == 3e-3 and got["lrs"] == [1e-3, 3e-3, 1e-2]  # no edge: no extension


def test_lr_sweep_extends_downward_past_the_lower_edge(tmp_path, monkeypatch):
    """The best LR at the bottom of the grid: one more value below (never above); it stops once that loses."""
    losses = {1e-5: 9.0, 3e-5: 2.1, 1e-4: 2.0, 3e-4: 2.2, 1e-3: 2.5, 3e-3: 3.0}
    got, asked = _sweep_with_losses(tmp_path, monkeypatch, losses, (3e-4, 1e-3, 3e-3))
    assert got["lrs"] == [3e-5, 1e-4, 3e-4, 1e-3, 3e-3] and got["best_lr"] == 1e-4
    assert asked == [3e-4, 1e-3, 3e-3, 1e-4, 3e-5] and 1e-5 not in asked and 1e-2 not in asked


def test_same_config_ignores_run_time_options_only(tmp_path):
    from energyformer.runs.config import load_config, save_config

    base = {"model": {"arch": "gpt", "vocab_size": 8, "d_model": 8, "n_heads": 2, "n_layers": 1, "block_size": 8},
            "train": {"max_steps": 5, "num_threads": 1, "out_dir": str(tmp_path / "a")}}
    run = tmp_path / "a"
    run.mkdir()
    save_config(load_config(base), run / "config.yaml")
    (run / "summary.json").write_text("{}")
    assert same_config(run, {**base, "train": {"max_steps": 5, "num_threads": 2, "out_dir": "elsewhere"}})
    assert not same_config(run, {**base, "train": {"max_steps": 6}})


def test_experiment_errors(tmp_path, capsys):
    assert main(["experiment", "nope"]) == 2
    assert "experiment='nope' is not valid" in capsys.readouterr().err
    with pytest.raises(ValueError, match="seeds=0 must be >= 1"):
        run_experiment("gp_recursion", seeds=0)
    with pytest.raises(ValueError, match="profile"):
        run_experiment("gp_recursion", profile="laptop")
    # a full run needs the prepared data and says which command makes it
    assert main(["experiment", "listops_transition", "--seeds", "1", "--data-root", str(tmp_path / "none"),
                 "--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")]) == 2
    assert "energyformer prepare listops" in capsys.readouterr().err


def test_an_unfinished_run_resumes_from_its_recorded_partial(tmp_path, capsys):
    """record_partial keeps the checkpoint of a run cut short; a fresh work directory resumes it."""
    from energyformer.experiments import energy_descent
    from energyformer.experiments.common import record_partial, train_or_resume

    ctx = Context("energy_descent", seeds=1, quick=True, work_dir=tmp_path / "w", verbose=True)
    cfg = energy_descent.config(ctx, "full", 1e-3, 20, 1)
    short = {**cfg, "train": {**cfg["train"], "max_steps": 10}}  # the same run, stopped at step 10
    from energyformer.runs.config import load_config
    from energyformer.train import train

    run = ctx.runs / "r"
    train(load_config({**short, "train": {**short["train"], "out_dir": str(run)}}, resolve_vocab=True), progress=False)
    (run / "summary.json").unlink()  # as if killed after its last checkpoint
    assert record_partial(ctx, "r") is not None
    shutil.rmtree(run)
    capsys.readouterr()
    train_or_resume(ctx, "r", short)
    said = capsys.readouterr().out
    assert "resuming the recorded partial run" in said and not (ctx.out / "partial" / "r").exists()
    summary = json.loads((ctx.records / "r" / "summary.json").read_text())
    assert summary["resumed_from"] == 10 and summary["steps_this_run"] == 0


def test_lr_sensitivity_spreads_are_read_from_the_sweeps():
    """The LR-sensitivity table (NRGPT vs GPT_Rec_parallel) takes each family's loss at 3e-4/1e-3/3e-3
    from its sweep (extensions ignored) and reports worst − best and its ratio to the best."""
    from energyformer.experiments.energy_descent import lr_sensitivity

    sweeps = [{"family": "nrgpt_full", "lrs": [3e-4, 1e-3, 3e-3, 1e-2], "final_val_loss": [2.2, 1.9, 1.8, 1.6]},
              {"family": "gpt_rec_parallel", "lrs": [3e-4, 1e-3, 3e-3], "final_val_loss": [2.0, 1.9, float("inf")]}]
    table, rows = lr_sensitivity(sweeps)
    assert rows[0]["spread"] == pytest.approx(0.4) and rows[0]["relative_spread"] == pytest.approx(0.4 / 1.8)
    assert rows[1]["spread"] == float("inf") and "diverged" in table
    assert "| nrgpt_full | 2.2000 | 1.9000 | 1.8000 | 0.4000 | 22.2% |" in table


def test_lr_cost_per_seed_and_against_the_recurrent_gpt():
    """The LR cost is each seed's loss at ÷3 / ×3 minus its loss at the best LR (fixed evaluation), and the
    sensitivity claim is the family's cost minus GPT_Rec_parallel's, paired by seed."""
    from energyformer.experiments.energy_descent import cost_against, lr_cost

    def runs(losses):  # lr -> (seed 1, seed 2) losses
        return {lr: {seed: {"final_eval": {"value": v}} for seed, v in zip((1, 2), vs)} for lr, vs in losses.items()}

    nrgpt = lr_cost(runs({1e-3: (2.0, 2.1), 3e-3: (1.9, 1.9), 1e-2: (2.3, 2.2)}))
    diverged = {3e-2: {1: {"diverged": True}, 2: {"final_eval": {"value": 1.83}}}}
    rec = lr_cost({**runs({3e-3: (1.85, 1.82), 1e-2: (1.80, 1.81)}), **diverged})
    assert nrgpt["cost_by_seed"]["down"] == pytest.approx({1: 0.1, 2: 0.2})
    assert nrgpt["cost_by_seed"]["up"] == pytest.approx({1: 0.4, 2: 0.3})
    assert rec["cost_by_seed"]["up"][1] == float("inf"), "a diverged run costs without bound"
    vs = cost_against({"nrgpt": nrgpt, "gpt_rec_parallel": rec})
    assert list(vs) == ["nrgpt"]
    assert vs["nrgpt"]["down"]["mean"] == pytest.approx(((0.1 - 0.05) + (0.2 - 0.01)) / 2)
    assert vs["nrgpt"]["down"]["n"] == 2


def test_listops_more_seeds_go_to_the_widths_beside_the_transition():
    from energyformer.experiments.listops_transition import next_to_transition

    assert next_to_transition([(16, 0.3), (24, 0.5), (32, 0.85), (40, 0.9), (50, 0.95)]) == [24, 32]
    assert next_to_transition([(16, 0.3), (24, 0.82), (32, 0.7), (40, 0.9)]) == [16, 24]  # the first crossing
    assert next_to_transition([(16, 0.9), (24, 0.95)]) == [16]  # all above: the narrowest
    assert next_to_transition([(16, 0.1), (24, 0.2)]) == [24]  # none reaches it: the widest
    assert next_to_transition([]) == []


def test_shakespeare_scaling_gap_growth_reads_the_curve_after_one_epoch(tmp_path):
    from energyformer.experiments.shakespeare_scaling import gap_growth

    rows = [{"step": 50, "val_loss": 2.0, "train_loss_eval": 2.0},
            {"step": 100, "val_loss": 1.8, "train_loss_eval": 1.7},
            {"step": 120, "train_loss": 1.5}, {"step": 200, "val_loss": 1.7, "train_loss_eval": 1.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = gap_growth(tmp_path, epoch_steps=90)
    assert g["epoch1_step"] == 100 and g["epoch1"] == pytest.approx(0.1) and g["final"] == pytest.approx(0.3)
    assert g["growth"] == pytest.approx(0.2)
    (tmp_path / "metrics.jsonl").write_text("")
    assert gap_growth(tmp_path, 90)["growth"] is None


def test_shakespeare_scaling_compares_with_gpt_at_equal_width_and_at_equal_parameters():
    """NRGPT has about a quarter of GPT's parameters at the same width, so "overfits less" is read at the
    same width and against GPT's width curve (same seed, linear in log parameters) at NRGPT's size."""
    import math

    from energyformer.experiments.shakespeare_scaling import GAP_METRICS, matched_difference

    def row(width, seed, params, growth, val=1.6):
        return {"width": width, "seed": seed, "params": params, "gap": {"growth": growth}, "val_same": val}

    results = {"GPT": [row(32, s, 50_000, 0.06 + d) for s, d in ((1, 0.0), (2, 0.01))]
               + [row(64, s, 200_000, 0.12 + d) for s, d in ((1, 0.0), (2, 0.01))]
               + [row(128, s, 800_000, 0.30 + d) for s, d in ((1, 0.0), (2, 0.01))],
               "NRGPT FF2W": [row(32, 1, 20_000, 0.05), row(32, 2, 20_000, 0.04),
                              row(128, 1, 400_000, 0.10), row(128, 2, 400_000, None)]}
    growth = GAP_METRICS["gap_growth"]
    width, params = matched_difference(results, "NRGPT FF2W", 128, growth)
    # seed 2's missing growth drops that pair; 400k lies halfway in log size between GPT's 200k and 800k
    assert width["n"] == 1 and math.isclose(width["mean"], 0.10 - 0.30)
    assert params["n"] == 1 and math.isclose(params["mean"], 0.10 - (0.12 + 0.30) / 2)
    width, params = matched_difference(results, "NRGPT FF2W", 32, growth)
    assert width["n"] == 2 and math.isclose(width["mean"], ((0.05 - 0.06) + (0.04 - 0.07)) / 2)
    assert width["lo"] is not None and width["lo"] < width["mean"] < width["hi"]
    # 20k parameters lie below GPT's smallest width: no reading, not an extrapolation
    assert params["mean"] is None and params["n"] == 0
    assert matched_difference(results, "GPT_Rec_parallel", 32, growth)[0]["mean"] is None


def test_listops_width_stage_trains_each_model_at_its_own_checked_lr(tmp_path, monkeypatch):
    """Past the pilot (its accuracy level lowered so that a quick pilot opens the stage), every model gets
    its own LR check (the pilot's LR and the values either side, extended past an edge) and trains every
    width at its own best LR."""
    from energyformer.experiments import listops_transition as lt
    from energyformer.runs.config import load_config

    monkeypatch.setattr(lt, "PILOT_LEVEL", 0.0)
    ctx = Context("listops_transition", seeds=1, quick=True, work_dir=tmp_path / "w", verbose=False)
    out = lt.run(ctx)
    for label in lt.MODELS:
        slug = label.replace(" ", "_")
        check = out["lr_checks"][label]
        assert set(lt.CHECK_LRS) <= set(check["lrs"]) and check["best_lr"] in check["lrs"]
        assert all((ctx.records / f"sweep_{slug}_lr{lr:g}").is_dir() for lr in check["lrs"])
        for w in (8, 16):
            assert load_config(ctx.records / f"{slug}_d{w}_s1" / "config.yaml").train.learning_rate == check["best_lr"]
        assert [r["width"] for r in out["widths"][label]] == [8, 16]
    # every record keeps its scores (the table's and the README's source); a second call reads them back
    kept = json.loads((ctx.records / "pilot_GPT_Rec_parallel_d8_s1" / lt.LISTOPS_EVAL_FILE).read_text())
    assert kept["inputs"]["test_problems"] == 20 and 0.0 <= kept["accuracy"] <= 1.0 and kept["weights_sha256"]

    def not_again(*args, **kwargs):
        raise AssertionError("a kept ListOps evaluation was computed again")

    monkeypatch.setattr("energyformer.tasks.listops.listops_report", not_again)
    again = lt.run(ctx)
    assert again["widths"] == out["widths"]


def test_listops_row_of_several_seeds_summarises_every_seed():
    """A width trained with extra seeds shows every column over all its seeds (an earlier table put
    seed 1's val loss and convergence beside the seeds' mean accuracy)."""
    from energyformer.experiments.listops_transition import HEAD, _row

    def ev(acc, answer, end, verdict, slope, single):
        return {"accuracy": acc, "stderr": 0.02, "end_token_rate": end, "answer_loss": {"loss": answer},
                "convergence": {"verdict": verdict, "slope_per_1k": slope, "slope_se_per_1k": 0.001},
                "single_function": {"max": {"accuracy": single}, "median": {"accuracy": 0.5}}}

    one = dict(zip(HEAD, _row("m", 32, 1234, [ev(0.8, 0.1, 1.0, "no", -0.004, 0.9)], [0.85])))
    assert one["accuracy ± s.e."] == "0.800 ± 0.020" and one["val loss"] == "0.8500"
    assert one["converged"] == "no (-0.004 ± 0.001/1k)"
    row = dict(zip(HEAD, _row("m", 32, 1234, [ev(0.8, 0.1, 1.0, "no", -0.004, 0.9),
                                               ev(0.6, 0.3, 0.9, "unclear", -0.002, 0.7)], [0.85, 0.95])))
    assert row["accuracy ± s.e."] == "0.700 ± 0.141 (2 seeds)"
    assert row["val loss"] == "0.9000 ± 0.0707" and row["loss after first ="] == "0.2000 ± 0.1414"
    assert row["end-token rate"] == "0.950" and row["converged"].startswith("1 no, 1 unclear (-0.003")
    assert row["single-function accuracy"] == "max 0.80 / median 0.50"


def test_a_pending_sweep_does_not_hold_back_another_sweeps_runs(tmp_path, monkeypatch):
    """Under ``--jobs`` two independent LR sweeps queue their runs in the same round (a sweep still
    training held back every later sweep's runs, leaving a core idle); a run configured from a
    pending sweep's result is still held back."""
    ctx = Context("x", work_dir=tmp_path, results_dir=tmp_path / "r", verbose=False)
    ctx.deferred = True
    monkeypatch.setattr(common, "same_config", lambda where, cfg: False)
    a = lr_sweep(ctx, "a", lambda lr, steps: {"lr": lr}, (1e-3, 3e-3), 10)
    b = lr_sweep(ctx, "b", lambda lr, steps: {"lr": lr}, (1e-3, 3e-3), 10)
    assert a["pending"] and b["pending"] and ctx.waiting_for_sweep
    assert sorted(ctx.pending) == ["sweep_a_lr0.001", "sweep_a_lr0.003", "sweep_b_lr0.001", "sweep_b_lr0.003"]
    common.train_or_resume(ctx, "main_s1", {"lr": a["best_lr"]})
    assert "main_s1" not in ctx.pending


def test_inference_compute_evaluation_is_cached_per_entry_and_weights(tmp_path, monkeypatch):
    """A model's evaluation is computed once and read back; a longer threshold grid computes only its
    new exit entries; new weights compute everything again; the convergence test is read fresh."""
    from energyformer.experiments import inference_compute as ic
    from energyformer.experiments.scoring import WEIGHTS_FILE

    ctx = Context("inference_compute", work_dir=tmp_path / "w", results_dir=tmp_path / "r", verbose=False)
    run = tmp_path / "runs" / "nrgpt_full_random_s1"
    run.mkdir(parents=True)
    (run / WEIGHTS_FILE).write_bytes(b"weights 1")
    calls = {"load": 0, "eval": [], "corr": 0}

    class Run:
        class data:
            path = str(tmp_path)

        class train:
            batch_size = 2

        class model:
            block_size = 4

    def load_run(where):
        calls["load"] += 1
        return None, Run, None

    monkeypatch.setattr("energyformer.runs.rundir.load_run", load_run)
    monkeypatch.setattr("energyformer.data.load_split", lambda path, split: list(range(100)))
    monkeypatch.setattr(ic, "evaluate", lambda model, batches, **kw: calls["eval"].append(kw) or
                        {"loss": 2.0, "mean_steps": float(kw["n_steps"])})
    monkeypatch.setattr(ic, "energy_loss_correlation", lambda model, b: calls.__setitem__("corr", calls["corr"] + 1)
                        or {"pearson": 0.1, "spearman": 0.2, "tokens": 8})
    monkeypatch.setattr(ic.conv, "convergence", lambda where: {"verdict": "fresh"})
    monkeypatch.setattr(ic, "THRESHOLDS",
                        {"abs": (1.0,), "rel": (0.1,), "kl": (0.01,), "energy": (1.0,), "grad": (1.0,)})
    label, depth = "NRGPT free η", "random (mean 4)"
    first = ic.evaluation(ctx, label, depth, run)
    n_k, n_exits = ic.MAX_STEPS, 5 * 2  # 5 criteria at caps 4 and 16
    assert len(calls["eval"]) == n_k + n_exits and calls["corr"] == 1
    assert set(first["exit"]) == set(ic.exit_specs(ctx, label, depth)) and first["convergence"] == {"verdict": "fresh"}
    assert (ctx.out / ic.EVALS_DIR / f"{run.name}.json").is_file()
    assert ic.evaluation(ctx, label, depth, run)["loss"] == first["loss"] and len(calls["eval"]) == n_k + n_exits
    assert calls["load"] == 1  # read back without loading the model
    monkeypatch.setattr(ic, "THRESHOLDS", {**ic.THRESHOLDS, "kl": (0.1, 0.01)})
    longer = ic.evaluation(ctx, label, depth, run)
    assert len(calls["eval"]) == n_k + n_exits + 2  # kl:0.1 at both caps, nothing else
    assert {"kl:0.1@4", "kl:0.1@16", "kl:0.01@4"} <= set(longer["exit"]) and calls["corr"] == 1
    monkeypatch.setattr(ic, "THRESHOLDS", {**ic.THRESHOLDS, "kl": (0.01,)})
    assert "kl:0.1@4" not in ic.evaluation(ctx, label, depth, run)["exit"]  # only the grid asked for
    (run / WEIGHTS_FILE).write_bytes(b"weights 2")  # same size, other bytes: the sha256 tells
    ic.evaluation(ctx, label, depth, run)
    assert len(calls["eval"]) == 2 * (n_k + n_exits) + 2 and calls["corr"] == 2


def test_cem_ablation_queues_its_runs_most_informative_first(tmp_path, monkeypatch):
    """The ``--jobs`` pool trains in queue order, so a budget cut drops what comes last: one seed of
    every width (the matched curves) and the verdict's checks (cooldown pair, 2× budget) come
    before the width sweep's further seeds."""
    from energyformer.experiments import cem_ablation as ca

    ctx = Context("cem_ablation", quick=True, seeds=2, work_dir=tmp_path, verbose=False)
    ctx.deferred = True
    monkeypatch.setattr(ca, "lr_check", lambda ctx, label: {"best_lr": 1e-3})
    with pytest.raises(common.PendingRuns):
        ca.run(ctx)
    import re

    order = list(ctx.pending)
    width = [bool(re.search(r"_d\d+_", n)) for n in order]
    checks = [i for i, n in enumerate(order) if "cooldown" in n or "2x" in n]
    base = [i for i, n in enumerate(order) if not width[i] and i not in checks]
    first = [i for i, n in enumerate(order) if width[i] and n.endswith("_s1")]
    more = [i for i, n in enumerate(order) if width[i] and not n.endswith("_s1")]
    assert base and first and checks and more, order
    assert max(base) < min(first) and max(first) < min(checks) and max(checks) < min(more), order
    assert len(first) == len(more) == len(ca.WIDTH_FAMILIES) * (len(ca.widths(ctx)) - 1)


def test_budget_check_rows_and_a_missing_value():
    from energyformer.experiments.report import budget_check

    conv = {"verdict": "no", "slope_per_1k": -0.02, "slope_se_per_1k": 0.005}
    text, rows = budget_check([("B − A", 5000, (1.5, conv), (1.4, conv)), ("B − A", 10000, (None, {}), (1.3, conv))],
                              "val loss")
    assert rows[0]["difference"] == 1.4 - 1.5 and rows[1]["difference"] is None
    assert "| B − A | 5,000 | 1.5000 | 1.4000 | -0.1000 | no (-0.020 ± 0.005/1k); no (-0.020 ± 0.005/1k) |" in text
    assert "| B − A | 10,000 | – | 1.3000 | – | –; no" in text


def test_shakespeare_scaling_queues_the_2x_pair_after_seed_1_and_before_seed_2(tmp_path, monkeypatch):
    """A budget cut drops the further seeds first, not the check of the headline pair at twice the steps,
    and the 2× pair trains at the widest width at that width's own LR, for twice the main steps."""
    from energyformer.experiments import shakespeare_scaling as ss

    ctx = Context("shakespeare_scaling", quick=True, seeds=2, work_dir=tmp_path, verbose=False)
    ctx.deferred = True
    lrs = {"NRGPT_FF2W_d24": 3e-3, "GPT_d24": 2e-2}
    monkeypatch.setattr(ss, "lr_sweep", lambda ctx, family, *a, **k: {"best_lr": lrs.get(family, 1e-3)})
    calls = []
    real = ss.config
    monkeypatch.setattr(ss, "config", lambda *a, **k: calls.append(a) or real(*a, **k))
    with pytest.raises(common.PendingRuns):
        ss.run(ctx)
    order = list(ctx.pending)
    doubled = [i for i, n in enumerate(order) if "_2x_" in n]
    assert [order[i] for i in doubled] == ["GPT_d24_2x_s1", "NRGPT_FF2W_d24_2x_s1"]
    assert max(i for i, n in enumerate(order) if n.endswith("_s1") and "_2x_" not in n) < min(doubled)
    assert max(doubled) < min(i for i, n in enumerate(order) if n.endswith("_s2"))
    twice = [a for a in calls if a[4] == 2 * ss.STEPS]
    assert sorted((a[2], a[3], a[5]) for a in twice) == [(24, 0.003, 1), (24, 0.02, 1)]


def test_cem_ablation_matched_gap_reads_the_reference_curve_per_seed():
    """The equal-parameter gap is the model's loss minus the reference family's curve (same seed,
    linear in log size) at the model's size; outside the reference's widths there is no reading;
    the table prices T=2 and the full CEM against Llama as well as against T=1."""
    import math

    from energyformer.experiments import cem_ablation as ca

    def run(label, width, seed, params, loss, flops=None):
        return {"label": label, "width": width, "seed": seed, "params": params, "val_loss": loss,
                "train_flops": flops or params * 10.0}

    main = []
    for seed, shift in ((1, 0.0), (2, 0.01)):
        main += [run("llama", 64, seed, 100_000, 1.6 + shift), run("llama", 128, seed, 400_000, 1.4 + shift),
                 run("cem tied T=1", 64, seed, 50_000, 1.7 + shift), run("cem tied T=1", 128, seed, 200_000, 1.5),
                 run("cem full (T=2+D+LR+P)", 128, seed, 200_000, 1.45 + 2 * shift, flops=4_000_000.0)]
    # Llama's curve at 200k params: halfway in log size between 100k and 400k
    gap = ca.matched_gap(main, "cem tied T=1", "llama", 128, "params")
    want = {1: 1.5 - 1.5, 2: 1.5 - 1.51}
    assert gap["n"] == 2 and math.isclose(gap["mean"], sum(want.values()) / 2, abs_tol=1e-12)
    # 50k params lies below Llama's smallest width: no reading, not an extrapolation
    assert ca.matched_gap(main, "cem tied T=1", "llama", 64, "params")["mean"] is None
    # equal FLOPs reads the curve at the model's FLOPs (4e6 = Llama d 128's exactly)
    full = ca.matched_gap(main, "cem full (T=2+D+LR+P)", "llama", 128, "train_flops")
    assert math.isclose(full["mean"], ((1.45 - 1.4) + (1.47 - 1.41)) / 2, abs_tol=1e-12)
    main += [run("cem diag_shared", 128, 1, 200_500, 1.48), run("cem diag_shared", 128, 2, 200_500, 1.47)]
    table = ca._matched_table(main, 128)
    assert "cem full (T=2+D+LR+P) − llama" in table and "cem full (T=2+D+LR+P) − cem tied T=1" in table
    # the shared diagonal against tied T=1 at each width it was trained at, paired by seed: (−0.02 − 0.03) / 2
    assert "| cem diag_shared − cem tied T=1 | 128 | -0.0250 [" in table


def test_cem_ablation_interim_tables_train_nothing_and_name_the_missing_runs(tmp_path, capsys):
    """``--interim`` writes the tables of the runs recorded so far into NAME/interim/, names the runs
    not yet recorded and trains nothing; the other experiments and a missing LR check refuse it."""
    work = tmp_path / "work"
    args = ["experiment", "cem_ablation", "--quick", "--seeds", "1", "--work-dir", str(work)]
    assert main(args) == 0
    out = work / "quick-results" / "cem_ablation"
    full = (out / "table.md").read_text()
    gone = "cem_diag_shared_d8_s1"
    assert f"{gone}" in json.dumps(json.loads((out / "results.json").read_text()))
    shutil.rmtree(out / "runs" / gone)
    shutil.rmtree(work / "cem_ablation-quick" / gone)
    capsys.readouterr()
    assert main(args + ["--interim"]) == 0
    assert not (out / "runs" / gone).exists() and not (work / "cem_ablation-quick" / gone).exists(), \
        "--interim trained a missing run"
    said = capsys.readouterr().out
    assert f"interim tables in {out / 'interim'}: 1 run(s) not in the tables: 1 not recorded ({gone})" in said
    interim = (out / "interim" / "table.md").read_text()
    assert interim.startswith("**Interim**") and f"1 not recorded ({gone})" in interim
    assert "--interim" in interim and (out / "interim" / "loss_vs_size.png").is_file()
    assert (out / "table.md").read_text() == full, "the interim table never replaces the experiment's table"
    res = json.loads((out / "interim" / "results.json").read_text())
    assert res["interim"] is True and res["missing"] == {gone: "not recorded"}
    assert gone not in {r["name"] for r in res["runs"]}
    # a record that cannot stand for its run says why: without weights, or with another config
    (out / "runs" / "llama_d8_s1" / "model.safetensors").unlink()
    shutil.rmtree(work / "cem_ablation-quick" / "llama_d8_s1")
    missing = run_experiment("cem_ablation", seeds=1, quick=True, work_dir=work, verbose=False,
                             interim=True)["missing"]
    assert missing == {gone: "not recorded", "llama_d8_s1": "recorded without its weights (model.safetensors)"}
    # a missing LR check: the arms' LRs are unknown, so no table
    cfg = out / "runs" / "sweep_llama_lr0.001" / "config.yaml"
    cfg.write_text(cfg.read_text().replace("seed: 1", "seed: 7"))
    shutil.rmtree(work / "cem_ablation-quick" / "sweep_llama_lr0.001", ignore_errors=True)
    with pytest.raises(ValueError, match=r"sweep_llama_lr0.001 .* is recorded with another config \(train.seed\)"):
        run_experiment("cem_ablation", seeds=1, quick=True, work_dir=work, verbose=False, interim=True)
    with pytest.raises(ValueError, match="--interim is available for cem_ablation, not 'gp_recursion'"):
        run_experiment("gp_recursion", quick=True, work_dir=work, interim=True)
    with pytest.raises(ValueError, match="--interim works with the cpu profile, not 'paper'"):
        run_experiment("cem_ablation", profile="paper", work_dir=work, interim=True)
    # the full table supersedes the interim one
    shutil.rmtree(out / "runs" / "sweep_llama_lr0.001")
    assert main(args) == 0
    assert not (out / "interim").exists() and (out / "table.md").is_file()
