"""(a) ``cem_ablation``: Llama against the CEM options on Shakespeare-char at equal tokens, equal
parameters and equal training FLOPs (docs/cem.md; docs/experiments.md §6–§7).

Arms (recipes ``configs/shakespeare_char/{llama, cem, cem_t2, cem_diag_shared, cem_full}.yaml``:
4 layers, 4 heads, block 128, batch 32, d_ff = 2.75·d_model, Llama's 8d/3 rule at d 128):

- **Width sweep** of three families, d_model ∈ :data:`WIDTHS`: Llama, tied CEM T=1 and the best
  CEM option of the earlier ablation (the shared diagonal, ``diag_shared``). From these come the
  loss-vs-parameters and loss-vs-training-FLOPs curves (FLOPs: :func:`energyformer.models.flops.
  training_flops_per_token` × tokens), and the CEM − Llama gap read at matched parameters and at
  matched FLOPs (the Llama curve interpolated in log size at each CEM run's size, per seed), and
  the shared diagonal against tied T=1 at every width the same three ways.
- **At d_model 128 only**: CEM T=2 and the full CEM (T=2 + diag_shared + rank-8 preconditioner),
  compared with T=1 and with Llama at equal tokens, equal parameters and equal FLOPs (the
  reference's width curve read at their size).

Every run: 4,000 steps × 32 × 128 characters (16.4 M tokens), the same WSD schedule (warmup 100,
constant LR, a linear cooldown over the last 10% to LR/10), 50 evaluations. Seed s gives every arm
the same batches (paired seeds); the reported loss is the fixed evaluation (the whole validation
split, 478,344 characters, from the kept weights; :mod:`energyformer.experiments.scoring`).

Learning rates: every arm gets its own check at d_model 128, its family's best LR and the
half-decades either side (1,000 steps, seed 1, extended past an edge), and uses its own best at
every width. Checks of the verdict: one seed pair (Llama, T=1) with a 25% cooldown, and one seed of
Llama, T=1 and diag_shared at twice the steps (8,000).

Budget (2-core CPU, measured per run at 2 threads: d 128 Llama ≈ 21 min, T=1 ≈ 23, diag_shared
≈ 27, T=2 ≈ 39, full ≈ 52; d 64 ≈ ⅓ and d 192 ≈ 2× of that): 15 LR-check runs (one more for
each check extended past an edge), 9 runs per width
family (3 seeds × 3 widths) × 3 families, 3 T=2 and 2 full runs, 2 cooldown and 3 double-budget runs
≈ 22 CPU-hours; ``--jobs 2`` nearly halves the wall time. ``--quick``: the docstring corpus, widths
8 and 16, 20 steps.
"""
from __future__ import annotations

from typing import Any

from energyformer.experiments import common as ex
from energyformer.experiments import convergence as conv
from energyformer.experiments import report
from energyformer.experiments.stats import format_difference, matched_difference, paired_difference
from energyformer.experiments.sweeps import half_decade, lr_sweep, sweep_table

#: label -> (recipe under configs/, LR of its family's earlier sweep (the centre of its check), seeds,
#: its LR check's run prefix (the earlier sweeps' names for Llama and T=1, so those are reused))
VARIANTS: dict[str, tuple[str, float, int, str]] = {
    "llama": ("shakespeare_char/llama.yaml", 1e-3, 3, "llama"),
    "cem tied T=1": ("shakespeare_char/cem.yaml", 1e-2, 3, "cem"),
    "cem diag_shared": ("shakespeare_char/cem_diag_shared.yaml", 1e-2, 3, "cem_diag_shared"),
    "cem T=2": ("shakespeare_char/cem_t2.yaml", 1e-2, 3, "cem_t2"),
    "cem full (T=2+D+LR+P)": ("shakespeare_char/cem_full.yaml", 1e-2, 2, "cem_full"),
}
#: the families of the width sweep; the others run at :data:`BASE_WIDTH` only
WIDTH_FAMILIES = ("llama", "cem tied T=1", "cem diag_shared")
WIDTHS, BASE_WIDTH = (64, 128, 192), 128
STEPS, SWEEP_STEPS = 4000, 1000
COOLDOWN, COOLDOWN_CHECK = 0.1, 0.25
COOLDOWN_PAIR = ("llama", "cem tied T=1")
DOUBLE = ("llama", "cem tied T=1", "cem diag_shared")
#: runs whose weights other experiments load (inference_steps)
KEEP_WEIGHTS = ("cem T=2",)


def slug(label: str) -> str:
    """A run-directory name for a row label."""
    return "".join(c if c.isalnum() else "_" for c in label).strip("_").replace("__", "_")


def widths(ctx: ex.Context) -> tuple[int, ...]:
    return (8, 16) if ctx.quick else WIDTHS


def base_width(ctx: ex.Context) -> int:
    return 16 if ctx.quick else BASE_WIDTH


def shape(width: int) -> dict[str, int]:
    """The model overrides of one width: d_model and d_ff = 2.75·d_model (a multiple of 8)."""
    return {"d_model": width, "d_ff": int(round(2.75 * width / 8)) * 8}


def config(ctx: ex.Context, recipe: str, lr: float, steps: int, seed: int, width: int | None = None,
           cooldown: float = COOLDOWN) -> dict[str, Any]:
    """The run config: the recipe at ``width`` with this experiment's schedule and seed."""
    model = shape(width or base_width(ctx))
    return ex.resolve(ctx, recipe, {"model": model}, {"train": {**ex.schedule(ctx, steps, lr, cooldown=cooldown),
                                                                 "seed": seed}},
                      data=ex.char_data(ctx), swept=("d_model", "d_ff"))


def run_name(label: str, seed: int, width: int | None = None, tag: str = "") -> str:
    """``<slug>[_d<width>][_<tag>]_s<seed>`` (the base width has no width part, as the earlier runs)."""
    return f"{slug(label)}{'' if width is None else f'_d{width}'}{f'_{tag}' if tag else ''}_s{seed}"


def lr_check(ctx: ex.Context, label: str) -> dict[str, Any]:
    """Row ``label``'s own LR check at the base width: its family's LR and the half-decades either side."""
    recipe, centre, _, prefix = VARIANTS[label]
    lrs = (half_decade(centre, up=False), centre, half_decade(centre, up=True))
    return lr_sweep(ctx, prefix, lambda lr, steps: config(ctx, recipe, lr, steps, 1), lrs, SWEEP_STEPS)


def trained_run(ctx: ex.Context, label: str, seed: int):
    """The record of row ``label``'s ``seed`` at the base width (its own LR), trained if not recorded."""
    recipe = VARIANTS[label][0]
    lr = lr_check(ctx, label)["best_lr"]
    name = run_name(label, seed)
    ex.train_or_resume(ctx, name, config(ctx, recipe, lr, STEPS, seed))
    return ex.record_dir(ctx, name)


def _flops_per_token(cfg: dict[str, Any]) -> float:
    from energyformer.models.flops import training_flops_per_token
    from energyformer.models.registry import build_model
    from energyformer.runs.config import load_config

    run_cfg = load_config(dict(cfg), resolve_vocab=True)
    return training_flops_per_token(build_model(run_cfg.model))


def run(ctx: ex.Context) -> dict[str, Any]:
    """LR checks, then every run (base width first, then one seed of each other width, the checks of
    the verdict, the other widths' further seeds), then the tables of the fixed evaluation."""
    checks = {label: lr_check(ctx, label) for label in VARIANTS}
    ex.need_runs(ctx)
    lr = {label: c["best_lr"] for label, c in checks.items()}
    plan: list[dict[str, Any]] = []  # every run: label, width, seed, steps, cooldown, name, cfg

    def add(label: str, width: int | None, seed: int, steps: int = STEPS, cooldown: float = COOLDOWN,
            tag: str = "") -> None:
        w = width or base_width(ctx)
        name = run_name(label, seed, None if w == base_width(ctx) else w, tag)
        cfg = config(ctx, VARIANTS[label][0], lr[label], steps, seed, w, cooldown)
        plan.append({"label": label, "width": w, "seed": seed, "steps": steps, "cooldown": cooldown, "name": name,
                     "tag": tag, "cfg": cfg})

    for label, (_, _, n_seeds, _) in VARIANTS.items():
        for seed in ctx.seed_list(n_seeds):
            add(label, None, seed)
    other_widths = [w for w in widths(ctx) if w != base_width(ctx)]

    def width_runs(first_seed: bool) -> None:
        for w in other_widths:
            for label in WIDTH_FAMILIES:
                seeds = ctx.seed_list(VARIANTS[label][2])
                for seed in seeds[:1] if first_seed else seeds[1:]:
                    add(label, w, seed)

    # most informative first (the order the --jobs pool trains in): one seed of every width (the
    # matched curves), then the verdict's checks, then the sweep's further seeds, which a budget cut
    # drops first
    width_runs(first_seed=True)
    for label in COOLDOWN_PAIR:
        add(label, None, 1, cooldown=COOLDOWN_CHECK, tag=f"cooldown{int(COOLDOWN_CHECK * 100)}")
    for label in DOUBLE:
        add(label, None, 1, steps=2 * STEPS, tag="2x")
    width_runs(first_seed=False)
    for p in plan:
        p["summary"] = ex.train_or_resume(ctx, p["name"], p["cfg"])
    ex.need_runs(ctx)
    return _report(ctx, plan, checks)


def _report(ctx: ex.Context, plan: list[dict[str, Any]], checks: dict[str, Any]) -> dict[str, Any]:
    flops: dict[tuple[str, int], float] = {}
    runs = []
    for p in plan:
        s = p["summary"]
        if s.get("missing"):  # --interim: not recorded yet (named in the table's header)
            continue
        key = (p["label"], p["width"])
        if key not in flops:
            flops[key] = _flops_per_token(p["cfg"])
        tr = p["cfg"]["train"]
        tokens = tr["max_steps"] * tr["batch_size"] * p["cfg"]["model"]["block_size"]
        where = ex.record_dir(ctx, p["name"])
        runs.append({k: p[k] for k in ("label", "width", "seed", "steps", "cooldown", "name", "tag")}
                    | {"diverged": bool(s.get("diverged")), "val_loss": (s.get("final_eval") or {}).get("value"),
                       "train_loss": s.get("final_train_loss"), "params": s.get("params"),
                       "train_flops": flops[key] * tokens, "minutes": s.get("minutes"),
                       "convergence": None if s.get("diverged") else conv.convergence(where)})
    main = [r for r in runs if not r["tag"]]
    base = base_width(ctx)
    table = _equal_tokens_table(main, base, checks) + "\n\n" + _width_table(main) + "\n\n" + _matched_table(main, base)
    table += "\n\n" + _checks_table(runs, base)
    floors = report.count_floors(ex.char_data(ctx), ctx)
    table += "\n\n" + report.floors_table(floors, "val loss (nats/char)")
    groups: dict[str, list] = {}
    for r in main:
        if r["width"] == base:
            groups.setdefault(r["label"], []).append(ex.record_dir(ctx, r["name"]))
    report.plot_learning_curves(ctx, groups, "loss_curves.png", floors=floors, ylabel="val loss (nats/char)")
    _size_plots(ctx, main)
    header = ("CEM against Llama on Shakespeare-char (4 layers, 4,000 steps × 32 × 128 characters, WSD with a 10% "
              "cooldown). Val loss: the fixed evaluation (the whole validation split, nats/char, from the kept "
              "weights), mean ± sample std over seeds. Δ: the paired difference (seed s: the same batches for every "
              "arm) with its 95% t-interval. " + conv.CONVERGED_NOTE)
    diverged = [r["name"] for r in runs if r["diverged"]]
    if diverged:
        header += f" Diverged (loss NaN/Inf; in no table): {', '.join(diverged)}."
    sweeps = list(checks.values())
    return report.write_results(ctx, table, {"runs": runs, "floors": floors, "lr_checks": sweeps},
                            header, "LR checks (1,000 steps, seed 1; in-training estimate on the same 10 validation "
                            "batches for every LR):\n\n" + sweep_table(sweeps))


def _by(runs, **want) -> dict[int, dict[str, Any]]:
    """seed → run of the runs matching ``want``."""
    return {r["seed"]: r for r in runs if all(r[k] == v for k, v in want.items()) and r["val_loss"] is not None}


def _equal_tokens_table(main, base: int, checks) -> str:
    rows = []
    llama = {s: r["val_loss"] for s, r in _by(main, label="llama", width=base).items()}
    t1 = {s: r["val_loss"] for s, r in _by(main, label="cem tied T=1", width=base).items()}
    for label in VARIANTS:
        got = _by(main, label=label, width=base)
        if not got:
            continue
        vals = {s: r["val_loss"] for s, r in got.items()}
        first = next(iter(got.values()))
        rows.append([label, f"{checks[label]['best_lr']:g}", f"{first['params']:,}",
                     f"{first['train_flops']:.3g}", report.pm(list(vals.values())), len(vals),
                     conv.converged_cell([r["convergence"] for r in got.values()]),
                     "–" if label == "llama" else format_difference(paired_difference(llama, vals)),
                     "–" if label in ("llama", "cem tied T=1") else format_difference(paired_difference(t1, vals))])
    return (f"Equal tokens, d_model {base}:\n\n"
            + report.markdown_table(["model", "LR (own check)", "params", "training FLOPs", "val loss", "seeds",
                                 "converged", "Δ vs llama", "Δ vs T=1"], rows))


def _width_table(main) -> str:
    rows = []
    for label in WIDTH_FAMILIES:
        for w in sorted({r["width"] for r in main if r["label"] == label}):
            got = _by(main, label=label, width=w)
            if not got:
                continue
            first = next(iter(got.values()))
            rows.append([label, w, f"{first['params']:,}", f"{first['train_flops']:.3g}",
                         report.pm([r["val_loss"] for r in got.values()]), len(got),
                         conv.converged_cell([r["convergence"] for r in got.values()])])
    return "Width sweep (loss against parameters and training FLOPs):\n\n" + report.markdown_table(
        ["family", "d_model", "params", "training FLOPs", "val loss", "seeds", "converged"], rows)


def matched_gap(main, label: str, ref: str, width: int, axis: str) -> dict[str, Any]:
    """Per seed: ``label``'s loss at ``width`` minus ``ref``'s curve (over its widths, that seed)
    read at the same ``axis`` (``"params"`` or ``"train_flops"``); paired over seeds."""
    curves: dict[int, list[tuple[float, float]]] = {}
    for q in main:
        if q["label"] == ref and q["val_loss"] is not None:
            curves.setdefault(q["seed"], []).append((q[axis], q["val_loss"]))
    return matched_difference(curves, {s: (r[axis], r["val_loss"])
                                       for s, r in _by(main, label=label, width=width).items()})


def _gap_row(main, label: str, ref: str, width: int) -> list[Any]:
    """One row of the gaps table: ``label − ref`` at ``width`` at equal tokens (paired by seed), and
    against ``ref``'s width curve at ``label``'s parameters and training FLOPs."""
    eq = paired_difference({s: r["val_loss"] for s, r in _by(main, label=ref, width=width).items()},
                           {s: r["val_loss"] for s, r in _by(main, label=label, width=width).items()})
    return [f"{label} − {ref}", width, format_difference(eq),
            format_difference(matched_gap(main, label, ref, width, "params")),
            format_difference(matched_gap(main, label, ref, width, "train_flops"))]


def _matched_table(main, base: int) -> str:
    def widths_of(label: str) -> list[int]:
        return sorted({r["width"] for r in main if r["label"] == label})

    rows = [_gap_row(main, label, "llama", w) for label in WIDTH_FAMILIES[1:] for w in widths_of(label)]
    # the CEM paper's diagonal claim at every width: the shared diagonal against tied T=1
    rows += [_gap_row(main, WIDTH_FAMILIES[2], WIDTH_FAMILIES[1], w) for w in widths_of(WIDTH_FAMILIES[2])]
    # T=2 and the full CEM (base width only) against T=1's curve, and against Llama's: the CEM paper's
    # claim is the full model matching Llama with fewer parameters, so its equal-parameter reading
    rows += [_gap_row(main, label, ref, base) for label in ("cem T=2", "cem full (T=2+D+LR+P)")
             for ref in ("cem tied T=1", "llama")]
    return ("Gaps (val loss, nats/char; negative: the first model is better). Matched: the second model's curve over "
            "its widths, same seed, read (linear in log size) at the first model's parameters or training FLOPs; "
            "– where that lies outside the widths trained:\n\n"
            + report.markdown_table(["comparison", "d_model", "equal tokens", "equal parameters", "equal FLOPs"], rows))


def _checks_table(runs, base: int) -> str:
    rows = []
    a, b = COOLDOWN_PAIR
    for tag, what in ((f"cooldown{int(COOLDOWN_CHECK * 100)}", f"{int(COOLDOWN_CHECK * 100)}% cooldown"),
                      ("", f"{int(COOLDOWN * 100)}% cooldown")):
        ra, rb = _by(runs, label=a, width=base, tag=tag).get(1), _by(runs, label=b, width=base, tag=tag).get(1)
        if ra and rb:
            rows.append([f"{b} − {a}", what, "1", f"{rb['val_loss'] - ra['val_loss']:+.4f}"])
    for label in DOUBLE[1:]:
        for tag, what in (("", f"{STEPS:,} steps"), ("2x", f"{2 * STEPS:,} steps")):
            ra = _by(runs, label="llama", width=base, tag=tag).get(1)
            rb = _by(runs, label=label, width=base, tag=tag).get(1)
            if ra and rb:
                rows.append([f"{label} − llama", what, "1", f"{rb['val_loss'] - ra['val_loss']:+.4f}"])
    return ("Does the verdict hinge on the cooldown or the budget? (seed 1, val loss difference):\n\n"
            + report.markdown_table(["comparison", "setting", "seed", "Δ val loss"], rows))


def _size_plots(ctx: ex.Context, main) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, axis, xlabel in ((axes[0], "params", "parameters"), (axes[1], "train_flops", "training FLOPs")):
        for label in VARIANTS:
            pts = {}
            for r in main:
                if r["label"] == label and r["val_loss"] is not None:
                    pts.setdefault(r["width"], []).append((r[axis], r["val_loss"]))
            if not pts:
                continue
            xs = [sum(p[0] for p in v) / len(v) for _, v in sorted(pts.items())]
            ys = [report.mean_std([p[1] for p in v])[0] for _, v in sorted(pts.items())]
            ax.plot(xs, ys, "o-" if len(xs) > 1 else "s", label=label)
        report.finish_axes(ax, xlabel, "val loss (nats/char)", logx=True)
    report.save_figure(ctx, fig, "loss_vs_size.png")
