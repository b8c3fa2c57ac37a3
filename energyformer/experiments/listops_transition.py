"""(c) ``listops_transition``: ListOps accuracy vs parameters for NRGPT FF1, NRGPT FF2W and
GPT_Rec_parallel over widths 8 … 64 (docs/nrgpt.md §8). The paper reports the ≥ 80 % transition
at 2.3–3.0 × 10⁴ parameters for all three (GPT_Rec_parallel 2.3e4, FF1 2.4e4, FF2W 2.98e4).

Data: ``energyformer prepare listops`` (the released code's settings). Models as the reference's
ListOps runs: one head, 5 recurrent steps, strict mask (NRGPT ``preset: reference_listops``),
block 128, batch 64, AdamW (wd 0.01, β₂ 0.999), LR 5e-4 decaying exponentially to 2e-5 —
but 400 steps instead of the reference's 100k iterations. Accuracy: greedy final answer on 300
held-out test problems (± standard error), per seed.

Budget: 3 models × 6 widths × seeds runs of 400 steps: estimated 35–45 minutes on 2 CPU cores
for one seed (``--seeds 1``; 3 seeds triple it). Short training is expected to move the
transition to larger widths than the paper's. ``--quick``: 600 expressions, widths 8 and 16,
20 steps, 20 test problems, ≈ 15 s.
"""
from __future__ import annotations

from typing import Any



from energyformer.experiments.common import Context, finish_axes, save_figure, markdown_table, mean_std, pm, pyplot, train_or_resume, write_results

WIDTHS = (8, 12, 16, 24, 32, 64)
MODELS: dict[str, dict[str, Any]] = {
    "NRGPT FF1": {"arch": "nrgpt", "preset": "reference_listops", "ff": "ff1"},
    "NRGPT FF2W": {"arch": "nrgpt", "preset": "reference_listops", "ff": "ff2w"},
    "GPT_Rec_parallel": {"arch": "gpt_rec", "parallel": True},
}


def data_section(ctx: Context) -> dict[str, Any]:
    if not ctx.quick:
        return {"dataset": "listops", "root": str(ctx.data_root)}
    from energyformer.data.task_data import prepare_task_data

    out = prepare_task_data("listops", out_dir=ctx.runs / "data" / "listops", verbose=False, n_train=500,
                            n_val=50, n_test=50)
    return {"dataset": out.name, "root": str(out.parent)}


def config(ctx: Context, model: dict[str, Any], width: int, seed: int, data: dict[str, Any]) -> dict[str, Any]:
    q = ctx.quick
    shape = {"d_model": width, "n_heads": 1, "n_steps": 5, "block_size": 64 if q else 128}
    train = {"max_steps": 20 if q else 400, "batch_size": 8 if q else 64, "learning_rate": 5e-4, "min_lr": 2e-5,
             "lr_schedule": "exponential", "warmup_steps": 0, "weight_decay": 0.01, "beta2": 0.999,
             "eval_interval": 10 if q else 200, "eval_iters": 2 if q else 10, "log_interval": 10, "seed": seed,
             "device": "cpu"}
    return {"model": {**model, **shape}, "data": data, "train": train}


def transition(points: list[tuple[int, float]], level: float = 0.8) -> int | None:
    """The smallest parameter count whose accuracy is ≥ ``level`` (None if none reaches it)."""
    hits = [p for p, acc in sorted(points) if acc >= level]
    return hits[0] if hits else None


def run(ctx: Context) -> dict[str, Any]:
    """Train every model × width × seed and score held-out accuracy."""
    from energyformer.data import load_tokenizer
    from energyformer.data.listops import read_test
    from energyformer.runs.rundir import load_run
    from energyformer.tasks.listops import evaluate_listops

    data = data_section(ctx)
    data_dir = f"{data['root']}/{data['dataset']}"
    problems = read_test(data_dir)[: 20 if ctx.quick else 300]
    widths = (8, 16) if ctx.quick else WIDTHS
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODELS}
    names, rows = [], []
    for label, model in MODELS.items():
        for width in widths:
            accs, params = [], None
            for seed in ctx.seed_list():
                name = f"{label.replace(' ', '_')}_d{width}_s{seed}"
                summary = train_or_resume(ctx, name, config(ctx, model, width, seed, data))
                net, _, meta = load_run(ctx.runs / name)
                ev = evaluate_listops(net, load_tokenizer(meta), problems)
                params = summary["params"]
                accs.append(ev["accuracy"])
                results[label].append({"width": width, "seed": seed, "params": params, "accuracy": ev["accuracy"],
                                       "stderr": ev["stderr"], "per_function": ev["per_function"],
                                       "best_val_loss": summary["best_val_loss"]})
                names.append(name)
            se = results[label][-1]["stderr"] if len(accs) == 1 else mean_std(accs)[1]
            rows.append([label, width, f"{params:,}", f"{mean_std(accs)[0]:.3f} ± {se:.3f}",
                         pm([r["best_val_loss"] for r in results[label] if r["width"] == width])])
    table = markdown_table(["model", "d_model", "params", "accuracy", "best val loss"], rows)
    trans = {}
    for label, rs in results.items():
        by_p: dict[int, list[float]] = {}
        for r in rs:
            by_p.setdefault(r["params"], []).append(r["accuracy"])
        trans[label] = transition([(p, mean_std(a)[0]) for p, a in by_p.items()])
    table += "\n\n" + markdown_table(["model", "≥80% transition (params)", "paper"],
                                     [[m, "not reached" if t is None else f"{t:,}", p] for (m, t), p in
                                      zip(trans.items(), ("2.4e4", "2.98e4", "2.3e4"))])

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rs in results.items():
        ps = sorted({r["params"] for r in rs})
        acc = [mean_std([r["accuracy"] for r in rs if r["params"] == p])[0] for p in ps]
        ax.plot(ps, acc, "o-", label=label)
    ax.axhline(0.8, color="gray", linestyle=":")
    ax.axvspan(2.3e4, 3.0e4, color="gray", alpha=0.15, label="paper's transition")
    ax.set_ylim(-0.02, 1.02)
    finish_axes(ax, "parameters", "held-out accuracy", logx=True)
    save_figure(ctx, fig, "accuracy_vs_params.png")
    spread = "± standard error (1 seed)" if ctx.seeds == 1 else f"± std over {ctx.seeds} seeds"
    header = f"ListOps held-out accuracy (greedy final answer, {len(problems)} test problems, {spread})."
    return write_results(ctx, table, {"rows": results, "transition": trans}, names, header)


__all__ = ["run", "transition"]
