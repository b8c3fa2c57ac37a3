"""(d) ``shakespeare_scaling``: overfitting of NRGPT vs GPT vs GPT_Rec_parallel at 3 widths on a
small Shakespeare-char slice (docs/nrgpt.md §8: the paper reports that NRGPT overfits less at large
sizes, with a best validation loss comparable to GPT's), measured as the paper means it: the
*growth* of the val − train gap over epochs on a split where train and val come from the same
distribution, beside the cross-play gap.

Data: a 0.25 MB slice of Shakespeare-char (``prepare_dataset(slice_bytes=250_000)``, prepared on
first use into ``DATA_ROOT/shakespeare_250k/shakespeare_char``; validation = its last 10%, other plays). Its
training part is split again by speech (:mod:`energyformer.data.speeches`): every 10th speech is
held out (``DATA_ROOT/shakespeare_250k/shakespeare_char_speeches``: ≈ 198k training and 27k validation characters
from the same plays). The models train on that speech split. Reported per run: the fixed
evaluation on the same-play held-out speeches and on the other plays (whole splits, kept weights),
and from the training curve (the same 10 batches of each split at every evaluation) the same-play
val − train gap after the first epoch, at the end, and its growth. Each model is compared with GPT,
paired by seed, at the same width and at equal parameters (:func:`matched_difference`: at the same
d_model NRGPT and GPT_Rec_parallel have 28–35% of GPT's parameters, so a smaller gap growth at
equal width alone does not separate the architecture from the size).

Runs: the recipes ``configs/shakespeare_char/{nrgpt, gpt, gpt_rec_parallel}.yaml`` at d_model ∈
{32, 64, 128} (4 heads), dropout 0.1, 2,750 steps × 32 × 128 ≈ 57 epochs, constant LR with a 10%
cooldown, 50 evaluations. The LR of each family is chosen at the middle width (d_model 64) by a
sweep over {3e-4, 1e-3, 3e-3} at 690 steps (seed 1, extended past an edge); every other width checks
its own LR (the family's best and the half-decades either side, same budget, extended past an edge)
and trains at its own best: the d 64 LR does not carry to d 128 (GPT_Rec_parallel at 3e-2 stayed
at ≈ 2.45 nats for all 2,750 steps). Two seeds per width (paired: the same batches). The headline
pair (:data:`DOUBLE`: NRGPT FF2W against GPT at the widest width) trains once more at twice the steps
(seed 1, ≈ 114 epochs), after seed 1 and before seed 2, and a last table shows whether the sign and
size of their difference in gap growth and val loss survive the longer run.

Budget: the training FLOPs per token (``models/flops.py``) of the three models sum to ≈ 1.8, 5.8
and 20 MFLOP at d_model 32, 64 and 128 (at 256 they would be 75: d 256 alone would cost three times
the rest), so the 18 runs of 11.3 M tokens and the 9 sweep runs cost ≈ 6 single-thread CPU-hours
at the ≈ 3.5 × 10¹⁰ FLOP/s one core sustains on these models (``--jobs 2`` halves the wall time);
the 2× pair ≈ 1.8 more.
Overfitting is a matter of parameters per training character, so halving the slice (0.5 → 0.25 MB)
and the widths (64–256 → 32–128) keeps the design's range of that ratio at a fifth of its cost.
``--quick``: the docstring corpus, d_model 16, 20 steps.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from energyformer.experiments import common as ex
from energyformer.experiments import convergence as conv
from energyformer.experiments import report
from energyformer.experiments.sweeps import half_decade, lr_sweep, sweep_table

WIDTHS = (32, 64, 128)
MODELS: dict[str, str] = {
    "NRGPT FF2W": "shakespeare_char/nrgpt.yaml",
    "GPT": "shakespeare_char/gpt.yaml",
    "GPT_Rec_parallel": "shakespeare_char/gpt_rec_parallel.yaml",
}
SLICE_BYTES = 250_000
STEPS, SWEEP_STEPS, LRS, SWEEP_WIDTH = 2750, 690, (3e-4, 1e-3, 3e-3), 64
DEFAULT_SEEDS = 2
#: the headline pair (does NRGPT overfit less than GPT?), trained once more at the widest width for
#: twice the steps (seed 1) to show whether the sign and size of the difference survive a longer run
DOUBLE = ("GPT", "NRGPT FF2W")
#: every HOLD_OUT-th speech of the slice's training part is the same-play validation split
HOLD_OUT = 10


def data_sections(ctx: ex.Context) -> tuple[dict[str, Any], str]:
    """``(data section of the speech split the runs train on, the cross-play dataset's directory)``:
    the slice (prepared on first use) or the quick corpus, and its speech split."""
    from energyformer.data.speeches import prepare_speech_split

    quick = ex.char_data(ctx)
    if quick is not None:
        source = f"{quick['root']}/{quick['dataset']}"
    else:
        from energyformer.data.prepare import prepare_dataset

        root = ctx.data_root / f"shakespeare_{SLICE_BYTES // 1000}k"
        source = str(prepare_dataset("shakespeare_char", out_root=root, slice_bytes=SLICE_BYTES, verbose=False))
    out = prepare_speech_split(source, f"{source}_speeches", every=HOLD_OUT)
    return {"dataset": out.name, "root": str(out.parent)}, source


def run_name(label: str, width: int, seed: int, tag: str = "") -> str:
    """``<model>_d<width>[_<tag>]_s<seed>``, e.g. ``NRGPT_FF2W_d128_s1``, ``GPT_d128_2x_s1``."""
    return f"{label.replace(' ', '_')}_d{width}{f'_{tag}' if tag else ''}_s{seed}"


def gap_growth(run_dir, epoch_steps: float) -> dict[str, Any]:
    """From the training curve: the val − train gap (``val_loss − train_loss_eval``) at the first
    evaluation after one epoch, at the last evaluation, and its growth (last − first)."""
    from energyformer.runs.rundir import read_metrics

    evals = [r for r in read_metrics(run_dir) if r.get("val_loss") is not None and r.get("train_loss_eval") is not None]
    if not evals:
        return {"epoch1": None, "final": None, "growth": None}
    first = next((r for r in evals if r["step"] >= epoch_steps), evals[0])
    g1, g2 = first["val_loss"] - first["train_loss_eval"], evals[-1]["val_loss"] - evals[-1]["train_loss_eval"]
    return {"epoch1_step": first["step"], "epoch1": g1, "final": g2, "growth": g2 - g1}


#: what the differences table compares, read from one row of the results
GAP_METRICS: dict[str, Callable[[dict[str, Any]], float | None]] = {
    "gap_growth": lambda r: r["gap"]["growth"],
    "val_same": lambda r: r["val_same"],
}


def matched_difference(results: dict[str, list[dict[str, Any]]], label: str, width: int,
                       metric: Callable[[dict[str, Any]], float | None], ref: str = "GPT"
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``label`` at ``width`` minus ``ref``, paired by seed: at the same width, and at equal parameters
    (:func:`energyformer.experiments.stats.matched_difference`: ``ref``'s curve over its widths, same seed,
    linear in log parameters, read at ``label``'s parameter count; no reading outside ``ref``'s widths).

    Args:
        results: label → rows with ``"width"``, ``"seed"``, ``"params"`` and what ``metric`` reads.
        metric: the value compared, e.g. the growth of the same-play gap; ``None`` drops that row.

    Returns:
        ``(equal_width, equal_parameters)``, each ``{"mean", "lo", "hi", "sd", "n", "seeds"}``.
    """
    from energyformer.experiments import stats

    mine = {r["seed"]: (r["params"], metric(r)) for r in results.get(label, [])
            if r["width"] == width and metric(r) is not None}
    curves: dict[int, list[tuple[float, float]]] = {}
    same = {}
    for r in results.get(ref, []):
        if metric(r) is not None:
            curves.setdefault(r["seed"], []).append((r["params"], metric(r)))
            if r["width"] == width:
                same[r["seed"]] = metric(r)
    return (stats.paired_difference(same, {s: v for s, (_, v) in mine.items()}),
            stats.matched_difference(curves, mine))


def config(ctx: ex.Context, recipe: str, width: int, lr: float, steps: int, seed: int,
           data: dict[str, Any]) -> dict[str, Any]:
    model = {"d_model": width, "n_heads": 4, "dropout": 0.1}
    train = {**ex.schedule(ctx, steps, lr), "seed": seed}
    return ex.resolve(ctx, recipe, {"model": model}, {"train": train}, data=data, swept=("d_model",))


def run(ctx: ex.Context) -> dict[str, Any]:
    """Sweep the LR per family at the middle width, then every model × width × seed; tabulate the fixed
    evaluation on both validation splits and the growth of the same-play gap."""
    from energyformer.data import load_tokenizer
    from energyformer.data.meta import load_meta
    from energyformer.eval.suite import val_loss
    from energyformer.experiments.stats import format_difference
    from energyformer.runs.rundir import load_run

    data, cross_dir = data_sections(ctx)
    widths = (8, 16, 24) if ctx.quick else WIDTHS
    sweep_width = 16 if ctx.quick else SWEEP_WIDTH
    sweeps = {label: lr_sweep(ctx, label.replace(" ", "_"),
                                 lambda lr, steps, r=recipe: config(ctx, r, sweep_width, lr, steps, 1, data), LRS,
                                 SWEEP_STEPS) for label, recipe in MODELS.items()}
    ex.need_runs(ctx)
    checks = {(label, width): lr_sweep(ctx, f"{label.replace(' ', '_')}_d{width}",
                                       lambda lr, steps, r=recipe, w=width: config(ctx, r, w, lr, steps, 1, data),
                                       (half_decade(best, up=False), best, half_decade(best, up=True)), SWEEP_STEPS)
              for label, recipe in MODELS.items() for best in [sweeps[label]["best_lr"]]
              for width in widths if width != sweep_width}
    ex.need_runs(ctx)
    lrs = {(label, width): (checks.get((label, width)) or sweeps[label])["best_lr"]
           for label in MODELS for width in widths}
    # seed-major, widest first: a queue cut short keeps whole seeds (every model and width, paired), and
    # with --jobs N the long runs start first
    cfgs = {(label, width, seed): config(ctx, recipe, width, lrs[(label, width)], STEPS, seed, data)
            for seed in ctx.seed_list(DEFAULT_SEEDS) for width in sorted(widths, reverse=True)
            for label, recipe in MODELS.items()}
    # the headline pair at twice the steps trains after seed 1 and before the further seeds (a budget cut
    # drops those first)
    widest = max(widths)
    doubled_cfgs = {label: config(ctx, MODELS[label], widest, lrs[(label, widest)], 2 * STEPS, 1, data)
                    for label in DOUBLE}

    def train_doubled() -> dict[str, Any]:
        return {label: ex.train_or_resume(ctx, run_name(label, widest, 1, "2x"), c)
                for label, c in doubled_cfgs.items()}

    trained: dict[tuple[str, int, int], Any] = {}
    doubled: dict[str, Any] | None = None
    for key, cfg in cfgs.items():
        if key[2] != 1 and doubled is None:
            doubled = train_doubled()
        trained[key] = ex.train_or_resume(ctx, run_name(*key), cfg)
    if doubled is None:
        doubled = train_doubled()
    ex.need_runs(ctx)
    n_train = load_meta(f"{data['root']}/{data['dataset']}")["n_train"]
    results, rows, groups = {}, [], {}

    def measure(run: str, s: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
        where = ex.record_dir(ctx, run)
        epoch_steps = n_train / (cfg["train"]["batch_size"] * cfg["model"]["block_size"])
        model, _, meta = load_run(where)
        cross = val_loss(model, cross_dir, load_tokenizer(meta), batch_size=32)["loss"]
        return {"params": s["params"], "steps": s["steps"], "best_val_loss": s["best_val_loss"],
                "val_same": s["final_eval"]["value"], "val_cross": cross, "train_loss": s["final_train_loss"],
                "gap": gap_growth(where, epoch_steps),
                "epochs": cfg["train"]["max_steps"] / epoch_steps, "convergence": conv.convergence(where)}

    for (label, width, seed), s in sorted(trained.items(), key=lambda kv: (list(MODELS).index(kv[0][0]), kv[0][1:])):
        groups.setdefault(f"{label} d{width}", []).append(ex.record_dir(ctx, run_name(label, width, seed)))
        results.setdefault(label, []).append(
            {"width": width, "seed": seed, **measure(run_name(label, width, seed), s, cfgs[(label, width, seed)])})
    for label, rs in results.items():
        for width in widths:
            got = [r for r in rs if r["width"] == width]
            rows.append([label, width, f"{got[0]['params']:,}", f"{lrs[(label, width)]:g}",
                         report.pm([g["val_same"] for g in got]), report.pm([g["val_cross"] for g in got]),
                         report.pm([g["gap"]["epoch1"] for g in got]), report.pm([g["gap"]["final"] for g in got]),
                         report.pm([g["gap"]["growth"] for g in got]),
                         conv.converged_cell([g["convergence"] for g in got])])
    table = report.markdown_table(["model", "d_model", "params", "LR", "val loss, same plays", "val loss, other plays",
                               "gap after epoch 1", "gap at the end", "gap growth", "converged"], rows)
    diffs, differences = [], []
    for label in ("NRGPT FF2W", "GPT_Rec_parallel"):
        for width in widths:
            got = {what: matched_difference(results, label, width, key) for what, key in GAP_METRICS.items()}
            differences.append({"comparison": f"{label} − GPT", "width": width, **got})
            diffs.append([f"{label} − GPT", width] + [format_difference(d) for pair in got.values() for d in pair])
    table += ("\n\n" + "Differences from GPT (paired by seed, 95% interval; negative: less overfitting, or lower "
              "loss). Equal width: GPT at the same d_model. Equal parameters: GPT's curve over its widths, same seed, "
              "read (linear in log parameters) at the model's parameter count; – outside GPT's widths:\n\n"
              + report.markdown_table(["comparison", "d_model", "gap growth, equal width",
                                       "gap growth, equal parameters", "val loss (same plays), equal width",
                                       "val loss (same plays), equal parameters"], diffs))
    longer = {label: measure(run_name(label, widest, 1, "2x"), doubled[label], c) for label, c in doubled_cfgs.items()}
    check, check_rows = _budget_check(results, longer, widest)
    table += "\n\n" + check
    floors = report.count_floors(data, ctx)
    table += "\n\n" + report.floors_table(floors, "val loss, same plays (nats/char)")
    _plots(ctx, results, groups, floors)
    header = (f"Overfitting on a {SLICE_BYTES / 1e6:.2g} MB Shakespeare-char slice (dropout 0.1, ≈ "
              f"{next(iter(results.values()))[0]['epochs']:.0f} epochs of the speech split); losses in nats per "
              "character. Val loss: the fixed evaluation (whole split, kept weights) on the held-out speeches of the "
              "same plays and on the slice's last 10% (other plays). Gap: same-play val − train loss from the training "
              "curve (the same 10 batches of each split at every evaluation); its growth after the first epoch is "
              "overfitting, a cross-play gap present from the start is the split. " + conv.CONVERGED_NOTE)
    sweep_list = list(sweeps.values()) + list(checks.values())
    return report.write_results(ctx, table, {"rows": results, "differences": differences,
                                             "budget_check": check_rows,
                                             "budget_check_runs": longer, "lr_sweeps": sweep_list,
                                             "floors": floors}, header,
                            f"LR sweeps (d_model {sweep_width}) and each other width's own check (seed 1, the sweep's "
                            "steps, final val loss on the same-play split):\n\n"
                            + sweep_table(sweep_list))


def _budget_check(results: dict[str, list[dict[str, Any]]], longer: dict[str, dict[str, Any]], width: int
                  ) -> tuple[str, list[dict[str, Any]]]:
    """:data:`DOUBLE`'s pair at ``width``, seed 1, at the main budget and at twice the steps: the growth of
    the same-play gap and the same-play val loss of each (:func:`energyformer.experiments.report.budget_check`)."""
    a, b = DOUBLE
    base = {label: next(r for r in results[label] if r["width"] == width and r["seed"] == 1) for label in DOUBLE}
    comparisons = []
    for what, get in (("gap growth", lambda r: r["gap"]["growth"]), ("val loss, same plays", lambda r: r["val_same"])):
        for pts in (base, longer):
            comparisons.append((f"{b} − {a}, d {width}: {what}", pts[a]["steps"],
                                (get(pts[a]), pts[a]["convergence"]), (get(pts[b]), pts[b]["convergence"])))
    return report.budget_check(comparisons, "nats")


def _plots(ctx: ex.Context, results: dict[str, Any], groups, floors) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, rs in results.items():
        ps = sorted({r["params"] for r in rs})
        for ax, key in zip(axes, ("val_same", "gap_growth")):
            vals = [[r["gap"]["growth"] if key == "gap_growth" else r[key] for r in rs if r["params"] == p] for p in ps]
            ax.plot(ps, [sum(v) / len(v) for v in vals], "o-", label=label)
    for ax, title in zip(axes, ("val loss, same plays (nats/char)", "growth of the same-play val − train gap")):
        ax.set_title(title, fontsize=10)
        report.finish_axes(ax, "parameters", logx=True)
    report.save_figure(ctx, fig, "scaling.png")
    report.plot_learning_curves(ctx, groups, "curves.png", floors=floors, ylabel="val loss (nats/char)")
