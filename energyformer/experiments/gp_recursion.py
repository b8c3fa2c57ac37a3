"""(b) ``gp_recursion``: in-context GP regression RMSE vs context length for CEM recursion
T ∈ {1, 2, 4, 8} at fixed parameters, a Llama regressor, the exact GP posterior mean (the
Bayes-optimal floor) and the prior mean (docs/cem.md §6, §9).

Data: ``energyformer prepare gp`` (x ∈ R², 32 points, RBF length scale 0.5, noise 0.1).
Models: :class:`~energyformer.models.regression.SequenceRegressor`, d_model 64, 2 layers,
2 heads; CEM's recursion adds no parameters, so every CEM row has the same count.
Training: 1500 steps of 64 sequences, AdamW 1e-3, cosine; evaluated on the 1000 test sequences.

Budget: 5 configurations × 3 seeds; estimated 30–45 minutes on 2 CPU cores (T=8 costs about
8× a T=1 step). ``--quick``: 200 tiny sequences of 8 points, d_model 16, 20 steps, ≈ 10 s.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from energyformer.experiments.common import Context, finish_axes, save_figure, markdown_table, mean_std, pm, pyplot, train_or_resume, write_results

STEPS = (1, 2, 4, 8)


def data_section(ctx: Context) -> dict[str, Any]:
    """The prepared GP data (quick: tiny settings prepared into the work directory)."""
    if not ctx.quick:
        return {"dataset": "gp", "root": str(ctx.data_root)}
    from energyformer.data.task_data import prepare_task_data

    out = prepare_task_data("gp", out_dir=ctx.runs / "data" / "gp", verbose=False, n_points=8, n_train=200,
                            n_val=32, n_test=32)
    return {"dataset": out.name, "root": str(out.parent)}


def config(ctx: Context, model: dict[str, Any], seed: int, data: dict[str, Any]) -> dict[str, Any]:
    q = ctx.quick
    shape = {"arch": "regressor", "x_dim": 2, "d_model": 16 if q else 64, "n_layers": 2, "n_heads": 2,
             "d_ff": 48 if q else 176, "block_size": 16 if q else 64}
    train = {"max_steps": 20 if q else 1500, "batch_size": 8 if q else 64, "learning_rate": 1e-3, "min_lr": 1e-4,
             "warmup_steps": 5 if q else 100, "eval_interval": 10 if q else 250, "log_interval": 10, "seed": seed,
             "device": "cpu"}
    return {"model": {**shape, **model}, "data": data, "train": train}


def run(ctx: Context) -> dict[str, Any]:
    """Train each T (and Llama) for every seed; RMSE per context length on the test split."""
    from energyformer.data.gp import load_gp_split
    from energyformer.data.meta import load_meta
    from energyformer.runs.rundir import load_run
    from energyformer.tasks.gp import evaluate_regressor

    data = data_section(ctx)
    data_dir = f"{data['root']}/{data['dataset']}"
    settings = load_meta(data_dir)["settings"]
    test = load_gp_split(data_dir, "test")
    models = {f"cem T={t}": {"backbone": "cem", "n_steps": t} for t in STEPS}
    models["llama"] = {"backbone": "llama"}
    results: dict[str, Any] = {}
    names, floor = [], None
    for label, model in models.items():
        per_seed = []
        for seed in ctx.seed_list():
            name = f"{label.replace(' ', '_').replace('=', '')}_s{seed}"
            summary = train_or_resume(ctx, name, config(ctx, model, seed, data))
            net, _, _ = load_run(ctx.runs / name, language_model=False)
            ev = evaluate_regressor(net, test, settings)
            floor = ev
            per_seed.append({**ev, "params": summary["params"]})
            names.append(name)
        results[label] = per_seed
    n = len(floor["context"])
    picks = sorted({0, 1, min(4, n - 1), n // 2, n - 1})
    head = ["model", "params", "RMSE (all positions)"] + [f"RMSE @ {c} pairs" for c in picks]
    rows = []
    for label, per_seed in results.items():
        rows.append([label, f"{per_seed[0]['params']:,}", pm([r["rmse_model"] for r in per_seed])]
                    + [pm([r["model"][c] for r in per_seed]) for c in picks])
    rows.append(["GP posterior mean (floor)", "–", f"{floor['rmse_gp_floor']:.4f}"]
                + [f"{floor['gp_floor'][c]:.4f}" for c in picks])
    rows.append(["prior mean (0)", "–", f"{floor['rmse_prior']:.4f}"] + [f"{floor['prior'][c]:.4f}" for c in picks])
    table = markdown_table(head, rows)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ctxs = np.arange(n)
    for label, per_seed in results.items():
        m = np.array([mean_std([r["model"][c] for r in per_seed])[0] for c in range(n)])
        ax.plot(ctxs, m, label=label)
    ax.plot(ctxs, floor["gp_floor"], "k--", label="GP posterior mean (floor)")
    ax.plot(ctxs, floor["prior"], "k:", label="prior mean")
    finish_axes(ax, "context length (pairs before the query)", "RMSE")
    save_figure(ctx, fig, "rmse_vs_context.png")
    header = (f"In-context GP regression (x_dim {settings['x_dim']}, length scale {settings['length_scale']}, "
              f"noise {settings['noise']}), {ctx.seeds} seed(s), RMSE on {floor['n']} test sequences.")
    return write_results(ctx, table, {"settings": settings, "rows": results}, names, header)
