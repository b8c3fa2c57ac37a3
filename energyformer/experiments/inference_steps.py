"""(f) ``inference_steps``: validation loss vs the number of descent steps at inference, fewer and
more than trained, for NRGPT (and with per-token early stopping ``stop_tol``) and for a
recurrent CEM (T = 2 per sub-block) (docs/nrgpt.md §6, docs/cem.md §6).

Data: Shakespeare-char. NRGPT FF2W d_model 64, 4 heads, trained with 4 steps; CEM d_model 64,
2 layers, 4 heads, trained with T = 2. 500 steps of batch 32, block 128 each. Validation loss
on 10 fixed batches at K ∈ {1, …, 2T_trained} steps (CEM: both sub-blocks of every layer run K
steps), and NRGPT with 8 steps and ``stop_tol`` ∈ {0.1, 0.01, 0.001} (mean steps taken reported).

Budget: 2 configurations × seeds runs of 500 steps plus evaluation: estimated 10–20 minutes on
2 CPU cores for 3 seeds. ``--quick``: the docstring corpus, d_model 16, 20 steps, ≈ 5 s.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from energyformer.experiments.common import Context, finish_axes, save_figure, char_data, markdown_table, pm, pyplot, train_or_resume, write_results

TOLS = (0.1, 0.01, 0.001)


def config(ctx: Context, model: dict[str, Any], seed: int) -> dict[str, Any]:
    q = ctx.quick
    shape = {"d_model": 16 if q else 64, "n_heads": 2 if q else 4, "block_size": 32 if q else 128}
    train = {"max_steps": 20 if q else 500, "batch_size": 4 if q else 32, "learning_rate": 1e-3, "min_lr": 1e-4,
             "warmup_steps": 5 if q else 50, "eval_interval": 10 if q else 250, "eval_iters": 2 if q else 10,
             "log_interval": 10, "seed": seed, "device": "cpu"}
    return {"model": {**model, **shape}, "data": char_data(ctx), "train": train}


MODELS = {"NRGPT FF2W (T=4)": {"arch": "nrgpt", "ff": "ff2w", "n_steps": 4},
          "CEM (T=2)": {"arch": "cem", "n_layers": 2, "n_steps": 2}}


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
    """Train both models per seed; validation loss at every K (and NRGPT with stop_tol)."""
    from energyformer.data import load_split
    from energyformer.eval.loss import estimate_loss
    from energyformer.runs.rundir import load_run

    results: dict[str, Any] = {}
    names = []
    for label, model_cfg in MODELS.items():
        per_seed = []
        for seed in ctx.seed_list():
            name = f"{label.split()[0].lower()}_s{seed}"
            train_or_resume(ctx, name, config(ctx, model_cfg, seed))
            names.append(name)
            model, run_cfg, _ = load_run(ctx.runs / name)
            val = load_split(run_cfg.data.path, "val")
            tc = run_cfg.train

            def loss_of(m: torch.nn.Module) -> float:
                return estimate_loss(m, {"val": val}, eval_iters=tc.eval_iters, batch_size=tc.batch_size,
                                     block_size=run_cfg.model.block_size, seed=tc.seed)["val"]

            trained = model_cfg["n_steps"]
            ks = list(range(1, 2 * trained + 1))
            entry: dict[str, Any] = {"trained_steps": trained, "k": ks, "loss": []}
            for k in ks:
                if run_cfg.model.arch == "nrgpt":
                    entry["loss"].append(loss_of(_WithKwargs(model, n_steps=k)))
                else:
                    with cem_steps(model, k):
                        entry["loss"].append(loss_of(model))
            if run_cfg.model.arch == "nrgpt":
                entry["stop_tol"] = {}
                for tol in TOLS:
                    wrapped = _WithKwargs(model, n_steps=2 * trained, stop_tol=tol)
                    entry["stop_tol"][str(tol)] = {"loss": loss_of(wrapped),
                                                   "mean_steps": sum(wrapped.steps) / len(wrapped.steps)}
            per_seed.append(entry)
        results[label] = per_seed
    rows = []
    for label, per_seed in results.items():
        for i, k in enumerate(per_seed[0]["k"]):
            mark = " (trained)" if k == per_seed[0]["trained_steps"] else ""
            rows.append([label, f"{k}{mark}", pm([s["loss"][i] for s in per_seed])])
        for tol in per_seed[0].get("stop_tol", {}):
            rows.append([label, f"≤ {2 * per_seed[0]['trained_steps']}, stop_tol {tol} (mean "
                                f"{sum(s['stop_tol'][tol]['mean_steps'] for s in per_seed) / len(per_seed):.2f} steps)",
                         pm([s["stop_tol"][tol]["loss"] for s in per_seed])])
    table = markdown_table(["model", "steps at inference", "val loss"], rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, per_seed in results.items():
        ks = per_seed[0]["k"]
        m = [sum(s["loss"][i] for s in per_seed) / len(per_seed) for i in range(len(ks))]
        line, = ax.plot(ks, m, "o-", label=label)
        ax.axvline(per_seed[0]["trained_steps"], color=line.get_color(), linestyle=":")
    finish_axes(ax, "steps at inference (dotted: trained)", "val loss (nats/char)")
    save_figure(ctx, fig, "loss_vs_steps.png")
    header = f"Validation loss vs steps at inference, {ctx.seeds} seed(s); nats per character."
    return write_results(ctx, table, {"rows": results}, names, header)
