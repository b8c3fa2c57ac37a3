"""(b) ``gp_recursion``: in-context GP regression RMSE vs context length for CEM recursion
T ∈ {1, 2, 4, 8} at fixed parameters, with one learnable η factor per recursion step as an
option, against a Llama regressor, the exact GP posterior mean (the Bayes-optimal floor) and the
prior mean (docs/cem.md §6, §9).

Runs: the recipes ``configs/gp/{cem_t1, cem_t2, cem_t4, cem_t8, llama}.yaml`` (d_model 64, 2
layers, 2 heads, batch 64 sequences of 32 pairs); 5,000 steps, constant LR with a 10% linear
cooldown (``lr_schedule: wsd``), 50 evaluations; rows "η per step" add ``per_step_scale: true``
(η_t = η·c_t, c_t learnable, docs/cem.md §6). The LR of each family (CEM swept at T=1, Llama) is
chosen by a sweep over {3e-4, 1e-3, 3e-3} at 1,250 steps (seed 1). Every CEM run first sits on a
loss plateau; the table gives the escape step (the first evaluation below the midpoint of the
first and the final validation loss) and the RMSE of the trained model.

Budget (idle 2-core CPU): 3 seeds of 5 configurations plus 2 "η per step" rows (1 seed each) at
5,000 steps, and 6 sweep runs ≈ 3 hours (T=8 costs ≈ 8× a T=1 step). ``--quick``: 200 tiny
sequences of 8 points, d_model 16, 20 steps.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from energyformer.experiments import common as ex

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
    steps, vals = ex.val_curve(run_dir)
    if len(vals) < 2:
        return None
    mid = (vals[0] + vals[-1]) / 2
    return next((s for s, v in zip(steps, vals) if v < mid), None)


def run(ctx: ex.Context) -> dict[str, Any]:
    """Sweep the LR per family, train every arm's seeds, score RMSE per context length on the test split."""
    from energyformer.data.gp import load_gp_split
    from energyformer.data.meta import load_meta
    from energyformer.runs.rundir import load_run
    from energyformer.tasks.gp import evaluate_regressor

    data = data_section(ctx)
    data_dir = f"{data['root']}/{data['dataset']}" if data else f"{ctx.data_root}/gp"
    settings = load_meta(data_dir)["settings"]
    test = load_gp_split(data_dir, "test")
    sweeps = {fam: ex.lr_sweep(ctx, f"gp_{fam}", lambda lr, steps, r=recipe: config(ctx, r, {}, lr, steps, 1), LRS,
                            SWEEP_STEPS) for fam, recipe in SWEEP_RECIPE.items()}
    results: dict[str, Any] = {}
    groups: dict[str, list] = {}
    floor = None
    for label, (recipe, family, model, n_seeds) in ARMS.items():
        per_seed = []
        for seed in ctx.seed_list(n_seeds):
            name = f"{label.replace(' ', '_').replace('=', '').replace(',', '').replace('η', 'eta')}_s{seed}"
            cfg = config(ctx, recipe, model, sweeps[family]["best_lr"], STEPS, seed)
            summary = ex.train_or_resume(ctx, name, cfg, keep_weights=True)
            where = ex.record_dir(ctx, name)
            groups.setdefault(label, []).append(where)
            net, _, _ = load_run(where, language_model=False)
            ev = evaluate_regressor(net, test, settings)
            floor = ev
            per_seed.append({**ev, "params": summary["params"], "convergence": ex.convergence(where),
                             "escape_step": escape_step(where)})
        results[label] = {"lr": sweeps[family]["best_lr"], "seeds": per_seed}
    table = _table(results, floor)
    _plots(ctx, results, floor, groups)
    header = (f"In-context GP regression (x_dim {settings['x_dim']}, length scale {settings['length_scale']}, "
              f"noise {settings['noise']}), RMSE on {floor['n']} test sequences, mean ± std over seeds "
              "(η-per-step rows: 1 seed). Escape: first evaluation below the midpoint of the first and final val "
              "loss. Converged: the fitted val loss fell < 1% over the last 30% of the pre-cooldown steps.")
    return ex.write_results(ctx, table, {"settings": settings, "rows": results, "lr_sweeps": list(sweeps.values())},
                         header, "LR sweeps (seed 1, final val MSE):\n\n" + ex.sweep_table(list(sweeps.values())))


def _table(results: dict[str, Any], floor: dict[str, Any]) -> str:
    n = len(floor["context"])
    picks = sorted({0, 1, min(4, n - 1), n // 2, n - 1})
    head = ["model", "LR", "params", "seeds", "escape step", "converged", "RMSE (all positions)"] + \
        [f"RMSE @ {c} pairs" for c in picks]
    rows = []
    for label, r in results.items():
        seeds = r["seeds"]
        esc = [s["escape_step"] for s in seeds if s["escape_step"] is not None]
        rows.append([label, f"{r['lr']:g}", f"{seeds[0]['params']:,}", len(seeds), ex.pm(esc, 0),
                     ex.converged_cell([s["convergence"] for s in seeds]), ex.pm([s["rmse_model"] for s in seeds])]
                    + [ex.pm([s["model"][c] for s in seeds]) for c in picks])
    blank = ["–"] * 5
    rows.append(["GP posterior mean (Bayes floor)"] + blank + [f"{floor['rmse_gp_floor']:.4f}"]
                + [f"{floor['gp_floor'][c]:.4f}" for c in picks])
    rows.append(["prior mean (0)"] + blank + [f"{floor['rmse_prior']:.4f}"]
                + [f"{floor['prior'][c]:.4f}" for c in picks])
    return ex.markdown_table(head, rows)


def _plots(ctx: ex.Context, results: dict[str, Any], floor: dict[str, Any], groups) -> None:
    plt = ex.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = len(floor["context"])
    ctxs = np.arange(n)
    for label, r in results.items():
        m = np.array([ex.mean_std([s["model"][c] for s in r["seeds"]])[0] for c in range(n)])
        ax.plot(ctxs, m, label=label)
    ax.plot(ctxs, floor["gp_floor"], "k--", label="GP posterior mean (floor)")
    ax.plot(ctxs, floor["prior"], "k:", label="prior mean")
    ex.finish_axes(ax, "context length (pairs before the query)", "RMSE")
    ex.save_figure(ctx, fig, "rmse_vs_context.png")
    ex.plot_learning_curves(ctx, groups, "curves.png",
                         floors={"GP posterior mean (MSE floor)": floor["rmse_gp_floor"] ** 2}, ylabel="val MSE")
