"""(b) ``gp_recursion``: in-context GP regression RMSE vs context length for CEM recursion
T ∈ {1, 2, 4, 8} at fixed parameters, with one learnable η factor per recursion step as an
option, against a Llama regressor, the exact GP posterior mean (the Bayes-optimal floor) and the
prior mean (docs/cem.md §6, §9).

Runs: the recipes ``configs/gp/{cem_t1, cem_t2, cem_t4, cem_t8, llama}.yaml`` (d_model 64, 2
layers, 2 heads, batch 64 sequences of 32 pairs); 5,000 steps, constant LR with a 10% linear
cooldown (``lr_schedule: wsd``), 50 evaluations; rows "η per step" add ``per_step_scale: true``
(η_t = η·c_t, c_t learnable, docs/cem.md §6). The LR of each family (CEM swept at T=1, Llama) is
chosen by a sweep over {3e-4, 1e-3, 3e-3} at 1,250 steps (seed 1), extended past an edge; every
other arm checks its own LR (the family's best and the half-decades either side, same budget) and
uses its own best. Every CEM run first sits on a loss plateau; the table gives the escape step (the
first evaluation below the midpoint of the first and the final validation loss), the fixed
validation MSE (whole split, kept weights), the test RMSE per context length, and each arm's
paired difference (by seed: the same batches) to T=1, to Llama and to the arm one step back
(:data:`PREVIOUS`: T=4 against T=2, T=8 against T=4, an η-per-step row against the same T). The
headline pair (:data:`DOUBLE`: T=2 against T=1) trains once more at twice the steps (seed 1), and a
last table shows whether the sign and size of its difference survive the longer run.

Budget (idle 2-core CPU, measured at 2 threads: a T=1 run 6.5 min, T=2 11–12, T=4 20, T=8 ≈ 40):
3 seeds of 5 configurations plus 2 "η per step" rows (1 seed each) at 5,000 steps, 8 family
sweep runs and 15 per-arm check runs ≈ 7 hours; the 2× pair ≈ 40 min more. ``--quick``: 200 tiny sequences of 8 points,
d_model 16, 20 steps.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from energyformer.experiments import common as ex
from energyformer.experiments import convergence as conv
from energyformer.experiments import report
from energyformer.experiments.sweeps import half_decade, lr_sweep, sweep_table

#: label -> (recipe, LR family, model overrides, default seeds)
ARMS: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "cem T=1": ("gp/cem_t1.yaml", "cem", {}, 3),
    "cem T=2": ("gp/cem_t2.yaml", "cem", {}, 3),
    "cem T=4": ("gp/cem_t4.yaml", "cem", {}, 3),
    "cem T=8": ("gp/cem_t8.yaml", "cem", {}, 3),
    "cem T=4, η per step": ("gp/cem_t4.yaml", "cem", {"per_step_scale": True}, 1),
    "cem T=8, η per step": ("gp/cem_t8.yaml", "cem", {"per_step_scale": True}, 1),
    "llama": ("gp/llama.yaml", "llama", {}, 3),
}
#: the arm each arm is compared with one step back: the next-shallower T (does more recursion still
#: pay?) and, for the η-per-step rows, the same T with one shared η (what the per-step factor adds)
PREVIOUS: dict[str, str] = {"cem T=2": "cem T=1", "cem T=4": "cem T=2", "cem T=8": "cem T=4",
                            "cem T=4, η per step": "cem T=4", "cem T=8, η per step": "cem T=8"}
#: the headline comparison (does the second recursion step help?), trained once more at twice the
#: steps (seed 1) to show whether its sign and size survive a longer run
DOUBLE = ("cem T=1", "cem T=2")
SWEEP_RECIPE = {"cem": "gp/cem_t1.yaml", "llama": "gp/llama.yaml"}
STEPS, SWEEP_STEPS, LRS = 5000, 1250, (3e-4, 1e-3, 3e-3)


def data_section(ctx: ex.Context) -> dict[str, Any] | None:
    """The prepared GP data (quick: tiny settings prepared into the work directory)."""
    if not ctx.quick:
        return None
    from energyformer.data.task_data import prepare_task_data

    out = prepare_task_data("gp", out_dir=ctx.runs / "data" / "gp", verbose=False, n_points=8, n_train=200,
                            n_val=32, n_test=32)
    return {"dataset": out.name, "root": str(out.parent)}


def config(ctx: ex.Context, recipe: str, model: dict[str, Any], lr: float, steps: int, seed: int) -> dict[str, Any]:
    quick_block = {"block_size": 16} if ctx.quick else {}
    return ex.resolve(ctx, recipe, {"model": model}, {"train": {**ex.schedule(ctx, steps, lr), "seed": seed}},
                   {"model": quick_block}, data=data_section(ctx))


def escape_step(run_dir) -> int | None:
    """The first evaluation step whose val loss is below the midpoint of the first and the last."""
    steps, vals = conv.val_curve(run_dir)
    if len(vals) < 2:
        return None
    mid = (vals[0] + vals[-1]) / 2
    return next((s for s, v in zip(steps, vals) if v < mid), None)


def run_name(label: str, seed: int, tag: str = "") -> str:
    """``<slug>[_<tag>]_s<seed>``, e.g. ``cem_T2_s1``, ``cem_T2_2x_s1``."""
    slug = label.replace(' ', '_').replace('=', '').replace(',', '').replace('η', 'eta')
    return f"{slug}{f'_{tag}' if tag else ''}_s{seed}"


def lr_check(ctx: ex.Context, label: str, family_best: dict[str, float]) -> dict[str, Any]:
    """Arm ``label``'s own LR check: its family's best LR (from the family sweep) and the half-decades
    either side, at the sweep's budget (seed 1); the family's sweep arm itself (T=1, Llama) is its sweep."""
    recipe, family, model, _ = ARMS[label]
    if SWEEP_RECIPE[family] == recipe and not model:
        return {}
    best = family_best[family]
    lrs = (half_decade(best, up=False), best, half_decade(best, up=True))
    slug = run_name(label, 0)[:-3].lower()
    return lr_sweep(ctx, f"gp_{slug}", lambda lr, steps: config(ctx, recipe, model, lr, steps, 1), lrs,
                           SWEEP_STEPS)


def run(ctx: ex.Context) -> dict[str, Any]:
    """Sweep the LR per family, check it per arm, train every arm's seeds, score RMSE per context length
    on the test split and the fixed validation MSE."""
    from energyformer.data.gp import load_gp_split
    from energyformer.data.meta import load_meta
    from energyformer.experiments.stats import format_difference, paired_difference
    from energyformer.runs.rundir import load_run
    from energyformer.tasks.gp import evaluate_regressor

    data = data_section(ctx)
    data_dir = f"{data['root']}/{data['dataset']}" if data else f"{ctx.data_root}/gp"
    settings = load_meta(data_dir)["settings"]
    test = load_gp_split(data_dir, "test")
    val_floors = _val_floors(load_gp_split(data_dir, "val"), settings)
    sweeps = {fam: lr_sweep(ctx, f"gp_{fam}", lambda lr, steps, r=recipe: config(ctx, r, {}, lr, steps, 1), LRS,
                               SWEEP_STEPS) for fam, recipe in SWEEP_RECIPE.items()}
    ex.need_runs(ctx)
    family_best = {fam: s["best_lr"] for fam, s in sweeps.items()}
    checks = {label: lr_check(ctx, label, family_best) for label in ARMS}
    ex.need_runs(ctx)
    lr = {label: (checks[label] or sweeps[ARMS[label][1]])["best_lr"] for label in ARMS}
    trained = {label: {seed: ex.train_or_resume(ctx, run_name(label, seed),
                                                config(ctx, recipe, model, lr[label], STEPS, seed))
                       for seed in ctx.seed_list(n_seeds)}
               for label, (recipe, _, model, n_seeds) in ARMS.items()}
    doubled = {label: ex.train_or_resume(ctx, run_name(label, 1, "2x"),
                                         config(ctx, ARMS[label][0], ARMS[label][2], lr[label], 2 * STEPS, 1))
               for label in DOUBLE}
    ex.need_runs(ctx)
    results: dict[str, Any] = {}
    groups: dict[str, list] = {}
    floor = None
    for label, by_seed in trained.items():
        per_seed = []
        for seed, summary in by_seed.items():
            where = ex.record_dir(ctx, run_name(label, seed))
            groups.setdefault(label, []).append(where)
            net, _, _ = load_run(where, language_model=False)
            ev = evaluate_regressor(net, test, settings)
            floor = ev
            per_seed.append({**ev, "seed": seed, "params": summary["params"], "val_mse": summary["final_eval"]["value"],
                             "convergence": conv.convergence(where), "escape_step": escape_step(where)})
        results[label] = {"lr": lr[label], "seeds": per_seed}
    rmse = {label: {s["seed"]: s["rmse_model"] for s in r["seeds"]} for label, r in results.items()}
    for label, r in results.items():
        r["vs_t1"] = paired_difference(rmse["cem T=1"], rmse[label])
        r["vs_llama"] = paired_difference(rmse["llama"], rmse[label])
        before = PREVIOUS.get(label)
        r["vs_previous"] = {"arm": before, **paired_difference(rmse[before], rmse[label])} if before in rmse else None
    floor = {**floor, **val_floors}
    table = _table(results, floor)
    table += "\n\n" + report.markdown_table(
        ["model", "Δ RMSE vs cem T=1 (paired, 95% interval)", "Δ RMSE vs llama",
         "Δ RMSE vs the arm one step back (paired, 95% interval)"],
        [[label, "–" if label == "cem T=1" else format_difference(r["vs_t1"]),
          "–" if label == "llama" else format_difference(r["vs_llama"]),
          f"vs {r['vs_previous']['arm']}: {format_difference(r['vs_previous'])}" if r["vs_previous"] else "–"]
         for label, r in results.items()])
    check, check_rows = _budget_check(ctx, results, {"base": trained, "2x": doubled}, test, settings)
    table += "\n\n" + check
    _plots(ctx, results, floor, groups)
    header = (f"In-context GP regression (x_dim {settings['x_dim']}, length scale {settings['length_scale']}, "
              f"noise {settings['noise']}), RMSE on {floor['n']} test sequences (all positions, per context length), "
              "and the fixed validation MSE (the whole validation split, kept weights); mean ± std over seeds "
              "(η-per-step rows: 1 seed); Δ: paired by seed (the same batches for every arm). Escape: first evaluation "
              "below the midpoint of the first and final val loss. " + conv.CONVERGED_NOTE)
    sweep_list = list(sweeps.values()) + [c for c in checks.values() if c]
    return report.write_results(ctx, table, {"settings": settings, "rows": results, "budget_check": check_rows,
                                             "lr_sweeps": sweep_list,
                                      "floors": {k: floor[k] for k in ("val_mse_gp_floor", "val_mse_prior",
                                                                       "rmse_gp_floor", "rmse_prior")}},
                            header, "LR sweeps and per-arm checks (seed 1, final val MSE on the whole validation "
                            "split during training):\n\n" + sweep_table(sweep_list))


def _budget_check(ctx: ex.Context, results: dict[str, Any], summaries: dict[str, dict[str, Any]], test: np.ndarray,
                  settings: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """:data:`DOUBLE`'s pair at the main budget (seed 1 of the main runs) and at twice the steps: test RMSE
    and convergence of each (:func:`energyformer.experiments.report.budget_check`)."""
    from energyformer.runs.rundir import load_run
    from energyformer.tasks.gp import evaluate_regressor

    a, b = DOUBLE
    base = {label: next(s for s in results[label]["seeds"] if s["seed"] == 1) for label in DOUBLE}
    longer = {}
    for label in DOUBLE:
        where = ex.record_dir(ctx, run_name(label, 1, "2x"))
        net, _, _ = load_run(where, language_model=False)
        longer[label] = {"rmse_model": evaluate_regressor(net, test, settings)["rmse_model"],
                         "convergence": conv.convergence(where)}
    steps = {"base": summaries["base"][a][1]["steps"], "2x": summaries["2x"][a]["steps"]}
    return report.budget_check(
        [(f"{b} − {a}", steps[k], (pts[a]["rmse_model"], pts[a]["convergence"]),
          (pts[b]["rmse_model"], pts[b]["convergence"])) for k, pts in (("base", base), ("2x", longer))], "test RMSE")


def _val_floors(val: np.ndarray, settings: dict[str, Any]) -> dict[str, float]:
    """The floors of the val MSE column on the validation split ``(S, n, x_dim + 1)`` itself: the MSE
    of the exact GP posterior mean (Bayes-optimal) and of the prior mean 0, over every position."""
    import torch

    from energyformer.tasks.gp import posterior_mean

    y = torch.as_tensor(val[..., -1]).double()
    post = posterior_mean(val, settings["length_scale"], settings["variance"], settings["noise"])
    return {"val_mse_gp_floor": float((post - y).pow(2).mean()), "val_mse_prior": float(y.pow(2).mean())}


def _table(results: dict[str, Any], floor: dict[str, Any]) -> str:
    n = len(floor["context"])
    picks = sorted({0, 1, min(4, n - 1), n // 2, n - 1})
    head = ["model", "LR", "params", "seeds", "escape step", "converged", "val MSE", "RMSE (all positions)"] + \
        [f"RMSE @ {c} pairs" for c in picks]
    rows = []
    for label, r in results.items():
        seeds = r["seeds"]
        esc = [s["escape_step"] for s in seeds if s["escape_step"] is not None]
        rows.append([label, f"{r['lr']:g}", f"{seeds[0]['params']:,}", len(seeds), report.pm(esc, 0),
                     conv.converged_cell([s["convergence"] for s in seeds]), report.pm([s["val_mse"] for s in seeds]),
                     report.pm([s["rmse_model"] for s in seeds])]
                    + [report.pm([s["model"][c] for s in seeds]) for c in picks])
    blank = ["–"] * 5
    rows.append(["GP posterior mean (Bayes floor)"] + blank + [f"{floor['val_mse_gp_floor']:.4f}",
                                                               f"{floor['rmse_gp_floor']:.4f}"]
                + [f"{floor['gp_floor'][c]:.4f}" for c in picks])
    rows.append(["prior mean (0)"] + blank + [f"{floor['val_mse_prior']:.4f}", f"{floor['rmse_prior']:.4f}"]
                + [f"{floor['prior'][c]:.4f}" for c in picks])
    return report.markdown_table(head, rows)


def _plots(ctx: ex.Context, results: dict[str, Any], floor: dict[str, Any], groups) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = len(floor["context"])
    ctxs = np.arange(n)
    for label, r in results.items():
        m = np.array([report.mean_std([s["model"][c] for s in r["seeds"]])[0] for c in range(n)])
        ax.plot(ctxs, m, label=label)
    ax.plot(ctxs, floor["gp_floor"], "k--", label="GP posterior mean (floor)")
    ax.plot(ctxs, floor["prior"], "k:", label="prior mean")
    report.finish_axes(ax, "context length (pairs before the query)", "RMSE")
    report.save_figure(ctx, fig, "rmse_vs_context.png")
    report.plot_learning_curves(ctx, groups, "curves.png",
                         floors={"GP posterior mean (val MSE floor)": floor["val_mse_gp_floor"]}, ylabel="val MSE")
