"""(d) ``shakespeare_scaling``: overfitting of NRGPT vs GPT vs GPT_Rec_parallel at 3 widths on a
small Shakespeare-char slice: best and final validation loss and the train–validation gap
(docs/nrgpt.md §8: the paper reports that NRGPT overfits less at large sizes, with a best
validation loss comparable to GPT's).

Data: a 0.5 MB slice of Shakespeare-char (``prepare_dataset(slice_bytes=500_000)``, prepared on
first use into ``DATA_ROOT/shakespeare_500k``; ≈ 450k training characters). Runs: the recipes
``configs/shakespeare_char/{nrgpt, gpt, gpt_rec_parallel}.yaml`` at d_model ∈ {64, 128, 256}
(4 heads), dropout 0.1, 5,500 steps × 32 × 128 ≈ 50 epochs, constant LR with a 10% cooldown,
50 evaluations. The LR of each family is chosen at d_model 128 by a sweep over
{3e-4, 1e-3, 3e-3} at 1,375 steps (seed 1). One seed per width (``--seeds K`` for more).

Budget (idle 2-core CPU): 9 runs of 5,500 steps and 9 sweep runs of 1,375 steps ≈ 4–5 hours.
``--quick``: the docstring corpus, d_model 16, 20 steps.
"""
from __future__ import annotations

from typing import Any

from energyformer.experiments import common as ex

WIDTHS = (64, 128, 256)
MODELS: dict[str, str] = {
    "NRGPT FF2W": "shakespeare_char/nrgpt.yaml",
    "GPT": "shakespeare_char/gpt.yaml",
    "GPT_Rec_parallel": "shakespeare_char/gpt_rec_parallel.yaml",
}
SLICE_BYTES = 500_000
STEPS, SWEEP_STEPS, LRS, SWEEP_WIDTH = 5500, 1375, (3e-4, 1e-3, 3e-3), 128
DEFAULT_SEEDS = 1


def data_section(ctx: ex.Context) -> dict[str, Any]:
    """The slice (prepared on first use), or the quick corpus."""
    quick = ex.char_data(ctx)
    if quick is not None:
        return quick
    from energyformer.data.prepare import prepare_dataset

    root = ctx.data_root / "shakespeare_500k"
    out = prepare_dataset("shakespeare_char", out_root=root, slice_bytes=SLICE_BYTES, verbose=False)
    return {"dataset": out.name, "root": str(root)}


def config(ctx: ex.Context, recipe: str, width: int, lr: float, steps: int, seed: int,
           data: dict[str, Any]) -> dict[str, Any]:
    model = {"d_model": width, "n_heads": 4, "dropout": 0.1}
    train = {**ex.schedule(ctx, steps, lr), "seed": seed}
    return ex.resolve(ctx, recipe, {"model": model}, {"train": train}, data=data, swept=("d_model",))


def run(ctx: ex.Context) -> dict[str, Any]:
    """Sweep the LR per family at d 128, then every model × width; tabulate losses and the gap."""
    data = data_section(ctx)
    widths = (8, 16, 24) if ctx.quick else WIDTHS
    sweep_width = 16 if ctx.quick else SWEEP_WIDTH
    sweeps = {label: ex.lr_sweep(ctx, label.replace(" ", "_"),
                                 lambda lr, steps, r=recipe: config(ctx, r, sweep_width, lr, steps, 1, data), LRS,
                                 SWEEP_STEPS) for label, recipe in MODELS.items()}
    ex.need_runs(ctx)
    name = lambda label, width, seed: f"{label.replace(' ', '_')}_d{width}_s{seed}"  # noqa: E731
    trained = {(label, width, seed): ex.train_or_resume(ctx, name(label, width, seed),
                                                        config(ctx, recipe, width, sweeps[label]["best_lr"], STEPS,
                                                               seed, data))
               for label, recipe in MODELS.items() for width in widths for seed in ctx.seed_list(DEFAULT_SEEDS)}
    ex.need_runs(ctx)
    results, rows, groups = {}, [], {}
    for label in MODELS:
        for width in widths:
            got = []
            for seed in ctx.seed_list(DEFAULT_SEEDS):
                s, where = trained[(label, width, seed)], ex.record_dir(ctx, name(label, width, seed))
                groups.setdefault(f"{label} d{width}", []).append(where)
                got.append({"width": width, "seed": seed, "params": s["params"], "best_val_loss": s["best_val_loss"],
                            "val_loss": s["final_eval"]["value"], "final_val_loss": s["final_val_loss"],
                            "gap": s["final_val_loss"] - s["final_train_loss"], "convergence": ex.convergence(where)})
            results.setdefault(label, []).extend(got)
            rows.append([label, width, f"{got[0]['params']:,}", f"{sweeps[label]['best_lr']:g}",
                         ex.pm([g["best_val_loss"] for g in got]), ex.pm([g["val_loss"] for g in got]),
                         ex.pm([g["gap"] for g in got]), ex.converged_cell([g["convergence"] for g in got])])
    table = ex.markdown_table(["model", "d_model", "params", "LR", "best val loss (curve)", "final val loss",
                               "val − train (final, curve)", "converged"], rows)
    floors = ex.count_floors(data, ctx)
    table += "\n\n" + ex.floors_table(floors, "val loss (nats/char)")
    _plots(ctx, results, groups, floors)
    header = (f"Overfitting on a {SLICE_BYTES / 1e6:.1f} MB Shakespeare-char slice (dropout 0.1, ≈ 50 epochs); losses "
              "in nats per character. Final val loss: the fixed evaluation (whole validation split, kept weights); "
              "best val loss and the val − train gap: the training curve's estimate (the same 10 batches of each "
              "split at every evaluation). Validation is the slice's last 10%, other plays than training: a gap "
              "present from the first epoch is the split, its growth over training is overfitting.")
    sweep_list = list(sweeps.values())
    return ex.write_results(ctx, table, {"rows": results, "lr_sweeps": sweep_list, "floors": floors}, header,
                            "LR sweeps (d_model 128, seed 1, final val loss):\n\n" + ex.sweep_table(sweep_list))


def _plots(ctx: ex.Context, results: dict[str, Any], groups, floors) -> None:
    plt = ex.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, rs in results.items():
        ps = sorted({r["params"] for r in rs})
        for ax, key in zip(axes, ("best_val_loss", "gap")):
            vals = [[r[key] for r in rs if r["params"] == p] for p in ps]
            ax.plot(ps, [sum(v) / len(v) for v in vals], "o-", label=label)
    for ax, title in zip(axes, ("best val loss (nats/char)", "final val − train loss")):
        ax.set_title(title, fontsize=10)
        ex.finish_axes(ax, "parameters", logx=True)
    ex.save_figure(ctx, fig, "scaling.png")
    ex.plot_learning_curves(ctx, groups, "curves.png", floors=floors, ylabel="val loss (nats/char)")
