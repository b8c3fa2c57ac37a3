"""(e) ``energy_descent``: per-token energy per step of a trained NRGPT with ``η = c·diag(γ)``
(provable descent, docs/nrgpt.md §5) and with the free ``η`` (a full d×d map): the fraction of
tokens whose total energy is monotone non-increasing from step ``s`` on, at the trained 4 steps
and at 8 and 16 (inference-time scaling), on models trained to a plateau.

Runs: ``configs/shakespeare_char/nrgpt.yaml`` (NRGPT FF2W, block 128, batch 32) with d_model 64,
4 heads, 4 steps and ``eta_param`` ∈ {c_diag_gamma, full}; 5,000 steps, constant LR with a 10%
linear cooldown (``lr_schedule: wsd``), 50 evaluations. The LR of each η arm is chosen by a
sweep over {3e-4, 1e-3, 3e-3} at 1,250 steps (seed 1). Traced on 8 validation sequences of 128
characters.

Both arms train once more at twice the steps (seed 1), and a table shows whether the sign and size
of their difference, and the descent, survive the longer run.

LR sensitivity (the NRGPT paper reports NRGPT as more sensitive to its hyperparameters than a
recurrent GPT): GPT_Rec_parallel (``configs/shakespeare_char/gpt_rec_parallel.yaml``) at the same
shape (d_model 64, 4 heads, 4 steps) is swept over the same LRs at the same 1,250 steps. Measured
as the paper means it: from each family's best LR, the loss cost (fixed evaluation) of ÷3 and ×3,
paired over :data:`LR_COST_SEEDS` seeds at the sweep's budget, and each NRGPT arm's cost minus
GPT_Rec_parallel's, paired by seed (:func:`cost_against`); the earlier fixed-grid spread
(worst − best over 3e-4, 1e-3, 3e-3) is kept beside it.

Budget (idle 2-core CPU, ≈ 20k tokens/s): 9 sweep runs (one more for each sweep extended past an
edge) and 18 LR-cost runs of 1,250 steps, and 2 arms × 2 seeds of 5,000 steps ≈ 3.5 hours; the 2× pair
≈ 2.6 hours more (measured: a 5,000-step pair took 33 + 44 min).
``--quick``: the docstring corpus, d_model 16, 20 steps, seconds.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from energyformer.experiments import common as ex
from energyformer.experiments import convergence as conv
from energyformer.experiments import report
from energyformer.experiments.sweeps import half_decade, lr_sweep, sweep_table

RECIPE = "shakespeare_char/nrgpt.yaml"
BASELINE_RECIPE = "shakespeare_char/gpt_rec_parallel.yaml"
ARMS = {"η = c·diag(γ)": "c_diag_gamma", "free η (full)": "full"}
SHAPE = {"d_model": 64, "n_heads": 4, "n_steps": 4}
STEPS, SWEEP_STEPS, LRS = 5000, 1250, (3e-4, 1e-3, 3e-3)
TRACE_STEPS = (4, 8, 16)
DEFAULT_SEEDS = 2
#: seeds of the LR-cost runs (best LR, ×3 and ÷3 per family)
LR_COST_SEEDS = 2


def config(ctx: ex.Context, eta: str, lr: float, steps: int, seed: int) -> dict[str, Any]:
    """The run config of one η arm: the recipe + this experiment's shape, schedule and seed."""
    return ex.resolve(ctx, RECIPE, {"model": {**SHAPE, "eta_param": eta}},
                   {"train": {**ex.schedule(ctx, steps, lr), "seed": seed}}, data=ex.char_data(ctx))


def baseline_config(ctx: ex.Context, lr: float, steps: int, seed: int) -> dict[str, Any]:
    """GPT_Rec_parallel at this experiment's shape and schedule (the LR-sensitivity baseline)."""
    return ex.resolve(ctx, BASELINE_RECIPE, {"model": SHAPE},
                   {"train": {**ex.schedule(ctx, steps, lr), "seed": seed}}, data=ex.char_data(ctx))


def lr_sensitivity(sweeps: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Per family, the final val loss at each LR of :data:`LRS` (read from its sweep) and the spread
    over them: ``worst − best`` (nats) and ``(worst − best) / best``. A diverged run makes the
    spread infinite. Returns ``(markdown table, rows)``."""
    rows, cells = [], []
    for s in sweeps:
        at = dict(zip(s["lrs"], s["final_val_loss"]))
        vals = [at.get(lr, float("nan")) for lr in LRS]
        spread = max(vals) - min(vals)
        rows.append({"family": s["family"], "final_val_loss": vals, "spread": spread,
                     "relative_spread": spread / min(vals)})
        cells.append([s["family"], *[("diverged" if v == float("inf") else f"{v:.4f}") for v in vals],
                      f"{spread:.4f}", f"{spread / min(vals):.1%}"])
    head = ["family", *[f"LR {lr:g}" for lr in LRS], "spread (nats)", "spread / best"]
    return report.markdown_table(head, cells), rows


def trained_run(ctx: ex.Context, eta: str, seed: int):
    """The run directory of the ``eta`` arm's ``seed`` (LR from its sweep), trained if not recorded."""
    sweep = lr_sweep(ctx, f"nrgpt_{eta}", lambda lr, steps: config(ctx, eta, lr, steps, 1), LRS, SWEEP_STEPS)
    name = f"nrgpt_{eta}_s{seed}"
    ex.train_or_resume(ctx, name, config(ctx, eta, sweep["best_lr"], STEPS, seed))
    return ex.record_dir(ctx, name)


def monotone_fraction(energy: torch.Tensor, tol: float = 1e-6) -> list[float]:
    """``energy`` ``(S + 1, B, N)`` → for each ``s = 0 … S−1`` the share of tokens whose energy never
    rises (by more than ``tol``·(1 + |E|)) at any step after ``s``."""
    diffs = energy[1:] - energy[:-1]  # (S, B, N)
    rises = diffs > tol * (1 + energy[:-1].abs())
    out = []
    for s in range(diffs.shape[0]):
        out.append(float((~rises[s:].any(0)).float().mean()))
    return out


@torch.no_grad()
def trace_energies(model: torch.nn.Module, batch: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Total per-token energy ``(S + 1, B, N)`` of ``model`` on ``batch`` with ``n_steps`` steps."""
    with model.trace() as trace:
        model(batch, n_steps=n_steps)
    return trace.energy("total").double()


def _trace_run(run_dir) -> tuple[dict[int, Any], np.ndarray]:
    from energyformer.data import load_split
    from energyformer.runs.rundir import load_run

    model, run_cfg, _ = load_run(run_dir)
    val = np.asarray(load_split(run_cfg.data.path, "val"), dtype=np.int64)
    N = run_cfg.model.block_size
    n_seq = min(8, len(val) // N)
    batch = torch.from_numpy(val[: n_seq * N].reshape(n_seq, N))
    entry, e = {}, None
    for steps in TRACE_STEPS:
        e = trace_energies(model, batch, steps)
        entry[steps] = {"monotone_from": monotone_fraction(e), "mean_energy": e.mean((1, 2)).tolist()}
    return entry, e[:, 0, : min(16, N)].numpy()


def lr_cost_runs(ctx: ex.Context, family: str, make_cfg, best: float) -> dict[float, dict[int, dict[str, Any]]]:
    """The LR-sensitivity runs of one family: its best LR and ×3 / ÷3 (the half-decades either side), at
    the sweep's budget, seeds 1 … :data:`LR_COST_SEEDS`, with kept weights. Returns lr → seed → summary."""
    lrs = (half_decade(best, up=False), best, half_decade(best, up=True))
    return {lr: {seed: ex.train_or_resume(ctx, f"lrcost_{family}_lr{lr:g}_s{seed}", make_cfg(lr, SWEEP_STEPS, seed))
                 for seed in range(1, (1 if ctx.quick else LR_COST_SEEDS) + 1)} for lr in lrs}


def lr_cost(runs: dict[float, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """The loss cost (fixed evaluation) of ÷3 and ×3 from the best LR, paired by seed, and each seed's
    cost (``cost_by_seed``: ``{"down" | "up": {seed: loss there − loss at the best LR}}``)."""
    from energyformer.experiments.stats import paired_difference

    down, best, up = sorted(runs)
    at = {lr: {seed: (s.get("final_eval") or {}).get("value", math.inf) if not s.get("diverged") else math.inf
               for seed, s in by_seed.items()} for lr, by_seed in runs.items()}
    by_seed = {way: {seed: at[lr][seed] - at[best][seed] for seed in at[best] if seed in at[lr]}
               for way, lr in (("down", down), ("up", up))}
    return {"lrs": [down, best, up], "loss": {f"{lr:g}": at[lr] for lr in (down, best, up)},
            "down": paired_difference(at[best], at[down]), "up": paired_difference(at[best], at[up]),
            "cost_by_seed": by_seed}


def cost_against(rows: dict[str, dict[str, Any]], baseline: str = "gpt_rec_parallel") -> dict[str, dict[str, Any]]:
    """Each family's LR cost minus ``baseline``'s, paired by seed, for ÷3 (``down``) and ×3 (``up``): the
    direct test of "more sensitive than a recurrent GPT" (positive: the family pays more for the same
    LR error). ``rows``: family → :func:`lr_cost`."""
    from energyformer.experiments.stats import paired_difference

    ref = rows[baseline]["cost_by_seed"]
    return {fam: {way: paired_difference(ref[way], r["cost_by_seed"][way]) for way in ("down", "up")}
            for fam, r in rows.items() if fam != baseline}


def run(ctx: ex.Context) -> dict[str, Any]:
    """Sweep the LR per η arm (and GPT_Rec_parallel's), train the seeds and the LR-cost runs, trace
    validation text, tabulate monotone fractions, losses and LR costs."""
    makers = {f"nrgpt_{eta}": (lambda lr, steps, seed, eta=eta: config(ctx, eta, lr, steps, seed))
              for eta in ARMS.values()}
    makers["gpt_rec_parallel"] = lambda lr, steps, seed: baseline_config(ctx, lr, steps, seed)
    sweeps = {fam: lr_sweep(ctx, fam, lambda lr, steps, m=m: m(lr, steps, 1), LRS, SWEEP_STEPS)
              for fam, m in makers.items()}
    ex.need_runs(ctx)
    trained = {label: {seed: ex.train_or_resume(ctx, f"nrgpt_{eta}_s{seed}",
                                                config(ctx, eta, sweeps[f"nrgpt_{eta}"]["best_lr"], STEPS, seed))
                       for seed in ctx.seed_list(DEFAULT_SEEDS)} for label, eta in ARMS.items()}
    costs = {fam: lr_cost_runs(ctx, fam, makers[fam], sweeps[fam]["best_lr"]) for fam in makers}
    doubled = {label: ex.train_or_resume(ctx, f"nrgpt_{eta}_2x_s1",
                                         config(ctx, eta, sweeps[f"nrgpt_{eta}"]["best_lr"], 2 * STEPS, 1))
               for label, eta in ARMS.items()}
    ex.need_runs(ctx)
    results, curves, groups = {}, {}, {}
    for label, eta in ARMS.items():
        per_seed = []
        for seed, summary in trained[label].items():
            where = ex.record_dir(ctx, f"nrgpt_{eta}_s{seed}")
            groups.setdefault(label, []).append(where)
            entry, curve = _trace_run(where)
            curves.setdefault(label, curve)
            per_seed.append({"seed": seed, "trace": entry, "val_loss": summary["final_eval"]["value"],
                             "convergence": conv.convergence(where)})
        results[label] = {"lr": sweeps[f"nrgpt_{eta}"]["best_lr"], "seeds": per_seed,
                          "steps": trained[label][1]["steps"]}
    sweep_list = list(sweeps.values())
    sensitivity, sensitivity_rows = lr_sensitivity(sweep_list)
    cost_rows = {fam: lr_cost(c) for fam, c in costs.items()}
    against = cost_against(cost_rows)
    floors = report.count_floors(ex.char_data(ctx), ctx)
    check, check_rows = _budget_check(ctx, results, doubled)
    table = (_table(results) + "\n\n" + _difference(results) + "\n\n" + check + "\n\n"
             + report.floors_table(floors, "val loss (nats/char)"))
    _plots(ctx, results, curves, groups, floors)
    header = (f"Energy descent of NRGPT per token (total energy E_AT + s_ff E_FF), {len(ctx.seed_list(DEFAULT_SEEDS))} "
              "seed(s), trained with 4 steps: fraction of tokens whose energy never rises after step s. Val loss: the "
              "fixed evaluation (whole validation split, nats/char, kept weights). " + conv.CONVERGED_NOTE)
    footer = ("LR sweeps (seed 1, in-training estimate on the same 10 validation batches for every LR):\n\n"
              + sweep_table(sweep_list)
              + "\n\nLR sensitivity as the NRGPT paper means it: the loss cost of ÷3 and ×3 from each family's best LR "
              f"(fixed evaluation, {SWEEP_STEPS:,} steps, paired over {1 if ctx.quick else LR_COST_SEEDS} seeds, 95% "
              "t-interval):\n\n" + _cost_table(cost_rows, against)
              + f"\n\nThe earlier reading, on a fixed grid (sweep runs, seed 1; spread = worst − best over "
              f"{', '.join(f'{lr:g}' for lr in LRS)}):\n\n" + sensitivity)
    return report.write_results(ctx, table, {"rows": _jsonable(results), "budget_check": check_rows,
                                         "lr_sweeps": sweep_list,
                                         "lr_sensitivity": sensitivity_rows, "lr_cost": cost_rows,
                                         "lr_cost_vs_gpt_rec_parallel": against, "floors": floors},
                            header, footer)


def _budget_check(ctx: ex.Context, results: dict[str, Any], doubled: dict[str, dict[str, Any]]
                  ) -> tuple[str, list[dict[str, Any]]]:
    """The two η arms at the main budget (seed 1) and at twice the steps: the fixed evaluation and the
    convergence of each, and each 2× run's share of tokens whose energy does not rise over the last of
    the 4 trained steps (does descent survive longer training?)."""
    (la, eta_a), (lb, eta_b) = list(ARMS.items())[:2]
    base = {label: next(s for s in results[label]["seeds"] if s["seed"] == 1) for label in (la, lb)}
    last = lambda trace: trace[TRACE_STEPS[0]]["monotone_from"][-1]  # noqa: E731
    longer = {}
    for label, eta in ((la, eta_a), (lb, eta_b)):
        where = ex.record_dir(ctx, f"nrgpt_{eta}_2x_s1")
        entry, _ = _trace_run(where)
        longer[label] = {"val_loss": doubled[label]["final_eval"]["value"], "convergence": conv.convergence(where),
                         "trace": entry}
    steps = {"base": results[la]["steps"], "2x": doubled[la]["steps"]}
    text, rows = report.budget_check(
        [(f"{lb} − {la}", steps[k], (pts[la]["val_loss"], pts[la]["convergence"]),
          (pts[lb]["val_loss"], pts[lb]["convergence"])) for k, pts in (("base", base), ("2x", longer))],
        "val loss")
    for row, pts in zip(rows, (base, longer)):  # rows come in the order given: the main budget, then 2×
        row["monotone_last_step"] = {label: last(pts[label]["trace"]) for label in (la, lb)}
    text += (f"\n\nTokens whose energy does not rise over the last of the {TRACE_STEPS[0]} trained steps (seed 1, "
             "the 8 validation sequences above): "
             + "; ".join(f"{label} {rows[0]['monotone_last_step'][label]:.3f} at {steps['base']:,} steps, "
                         f"{rows[1]['monotone_last_step'][label]:.3f} at {steps['2x']:,}" for label in (la, lb)) + ".")
    return text, rows


def _difference(results: dict[str, Any]) -> str:
    from energyformer.experiments.stats import format_difference, paired_difference

    (la, a), (lb, b) = list(results.items())[:2]
    d = paired_difference({s["seed"]: s["val_loss"] for s in a["seeds"]},
                          {s["seed"]: s["val_loss"] for s in b["seeds"]})
    return report.markdown_table(["comparison", "Δ val loss (paired by seed, 95% interval)"],
                             [[f"{lb} − {la}", format_difference(d)]])


def _cost_table(rows: dict[str, Any], against: dict[str, Any]) -> str:
    from energyformer.experiments.stats import format_difference

    vs = lambda fam, way: format_difference(against[fam][way]) if fam in against else "–"  # noqa: E731
    cells = [[fam, f"{r['lrs'][1]:g}", format_difference(r["down"]), format_difference(r["up"]), vs(fam, "down"),
              vs(fam, "up")] for fam, r in rows.items()]
    return report.markdown_table(["family", "best LR", "cost of ÷3", "cost of ×3",
                                  "÷3: cost − GPT_Rec_parallel's (paired)", "×3: cost − GPT_Rec_parallel's (paired)"],
                                 cells)


def _table(results: dict[str, Any]) -> str:
    rows = []
    for label, r in results.items():
        seeds = r["seeds"]
        for steps in TRACE_STEPS:
            fr = [[s["trace"][steps]["monotone_from"][k] for s in seeds] for k in range(steps)]
            rows.append([label, f"{r['lr']:g}", report.pm([s["val_loss"] for s in seeds]),
                         conv.converged_cell([s["convergence"] for s in seeds]), steps]
                        + [report.pm(f, 3) for f in (fr[0], fr[1], fr[steps // 2], fr[-1])])
    return report.markdown_table(["η", "LR", "val loss", "converged", "steps at inference", "monotone from step 0",
                           "from 1", "from S/2", "last step"], rows)


def _plots(ctx: ex.Context, results: dict[str, Any], curves: dict[str, np.ndarray], groups, floors) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (label, e) in zip(axes.flat, curves.items()):
        for j in range(e.shape[1]):
            ax.plot(range(e.shape[0]), e[:, j], alpha=0.7, linewidth=1)
        ax.axvline(4, color="gray", linestyle=":")
        ax.set_title(f"{label}: total energy per token ({TRACE_STEPS[-1]} steps; trained 4)", fontsize=9)
        report.finish_axes(ax, "step", "energy")
    report.save_figure(ctx, fig, "energy_per_token.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in results.items():
        m = np.mean([s["trace"][TRACE_STEPS[-1]]["monotone_from"] for s in r["seeds"]], axis=0)
        ax.plot(range(len(m)), m, "o-", label=label)
    ax.set_ylim(-0.02, 1.02)
    report.finish_axes(ax, f"s (monotone from step s on, {TRACE_STEPS[-1]} steps)", "fraction of tokens")
    report.save_figure(ctx, fig, "monotone_fraction.png")
    report.plot_learning_curves(ctx, groups, floors=floors, ylabel="val loss (nats/char)")


def _jsonable(results: dict[str, Any]) -> dict[str, Any]:
    return {label: {**r, "seeds": [{**s, "trace": {str(k): v for k, v in s["trace"].items()}} for s in r["seeds"]]}
            for label, r in results.items()}
