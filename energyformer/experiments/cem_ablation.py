"""(a) ``cem_ablation``: Llama against the CEM options on Shakespeare-char (docs/cem.md), trained
toward a plateau at about 20 tokens per parameter (the table says which runs reached it).

Runs: the recipes ``configs/shakespeare_char/{llama, cem, cem_t2, cem_diag_shared, cem_full}.yaml``
(d_model 128, 4 layers, 4 heads, d_ff 352, block 128, batch 32; vocabulary 74, so the body holds
nearly all parameters); 4,000 steps (16.4 M tokens), constant LR with a 10% linear cooldown
(``lr_schedule: wsd``), 50 evaluations. The LR of each family (Llama; CEM, swept on tied T=1 and
used for every CEM row) is chosen by a sweep over {3e-4, 1e-3, 3e-3} at 1,000 steps (seed 1).
Seeds: 3 for Llama, tied T=1 and T=2; 2 for diag_shared and full (``--seeds K``: K for all).
Floors: the unigram and bigram count models of the same corpus (nats per character).

Budget (2-core CPU, 2 threads, measured): 13 runs of 4,000 steps (a Llama run ≈ 21 minutes at
≈ 15k tokens/s, a tied T=1 run ≈ 21–24, T=2 ≈ 39, diag_shared ≈ 27–28, full ≈ 52) and 6–10 sweep
runs of 1,000 steps (≈ 7–11 minutes each; a sweep whose best LR is at its edge is extended)
≈ 8.5–9 hours.
``--quick``: the docstring corpus, d_model 16, 20 steps.
"""
from __future__ import annotations

from typing import Any

from energyformer.experiments import common as ex

#: label -> (recipe under configs/, LR family, default seeds)
VARIANTS: dict[str, tuple[str, str, int]] = {
    "llama": ("shakespeare_char/llama.yaml", "llama", 3),
    "cem tied T=1": ("shakespeare_char/cem.yaml", "cem", 3),
    "cem T=2": ("shakespeare_char/cem_t2.yaml", "cem", 3),
    "cem diag_shared": ("shakespeare_char/cem_diag_shared.yaml", "cem", 2),
    "cem full (T=2+D+LR+P)": ("shakespeare_char/cem_full.yaml", "cem", 2),
}
SWEEP_RECIPE = {"llama": "shakespeare_char/llama.yaml", "cem": "shakespeare_char/cem.yaml"}
STEPS, SWEEP_STEPS, LRS = 4000, 1000, (3e-4, 1e-3, 3e-3)
#: runs whose weights other experiments load (inference_steps)
KEEP_WEIGHTS = ("cem T=2",)


def slug(label: str) -> str:
    """A run-directory name for a row label."""
    return "".join(c if c.isalnum() else "_" for c in label).strip("_").replace("__", "_")


def config(ctx: ex.Context, recipe: str, lr: float, steps: int, seed: int) -> dict[str, Any]:
    """The run config: the recipe with this experiment's schedule and seed."""
    return ex.resolve(ctx, recipe, {"train": {**ex.schedule(ctx, steps, lr), "seed": seed}}, data=ex.char_data(ctx))


def trained_run(ctx: ex.Context, label: str, seed: int):
    """The run directory of row ``label``'s ``seed`` (LR from its family's sweep), trained if not recorded."""
    recipe, family, _ = VARIANTS[label]
    sweep = ex.lr_sweep(ctx, family, lambda lr, steps: config(ctx, SWEEP_RECIPE[family], lr, steps, 1), LRS,
                     SWEEP_STEPS)
    name = f"{slug(label)}_s{seed}"
    ex.train_or_resume(ctx, name, config(ctx, recipe, sweep["best_lr"], STEPS, seed),
                       keep_weights=label in KEEP_WEIGHTS)
    return ex.record_dir(ctx, name)


def run(ctx: ex.Context) -> dict[str, Any]:
    """Sweep the LR per family, train every variant's seeds, tabulate loss, floors and convergence."""
    sweeps = {fam: ex.lr_sweep(ctx, fam, lambda lr, steps, r=recipe: config(ctx, r, lr, steps, 1), LRS, SWEEP_STEPS)
              for fam, recipe in SWEEP_RECIPE.items()}
    rows, results, groups = [], {}, {}
    for label, (recipe, family, n_seeds) in VARIANTS.items():
        lr = sweeps[family]["best_lr"]
        summaries, convs = [], []
        for seed in ctx.seed_list(n_seeds):
            name = f"{slug(label)}_s{seed}"
            summaries.append(ex.train_or_resume(ctx, name, config(ctx, recipe, lr, STEPS, seed),
                                             keep_weights=label in KEEP_WEIGHTS))
            where = ex.record_dir(ctx, name)
            convs.append(ex.convergence(where))
            groups.setdefault(label, []).append(where)
        finals = [s["final_val_loss"] for s in summaries if not s.get("diverged")]
        results[label] = {"recipe": recipe, "lr": lr, "final_val_loss": finals, "params": summaries[0].get("params"),
                          "convergence": convs}
        rows.append([label, f"{lr:g}", ex.pm(finals), f"{summaries[0].get('params', 0):,}", len(finals),
                     ex.converged_cell(convs)])
    floors = ex.count_floors(ex.char_data(ctx), ctx)
    table = ex.markdown_table(["model", "LR", "val loss (nats/char)", "params", "seeds", "converged"], rows)
    table += "\n\n" + ex.floors_table(floors, "val loss (nats/char)")
    ex.plot_learning_curves(ctx, groups, "loss_curves.png", floors=floors, ylabel="val loss (nats/char)")
    header = ("CEM ablations on Shakespeare-char (d_model 128, 4 layers, 4,000 steps × 32 × 128 tokens), "
              "final validation loss (after the cooldown), mean ± std over seeds. Converged: the fitted val loss "
              "fell < 1% over the last 30% of the pre-cooldown steps (slope in nats per 1k steps).")
    return ex.write_results(ctx, table, {"rows": results, "floors": floors, "lr_sweeps": list(sweeps.values())},
                         header, "LR sweeps (seed 1, final val loss):\n\n" + ex.sweep_table(list(sweeps.values())))

