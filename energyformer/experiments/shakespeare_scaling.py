"""(d) ``shakespeare_scaling``: NRGPT vs GPT vs GPT_Rec_parallel at 3 sizes on Shakespeare-char:
best validation loss and the train–validation gap (docs/nrgpt.md §8: the paper reports that
NRGPT overfits less at large sizes, with a best validation loss comparable to GPT's).

Data: ``energyformer prepare shakespeare_char``. Models: d_model ∈ {32, 64, 128}, 4 heads
(2 at d 32), NRGPT FF2W and GPT_Rec_parallel with 4 recurrent steps, GPT with 4 layers; block
128, batch 32, 500 steps, dropout 0 (overfitting needs far longer runs: the gap here measures
the early trend only).

Budget: 9 configurations × seeds runs of 500 steps: estimated 35–45 minutes on 2 CPU cores for
one seed (``--seeds 1``). ``--quick``: the docstring corpus, d_model 8/16/24, 20 steps, ≈ 15 s.
"""
from __future__ import annotations

from typing import Any

from energyformer.experiments.common import Context, finish_axes, save_figure, char_data, markdown_table, pm, pyplot, train_or_resume, write_results

SIZES = (32, 64, 128)
MODELS: dict[str, dict[str, Any]] = {
    "NRGPT FF2W": {"arch": "nrgpt", "ff": "ff2w", "n_steps": 4},
    "GPT": {"arch": "gpt", "n_layers": 4},
    "GPT_Rec_parallel": {"arch": "gpt_rec", "parallel": True, "n_steps": 4},
}


def config(ctx: Context, model: dict[str, Any], width: int, seed: int) -> dict[str, Any]:
    q = ctx.quick
    shape = {"d_model": width, "n_heads": 2 if width <= 32 else 4, "block_size": 32 if q else 128}
    train = {"max_steps": 20 if q else 500, "batch_size": 4 if q else 32, "learning_rate": 1e-3, "min_lr": 1e-4,
             "warmup_steps": 5 if q else 50, "eval_interval": 10 if q else 100, "eval_iters": 2 if q else 10,
             "log_interval": 10, "seed": seed, "device": "cpu"}
    return {"model": {**model, **shape}, "data": char_data(ctx), "train": train}


def run(ctx: Context) -> dict[str, Any]:
    """Train every model × size × seed; tabulate best val loss and the final train − val gap."""
    sizes = (8, 16, 24) if ctx.quick else SIZES
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODELS}
    rows, names = [], []
    for label, model in MODELS.items():
        for width in sizes:
            got = []
            for seed in ctx.seed_list():
                name = f"{label.replace(' ', '_')}_d{width}_s{seed}"
                s = train_or_resume(ctx, name, config(ctx, model, width, seed))
                got.append({"width": width, "seed": seed, "params": s["params"], "best_val_loss": s["best_val_loss"],
                            "gap": s["final_val_loss"] - s["final_train_loss"]})
                names.append(name)
            results[label] += got
            rows.append([label, width, f"{got[0]['params']:,}", pm([g["best_val_loss"] for g in got]),
                         pm([g["gap"] for g in got])])
    table = markdown_table(["model", "d_model", "params", "best val loss", "val − train (final)"], rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, rs in results.items():
        ps = sorted({r["params"] for r in rs})
        for ax, key in zip(axes, ("best_val_loss", "gap")):
            ax.plot(ps, [sum(r[key] for r in rs if r["params"] == p) / len([r for r in rs if r["params"] == p])
                         for p in ps], "o-", label=label)
    for ax, title in zip(axes, ("best val loss (nats/char)", "final val − train loss")):
        ax.set_title(title, fontsize=10)
        finish_axes(ax, "parameters", logx=True)
    save_figure(ctx, fig, "scaling.png")
    header = f"Shakespeare-char scaling, {ctx.seeds} seed(s); losses in nats per character."
    return write_results(ctx, table, {"rows": results}, names, header)
