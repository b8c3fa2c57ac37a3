"""(a) ``cem_ablation``: Llama against the CEM options on the BPE English corpus (docs/cem.md).

Rows (and ``loss_curves.png``, the seed-1 curves): Llama; CEM tied T=1 (= the "no diagonal" ablation: plain tied CEM has no diagonal term);
T=2; ``diag_shared``; ``diag_per_head``; ``diag_only``; the preconditioner (``diag_lowrank``);
full (T=2 + D+LR shared + P). Each row: mean ± std over seeds of the best validation loss
(nats per BPE token), parameters, tokens/s.

Data: ``energyformer prepare english`` (byte-level BPE, vocab 8192). Sizes (CPU): d_model 64,
2 layers, 2 heads, d_ff 176, block 128, batch 16, 300 steps, the recipes' optimizer.

Budget: 8 configurations × 3 seeds = 24 runs of 300 steps; estimated 30–45 minutes on 2 CPU
cores (the T=2 and full rows cost about 2–2.5× a T=1 step). ``--quick``: a character corpus
of this package's docstrings, d_model 16, 20 steps, ≈ 10 s.
"""
from __future__ import annotations

from typing import Any

from energyformer.experiments.common import Context, char_data, markdown_table, pm, train_or_resume, write_results

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "cem (tied T=1, no diag)": {"arch": "cem"},
    "cem T=2": {"arch": "cem", "n_steps": 2},
    "cem diag_shared": {"arch": "cem", "interaction": "diag_shared"},
    "cem diag_per_head": {"arch": "cem", "interaction": "diag_per_head"},
    "cem diag_only": {"arch": "cem", "interaction": "diag_only", "rope": None},
    "cem preconditioner": {"arch": "cem", "preconditioner": "diag_lowrank"},
    "cem full (T=2+D+LR+P)": {"arch": "cem", "n_steps": 2, "interaction": "diag_shared",
                              "preconditioner": "diag_lowrank"},
}


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_").replace("__", "_")


def config(ctx: Context, variant: dict[str, Any], seed: int) -> dict[str, Any]:
    """The run config of one variant and seed."""
    q = ctx.quick
    shape = {"d_model": 16 if q else 64, "n_layers": 2, "n_heads": 2, "d_ff": 48 if q else 176,
             "block_size": 32 if q else 128}
    data = char_data(ctx) if q else {"dataset": "english", "root": str(ctx.data_root)}
    train = {"max_steps": 20 if q else 300, "batch_size": 4 if q else 16, "learning_rate": 1e-3,
             "min_lr": 1e-4, "warmup_steps": 5 if q else 30, "eval_interval": 10 if q else 100,
             "eval_iters": 2 if q else 10, "log_interval": 10, "seed": seed, "device": "cpu"}
    return {"model": {**shape, **variant}, "data": data, "train": train}


def run(ctx: Context) -> dict[str, Any]:
    """Train every variant for every seed and tabulate best validation loss, params and tokens/s."""
    rows, results, names = [], {}, []
    for label, variant in VARIANTS.items():
        summaries = []
        for seed in ctx.seed_list():
            name = f"{_slug(label)}_s{seed}"
            summaries.append(train_or_resume(ctx, name, config(ctx, variant, seed)))
            names.append(name)
        losses = [s["best_val_loss"] for s in summaries]
        speeds = [s["tokens_per_s"] for s in summaries]
        results[label] = {"best_val_loss": losses, "params": summaries[0]["params"], "tokens_per_s": speeds,
                          "config": variant}
        rows.append([label, pm(losses), f"{summaries[0]['params']:,}", pm(speeds, 0)])
    table = markdown_table(["model", "best val loss (mean ± std)", "params", "tokens/s"], rows)
    from energyformer.eval.compare import plot_curves

    ctx.out.mkdir(parents=True, exist_ok=True)
    plot_curves([ctx.runs / n for n in names if n.endswith("_s1")], ctx.out / "loss_curves.png")
    header = (f"CEM ablations on {'a tiny char corpus (--quick)' if ctx.quick else 'the BPE English corpus'}, "
              f"{ctx.seeds} seed(s); loss in nats per token.")
    return write_results(ctx, table, {"rows": results}, names, header)
