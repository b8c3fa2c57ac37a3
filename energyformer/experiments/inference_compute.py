"""(g) ``inference_compute``: does inference-time compute pay? Loss against the number of steps at
inference, per-token adaptive exit, and energy as an uncertainty signal (docs/inference_compute.md),
for models trained with a fixed depth and with a randomized depth.

Models (Shakespeare-char, d_model 64, 4 heads, block 128, batch 32, 5,000 steps, WSD with a 10%
cooldown; the shape, schedule and LRs of ``energy_descent``, so the same tokens):

- NRGPT FF2W with η = c·diag(γ) and with the free η, and GPT_Rec_parallel;
- each trained with a **fixed depth** of 4 steps and with a **randomized depth** of mean 4
  (``train.depth_sampler: poisson_lognormal``, ``depth_mean 4``, capped at ``depth_max`` 16, full
  back-propagation; docs/training.md "Randomized depth");
- 2 seeds each (paired: seed s gives every model the same batches). The fixed-depth NRGPT runs are
  ``energy_descent``'s own (``nrgpt_<η>_s<seed>``, reused); the other 8 train here, each at its
  family's best LR of ``energy_descent``'s sweeps (NRGPT 3e-3, GPT_Rec_parallel 1e-2).

Evaluation, on one fixed set of :data:`EVAL_BATCHES` validation batches drawn with :data:`EVAL_SEED`
(the same windows for every model, seed, depth and criterion):

1. the loss at K = 1 … :data:`MAX_STEPS` steps;
2. for each exit criterion (``abs``, ``rel``, ``kl``; ``energy`` and ``grad`` for NRGPT) and each of
   its thresholds (:data:`THRESHOLDS`), with at most :data:`REF_STEPS` steps (and, for the
   randomized-depth models, at most :data:`MAX_STEPS`): the loss and the mean steps per token; the
   share of steps saved at ≤ :data:`TOLERANCE` nats above the fixed-depth loss at :data:`REF_STEPS`
   (``1 − mean steps / REF_STEPS``, the best threshold that stays within the tolerance);
3. NRGPT: the correlation (Pearson and Spearman, over tokens) of each token's final total energy with
   its loss, at :data:`REF_STEPS` steps.

Targets the table checks and states as met or missed: a randomized-depth model whose loss keeps
falling past its mean training depth (its best loss at any depth above 4 below the loss at 4, in
every seed, by more than the seeds' spread at 4), and an exit criterion that saves ≥ 30% of the steps at ≤ 0.01 nats.

Budget (idle 2-core CPU): 8 training runs of 5,000 steps ≈ 3 CPU-hours with ``--jobs 2``, and the
evaluation ≈ 5 minutes per fixed-depth model and ≈ 15 per randomized-depth one (its exits run up to 16
steps; every measurement is cached, :func:`evaluation`). ``--quick``: the docstring corpus, d_model 16, 20 steps.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from energyformer.experiments import common as ex
from energyformer.experiments import convergence as conv
from energyformer.experiments import energy_descent as ed
from energyformer.experiments import report
from energyformer.experiments.sweeps import lr_sweep

#: row label -> (energy_descent's family name (its LR sweep), NRGPT η arm or None for GPT_Rec_parallel)
FAMILIES: dict[str, tuple[str, str | None]] = {
    "NRGPT η = c·diag(γ)": ("nrgpt_c_diag_gamma", "c_diag_gamma"),
    "NRGPT free η": ("nrgpt_full", "full"),
    "GPT_Rec_parallel": ("gpt_rec_parallel", None),
}
#: training depth -> the ``train`` overrides (``fixed``: the model's own n_steps, 4)
DEPTHS: dict[str, dict[str, Any]] = {
    "fixed 4": {},
    "random (mean 4)": {"depth_sampler": "poisson_lognormal", "depth_mean": 4.0, "depth_max": 16},
}
REF_STEPS, MAX_STEPS = 4, 16
EVAL_SEED, EVAL_BATCHES = 0, 16
TOLERANCE, SAVED_TARGET = 0.01, 0.30
#: criterion -> thresholds tried (loosest first), spanning from firing at the first step to never firing
#: at 4 steps (measured on energy_descent's NRGPT: rel 1 exits at step 1, rel 0.3 never; kl 1 at 2.2
#: steps of 4, kl 0.03 at 3.9); energy and grad apply to the energy models only
THRESHOLDS: dict[str, tuple[float, ...]] = {
    "abs": (10.0, 3.0, 1.0, 0.3, 0.1),
    "rel": (1.0, 0.3, 0.1, 0.03, 0.01),
    "kl": (1.0, 1e-1, 1e-2, 1e-3, 1e-4),
    "energy": (10.0, 1.0, 1e-1, 1e-2),
    "grad": (30.0, 10.0, 3.0, 1.0, 0.3),
}
ENERGY_CRITERIA = ("energy", "grad")
DEFAULT_SEEDS = 2
#: per-model evaluations, cached under the experiment's results (:func:`evaluation`)
EVALS_DIR = "evals"


def _source(ctx: ex.Context) -> ex.Context:
    """``energy_descent``'s context (its sweeps and fixed-depth NRGPT runs are reused from its records)."""
    return dataclasses.replace(ctx, name="energy_descent", deferred=False, pending={}, rescored=set(),
                               said=ctx.said, jobs=1)  # what it announced is announced once


def _maker(ctx: ex.Context, eta: str | None):
    """``(lr, steps, seed) -> config`` of a family at energy_descent's shape and schedule."""
    if eta is None:
        return lambda lr, steps, seed: ed.baseline_config(ctx, lr, steps, seed)
    return lambda lr, steps, seed: ed.config(ctx, eta, lr, steps, seed)


def best_lr(ctx: ex.Context, family: str) -> float:
    """The family's best LR from ``energy_descent``'s committed sweep (trained there if missing)."""
    src = _source(ctx)
    eta = dict(FAMILIES.values())[family]
    make = _maker(src, eta)
    return lr_sweep(src, family, lambda lr, steps: make(lr, steps, 1), ed.LRS, ed.SWEEP_STEPS)["best_lr"]


def run_config(ctx: ex.Context, label: str, depth: str, seed: int) -> dict[str, Any]:
    """The run config of ``label`` trained with ``depth`` (:data:`DEPTHS`), seed ``seed``."""
    family, eta = FAMILIES[label]
    cfg = _maker(ctx, eta)(best_lr(ctx, family), ed.STEPS, seed)
    if DEPTHS[depth]:
        cfg = {**cfg, "train": {**cfg["train"], **DEPTHS[depth]}}
    return cfg


def run_name(label: str, depth: str, seed: int) -> str:
    family, _ = FAMILIES[label]
    return f"{family}_{'fixed' if not DEPTHS[depth] else 'random'}_s{seed}"


def trained_run(ctx: ex.Context, label: str, depth: str, seed: int) -> dict[str, Any]:
    """The record (``{"dir", "summary"}``) of one model; the fixed-depth NRGPT is energy_descent's."""
    family, eta = FAMILIES[label]
    if eta is not None and not DEPTHS[depth]:
        src = _source(ctx)
        where = ed.trained_run(src, eta, seed)
        return {"dir": where, "summary": ex.train_or_resume(src, where.name, run_config(src, label, depth, seed))}
    name = run_name(label, depth, seed)
    summary = ex.train_or_resume(ctx, name, run_config(ctx, label, depth, seed))
    return {"dir": ex.record_dir(ctx, name), "summary": summary}


def _batches(val: np.ndarray, batch_size: int, block_size: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation windows: ``n`` batches drawn with :data:`EVAL_SEED`."""
    from energyformer.data import get_batch

    g = torch.Generator().manual_seed(EVAL_SEED)
    return [get_batch(val, batch_size, block_size, g, "cpu") for _ in range(n)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, **kwargs: Any) -> dict[str, float]:
    """Mean loss (nats/token) over ``batches`` with the forward's ``kwargs`` and the mean steps per token
    (``model.exit_steps`` after an adaptive-exit call, else the ``n_steps`` asked for)."""
    model.eval()
    losses, steps = [], []
    for x, y in batches:
        _, loss = model(x, y, **kwargs)
        losses.append(float(loss))
        taken = getattr(model, "exit_steps", None) if kwargs.get("exit") else None
        steps.append(float(taken.double().mean()) if taken is not None else float(kwargs.get("n_steps", 0)))
    return {"loss": sum(losses) / len(losses), "mean_steps": sum(steps) / len(steps)}


@torch.no_grad()
def energy_loss_correlation(model: torch.nn.Module, batches) -> dict[str, float]:
    """Pearson and Spearman correlation over tokens of the final total energy (at :data:`REF_STEPS`
    steps) with the token's loss."""
    energies, losses = [], []
    for x, y in batches:
        with model.trace() as trace:
            logits, _ = model(x, n_steps=REF_STEPS)
        energies.append(trace.energy("total")[-1].double().flatten())
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), y.flatten(),
                                                        reduction="none"))
    from energyformer.inspect.energy import energy_loss_correlation

    corr = energy_loss_correlation(torch.cat(energies), torch.cat(losses))
    return {"pearson": _nan(corr["pearson"]), "spearman": _nan(corr["spearman"]), "tokens": corr["n"]}


def _nan(value: float | None) -> float:
    return math.nan if value is None else value


def criteria(label: str) -> list[str]:
    return [c for c in THRESHOLDS if FAMILIES[label][1] is not None or c not in ENERGY_CRITERIA]


def max_steps(ctx: ex.Context) -> int:
    """The most steps at inference (``--quick``: 6, to keep the pipeline test short)."""
    return 6 if ctx.quick else MAX_STEPS


def thresholds(ctx: ex.Context, name: str) -> tuple[float, ...]:
    """The thresholds tried for criterion ``name`` (``--quick``: the middle one)."""
    return THRESHOLDS[name][1:2] if ctx.quick else THRESHOLDS[name]


def _eval_settings(ctx: ex.Context, label: str, depth: str, where) -> dict[str, Any]:
    """What every number of an evaluation of ``where`` depends on: the evaluation windows, the
    steps at inference and the sha256 of the run's weights (a cached evaluation is reused only when
    all of them are equal). The exit thresholds are not here: each ``criterion:threshold@cap``
    entry is cached on its own, so a grid extended later computes only its new entries."""
    from energyformer.experiments.scoring import WEIGHTS_FILE, file_sha256

    return {"label": label, "depth": depth, "max_steps": max_steps(ctx),
            "eval_seed": EVAL_SEED, "eval_batches": 2 if ctx.quick else EVAL_BATCHES, "quick": ctx.quick,
            "weights_sha256": file_sha256(Path(where) / WEIGHTS_FILE)}


def exit_specs(ctx: ex.Context, label: str, depth: str) -> dict[str, tuple[str, float, int]]:
    """The exits evaluated for a model: ``"name:threshold@cap" -> (name, threshold, cap)`` for every
    criterion of :func:`criteria`, threshold of :func:`thresholds` and cap (at most
    :data:`REF_STEPS` steps; and :func:`max_steps` for a randomized-depth model)."""
    caps = (REF_STEPS,) + ((max_steps(ctx),) if DEPTHS[depth] else ())
    return {f"{name}:{t:g}@{cap}": (name, t, cap)
            for cap in caps for name in criteria(label) for t in thresholds(ctx, name)}


def evaluation(ctx: ex.Context, label: str, depth: str, where) -> dict[str, Any]:
    """Every measurement of one trained model (module docstring, items 1–3), cached in
    ``<results>/inference_compute/evals/<run>.json``: what was computed with the same settings on
    the same weights is read back, only what is missing is computed (each exit entry on its own),
    and the file is rewritten after each piece — so an interrupted or repeated table, a second
    process evaluating finished runs while others train, or a longer threshold grid never computes
    a number twice. The convergence test is read fresh.

    Returns:
        ``{"label", "depth", "k" (1 … max steps), "loss" (at each k), "exit" ({spec: {"loss",
        "mean_steps", "criterion", "threshold", "max_steps"}} for :func:`exit_specs`),
        "energy_loss" (NRGPT), "convergence"}``.
    """
    from energyformer.data import load_split
    from energyformer.runs.rundir import load_run
    from energyformer.utils.io import atomic_write_json

    path = ctx.out / EVALS_DIR / f"{Path(where).name}.json"
    settings = _eval_settings(ctx, label, depth, where)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = {}
    result = saved.get("result", {}) if saved.get("settings") == settings else {}
    result.setdefault("exit", {})
    specs = exit_specs(ctx, label, depth)
    energy = FAMILIES[label][1] is not None
    todo_exits = [spec for spec in specs if spec not in result["exit"]]
    if "loss" in result and not todo_exits and (not energy or "energy_loss" in result):
        return _selected(result, specs, where)
    model, run_cfg, _ = load_run(where)
    val = np.asarray(load_split(run_cfg.data.path, "val"), dtype=np.int64)
    batches = _batches(val, 4 if ctx.quick else run_cfg.train.batch_size, run_cfg.model.block_size,
                       2 if ctx.quick else EVAL_BATCHES)

    def keep() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"settings": settings, "result": result})

    if "loss" not in result:
        ks = list(range(1, max_steps(ctx) + 1))
        result.update(label=label, depth=depth, k=ks, loss=[evaluate(model, batches, n_steps=k)["loss"] for k in ks])
        keep()
    for spec in todo_exits:
        name, t, cap = specs[spec]
        result["exit"][spec] = {**evaluate(model, batches, n_steps=cap, exit=f"{name}:{t:g}"),
                                "criterion": name, "threshold": t, "max_steps": cap}
        keep()
    if energy and "energy_loss" not in result:
        result["energy_loss"] = energy_loss_correlation(model, batches[:4])
        keep()
    return _selected(result, specs, where)


def _selected(result: dict[str, Any], specs, where) -> dict[str, Any]:
    """``result`` with only the exit entries of ``specs`` (a cache may hold more) and a fresh
    convergence test."""
    return {**result, "exit": {spec: result["exit"][spec] for spec in specs},
            "convergence": conv.convergence(where)}


def steps_saved(entry: dict[str, Any], criterion: str) -> dict[str, Any] | None:
    """The threshold of ``criterion`` (at most :data:`REF_STEPS` steps) with the fewest mean steps whose
    loss is ≤ the fixed-depth loss at :data:`REF_STEPS` + :data:`TOLERANCE`: ``{"threshold", "saved",
    "loss_above"}``, or None when no threshold stays within the tolerance."""
    ref = entry["loss"][REF_STEPS - 1]
    ok = [e for e in entry["exit"].values() if e["criterion"] == criterion and e["max_steps"] == REF_STEPS
          and e["loss"] <= ref + TOLERANCE]
    if not ok:
        return None
    best = min(ok, key=lambda e: e["mean_steps"])
    return {"threshold": best["threshold"], "saved": 1 - best["mean_steps"] / REF_STEPS,
            "loss_above": best["loss"] - ref}


def run(ctx: ex.Context) -> dict[str, Any]:
    """Train (or reuse) every model, then evaluate each and write the tables."""
    seeds = ctx.seed_list(DEFAULT_SEEDS)
    for family, _ in FAMILIES.values():
        best_lr(ctx, family)
    runs = {(label, depth, seed): trained_run(ctx, label, depth, seed)
            for label in FAMILIES for depth in DEPTHS for seed in seeds}
    ex.need_runs(ctx)
    results: dict[str, Any] = {}
    groups: dict[str, list[Any]] = {}
    for (label, depth, seed), r in runs.items():
        entry = evaluation(ctx, label, depth, r["dir"])
        entry["final_eval"] = (r["summary"].get("final_eval") or {}).get("value")
        results.setdefault(f"{label}, depth {depth}", {})[seed] = entry
        groups.setdefault(f"{label}, depth {depth}", []).append(r["dir"])
    report.plot_learning_curves(ctx, groups)
    floors = report.count_floors(ex.char_data(ctx), ctx)
    table = (_steps_table(results) + "\n\n" + _exit_table(results) + "\n\n" + _targets(results)
             + "\n\n" + _energy_table(results) + "\n\n" + report.floors_table(floors, "val loss (nats/char)"))
    _plot(ctx, results)
    header = (f"Inference-time compute, {len(seeds)} seed(s): loss (nats/char) on one fixed set of "
              f"{2 if ctx.quick else EVAL_BATCHES} validation batches (seed {EVAL_SEED}, the same windows for every "
              f"model, depth and criterion) against the steps at inference; adaptive exit at ≤ {REF_STEPS} steps "
              f"(and ≤ {max_steps(ctx)} for the randomized-depth models). " + conv.CONVERGED_NOTE)
    return report.write_results(ctx, table, {"rows": {k: {str(s): v for s, v in d.items()} for k, d in results.items()},
                                         "floors": floors}, header)


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else math.nan


def _steps_table(results: dict[str, Any]) -> str:
    n_k = len(next(iter(next(iter(results.values())).values()))["k"])
    shown = [k for k in (1, 2, 4, 6, 8, 12, 16) if k <= n_k]
    rows = []
    for key, by_seed in results.items():
        entries = list(by_seed.values())
        rows.append([key, *[report.pm([e["loss"][k - 1] for e in entries]) for k in shown],
                     report.pm([e["final_eval"] for e in entries if e["final_eval"] is not None]),
                     conv.converged_cell([e["convergence"] for e in entries])])
    return report.markdown_table(["model, training depth", *[f"K={k}" for k in shown],
                              "fixed evaluation (whole val split, trained depth)", "converged"], rows)


def _exit_table(results: dict[str, Any]) -> str:
    rows = []
    for key, by_seed in results.items():
        entries = list(by_seed.values())
        for spec in entries[0]["exit"]:
            e = [x["exit"][spec] for x in entries]
            ref = _mean([x["loss"][REF_STEPS - 1] for x in entries])
            loss = _mean([x["loss"] for x in e])
            rows.append([key, spec.replace("@", " ≤ "), f"{loss:.4f}", f"{loss - ref:+.4f}",
                         f"{_mean([x['mean_steps'] for x in e]):.2f}"])
    return report.markdown_table(["model, training depth", "exit (criterion:threshold ≤ max steps)", "loss",
                              f"vs fixed K={REF_STEPS}", "mean steps per token"], rows)


def _targets(results: dict[str, Any]) -> str:
    lines = []
    deeper = []
    for key, by_seed in results.items():
        entries = list(by_seed.values())
        if not DEPTHS[entries[0]["depth"]]:
            continue
        at_ref = [e["loss"][REF_STEPS - 1] for e in entries]
        best_k = min(range(REF_STEPS, len(entries[0]["k"])), key=lambda i: _mean([e["loss"][i] for e in entries]))
        gains = [e["loss"][REF_STEPS - 1] - e["loss"][best_k] for e in entries]
        spread = max(at_ref) - min(at_ref) if len(at_ref) > 1 else 0.0
        deeper.append((key, best_k + 1, _mean(gains), min(gains) > 0 and _mean(gains) > spread))
    met = [d for d in deeper if d[3]]
    lines.append(f"- **Target 1** (a randomized-depth model whose loss keeps falling past its mean training depth "
                 f"{REF_STEPS}, in every seed and by more than the seeds' spread at K={REF_STEPS}): "
                 f"{'met' if met else 'missed'}. "
                 + "; ".join(f"{k}: lowest past K={REF_STEPS} at K={bk}, {-g:+.4f} nats vs K={REF_STEPS}"
                             for k, bk, g, _ in deeper))
    saved = []
    for key, by_seed in results.items():
        for crit in {e["criterion"] for e in next(iter(by_seed.values()))["exit"].values()}:
            per_seed = [steps_saved(e, crit) for e in by_seed.values()]
            if all(p is not None for p in per_seed):
                saved.append((key, crit, _mean([p["saved"] for p in per_seed])))
    best = max(saved, key=lambda s: s[2]) if saved else None
    ok = best is not None and best[2] >= SAVED_TARGET
    lines.append(f"- **Target 2** (an exit criterion that saves ≥ {SAVED_TARGET:.0%} of the steps at ≤ {TOLERANCE} "
                 f"nats above the fixed K={REF_STEPS} loss, every seed): {'met' if ok else 'missed'}. "
                 + (f"Best: {best[0]}, {best[1]}: {best[2]:.0%} of the steps saved." if best else
                    "No criterion stays within the tolerance at any threshold tried."))
    return "\n".join(lines)


def _energy_table(results: dict[str, Any]) -> str:
    rows = [[key, report.pm([e["energy_loss"]["pearson"] for e in by_seed.values()], 3),
             report.pm([e["energy_loss"]["spearman"] for e in by_seed.values()], 3),
             next(iter(by_seed.values()))["energy_loss"]["tokens"]]
            for key, by_seed in results.items() if "energy_loss" in next(iter(by_seed.values()))]
    return ("Energy as uncertainty: correlation over tokens of the final total energy (K=4) with the token's loss\n\n"
            + report.markdown_table(["model, training depth", "Pearson", "Spearman", "tokens per seed"], rows))


def _plot(ctx: ex.Context, results: dict[str, Any]) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, by_seed in results.items():
        entries = list(by_seed.values())
        ks = entries[0]["k"]
        ax.plot(ks, [_mean([e["loss"][i] for e in entries]) for i in range(len(ks))],
                "s--" if DEPTHS[entries[0]["depth"]] else "o-", label=key, markersize=3)
    ax.axvline(REF_STEPS, color="gray", linestyle=":")
    report.finish_axes(ax, "steps at inference (dotted: trained / mean training depth)", "val loss (nats/char)")
    report.save_figure(ctx, fig, "loss_vs_steps.png")
