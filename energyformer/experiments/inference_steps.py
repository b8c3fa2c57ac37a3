"""(f) ``inference_steps``: validation loss vs the number of descent steps at inference, fewer and
more than trained, for NRGPT (and with per-token early stopping ``stop_tol``) and for a
recurrent CEM (T = 2 per sub-block) (docs/nrgpt.md §6, docs/cem.md §6), on the trained models
of two other experiments (reused, or trained first if they are not recorded yet):

- NRGPT FF2W, free η, trained with 4 steps: ``energy_descent``'s ``nrgpt_full_s<seed>``;
- NRGPT FF2W, η = c·diag(γ) (the arm with the descent guarantee, docs/nrgpt.md §4), 4 steps:
  ``energy_descent``'s ``nrgpt_c_diag_gamma_s<seed>``;
- CEM T = 2 (d_model 128, 4 layers): ``cem_ablation``'s ``cem_T_2_s<seed>``.

Validation loss on one fixed, seeded set of 40 batches (163,840 characters; the same windows for
every model, seed and K: :data:`EVAL_SEED`) at K ∈ {1, …, 2T_trained} steps (CEM: both sub-blocks of
every layer run K steps), and NRGPT with 8 steps and ``stop_tol`` ∈ {0.1, 0.01, 0.001} (mean steps
taken reported). Seeds: 2 (those of the source experiments).

The table gives, beside each loss (mean ± SD over seeds), its difference from the same model's loss
at its trained step count, paired by seed with its 95% t-interval, whether the trained model met
the plateau rule of its source experiment (its "converged" cell), and the unigram and bigram
count-model floors of the corpus.

Budget: evaluation only (minutes) once the source runs exist. ``--quick``: the quick runs of both.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from energyformer.experiments.common import Context
from energyformer.experiments.convergence import CONVERGED_NOTE, converged_cell, convergence
from energyformer.experiments.report import (
    corpus_floors,
    finish_axes,
    floors_table,
    markdown_table,
    pm,
    pyplot,
    save_figure,
    write_results,
)
from energyformer.experiments.stats import format_difference, paired_difference
from energyformer.models.registry import get_spec

TOLS = (0.1, 0.01, 0.001)
#: the fixed evaluation windows: EVAL_BATCHES batches of the runs' batch size drawn with EVAL_SEED,
#: the same for every model, seed and step count (40 × 32 × 128 = 163,840 validation characters)
EVAL_SEED, EVAL_BATCHES = 0, 40
DEFAULT_SEEDS = 2


#: row label -> (source experiment, its arm: energy_descent's η or cem_ablation's row, steps trained)
MODELS = {"NRGPT FF2W free η (T=4)": ("energy_descent", "full", 4),
          "NRGPT FF2W η = c·diag(γ) (T=4)": ("energy_descent", "c_diag_gamma", 4),
          "CEM (T=2)": ("cem_ablation", "cem T=2", 2)}


def source_run(ctx: Context, label: str, seed: int):
    """The trained run of ``label`` from its source experiment (trained there if missing)."""
    from energyformer.experiments import cem_ablation, energy_descent

    experiment, arm, _ = MODELS[label]
    other = Context(name=experiment, seeds=ctx.seeds, quick=ctx.quick, results_dir=ctx.results_dir,
                    work_dir=ctx.work_dir, data_root=ctx.data_root, verbose=ctx.verbose, profile=ctx.profile)
    source = energy_descent if experiment == "energy_descent" else cem_ablation
    return source.trained_run(other, arm, seed)


@contextlib.contextmanager
def cem_steps(model: torch.nn.Module, k: int) -> Iterator[None]:
    """Run every CEM sub-block of ``model`` with ``k`` steps inside the ``with`` body (same η)."""
    subs = [m for m in model.modules() if hasattr(m, "n_steps") and hasattr(m, "_descend")]
    old = [m.n_steps for m in subs]
    if any(m.step_scales is not None for m in subs):
        raise ValueError("per_step_scale models have one factor per trained step; cannot change n_steps")
    for m in subs:
        m.n_steps = k
    try:
        yield
    finally:
        for m, n in zip(subs, old):
            m.n_steps = n


class _WithKwargs(torch.nn.Module):
    """``model(x, y, **kwargs)`` as a module (what ``estimate_loss`` calls); records NRGPT's steps taken."""

    def __init__(self, model: torch.nn.Module, **kwargs: Any):
        super().__init__()
        self.model, self.kwargs, self.steps = model, kwargs, []

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        if "stop_tol" in self.kwargs:
            with self.model.trace() as trace:
                out = self.model(x, y, **self.kwargs)
            self.steps.append(float(trace.steps_taken.double().mean()))
            return out
        return self.model(x, y, **self.kwargs)


def run(ctx: Context) -> dict[str, Any]:
    """For each model and seed (trained first if not recorded): validation loss at every K, and for
    NRGPT with ``stop_tol``."""
    from energyformer.data import load_split
    from energyformer.eval.loss import estimate_loss
    from energyformer.runs.rundir import load_run

    results: dict[str, Any] = {}
    names = []
    floors: dict[str, dict[str, float]] = {}  # corpus path -> floors (one corpus unless --quick)
    for label, (_, _, trained) in MODELS.items():
        per_seed = []
        for seed in ctx.seed_list(DEFAULT_SEEDS):
            where = source_run(ctx, label, seed)
            names.append(str(where))
            model, run_cfg, _ = load_run(where)
            val = load_split(run_cfg.data.path, "val")
            if str(run_cfg.data.path) not in floors:
                floors[str(run_cfg.data.path)] = corpus_floors(run_cfg.data.path)
            tc = run_cfg.train

            def loss_of(m: torch.nn.Module, val=val, tc=tc, run_cfg=run_cfg) -> float:
                # one fixed, seeded set of windows for every model and seed (not the run's own seed)
                return estimate_loss(m, {"val": val}, eval_iters=2 if ctx.quick else EVAL_BATCHES,
                                     batch_size=tc.batch_size, block_size=run_cfg.model.block_size,
                                     seed=EVAL_SEED)["val"]

            ks = list(range(1, 2 * trained + 1))
            entry: dict[str, Any] = {"seed": seed, "trained_steps": trained, "k": ks, "loss": [],
                                     "convergence": convergence(where)}
            early_stops = get_spec(run_cfg.model.arch).takes("stop_tol")  # NRGPT: per-token early stopping
            for k in ks:
                if early_stops:
                    entry["loss"].append(loss_of(_WithKwargs(model, n_steps=k)))
                else:
                    with cem_steps(model, k):
                        entry["loss"].append(loss_of(model))
            if early_stops:
                entry["stop_tol"] = {}
                for tol in TOLS:
                    wrapped = _WithKwargs(model, n_steps=2 * trained, stop_tol=tol)
                    entry["stop_tol"][str(tol)] = {"loss": loss_of(wrapped),
                                                   "mean_steps": sum(wrapped.steps) / len(wrapped.steps)}
            per_seed.append(entry)
        results[label] = per_seed
    rows = []
    for label, per_seed in results.items():
        conv = converged_cell([s["convergence"] for s in per_seed])
        trained = per_seed[0]["trained_steps"]
        ref = {s["seed"]: s["loss"][s["k"].index(trained)] for s in per_seed}

        def delta(losses: list[float], ref=ref, per_seed=per_seed) -> str:
            # each seed's loss minus the same model's loss at its trained step count, paired by seed
            return format_difference(paired_difference(ref, {s["seed"]: v for s, v in zip(per_seed, losses)}))

        for i, k in enumerate(per_seed[0]["k"]):
            losses = [s["loss"][i] for s in per_seed]
            rows.append([label, f"{k} (trained)" if k == trained else str(k), pm(losses),
                         "0 (reference)" if k == trained else delta(losses), conv])
        for tol in per_seed[0].get("stop_tol", {}):
            losses = [s["stop_tol"][tol]["loss"] for s in per_seed]
            rows.append([label, f"≤ {2 * trained}, stop_tol {tol} (mean "
                                f"{sum(s['stop_tol'][tol]['mean_steps'] for s in per_seed) / len(per_seed):.2f} steps)",
                         pm(losses), delta(losses), conv])
    table = markdown_table(["model", "steps at inference", "val loss (mean ± SD over seeds)",
                            "Δ vs the trained steps (paired by seed, 95% interval)", "trained model converged"], rows)
    # every source trains on the same corpus (--quick: the same text, prepared once per source)
    for f in dict.fromkeys(tuple(f.items()) for f in floors.values()):
        table += "\n\n" + floors_table(dict(f), "val loss (nats/char)")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, per_seed in results.items():
        ks = per_seed[0]["k"]
        m = [sum(s["loss"][i] for s in per_seed) / len(per_seed) for i in range(len(ks))]
        line, = ax.plot(ks, m, "o-", label=label)
        ax.axvline(per_seed[0]["trained_steps"], color=line.get_color(), linestyle=":")
    finish_axes(ax, "steps at inference (dotted: trained)", "val loss (nats/char)")
    save_figure(ctx, fig, "loss_vs_steps.png")
    header = (f"Validation loss vs steps at inference, {len(ctx.seed_list(DEFAULT_SEEDS))} seed(s); "
              f"nats per character on one fixed set of {EVAL_BATCHES} validation batches (seed {EVAL_SEED}, the same "
              "windows for every model, seed and step count); "
              "models from energy_descent (NRGPT) and cem_ablation (CEM T=2). Trained model " + CONVERGED_NOTE)
    return write_results(ctx, table, {"rows": results, "sources": names, "floors": floors}, header)
