"""(e) ``energy_descent``: per-token energy per step of a trained NRGPT with ``η = c·diag(γ)``
(provable descent, docs/nrgpt.md §5) and with the free ``η`` (a full d×d map): the fraction of
tokens whose total energy is monotone non-increasing from step ``s`` on, and plots.

Data: Shakespeare-char. Model: NRGPT FF2W, d_model 64, 4 heads, 4 steps, block 128, 500 steps
of batch 32. Traced on 8 validation sequences of 128 characters, with the trained 4 steps and
with 8 steps (inference-time scaling).

Budget: 2 configurations × seeds runs of 500 steps plus tracing: estimated 10–15 minutes on 2
CPU cores for 3 seeds. ``--quick``: the docstring corpus, d_model 16, 20 steps, ≈ 5 s.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from energyformer.experiments.common import Context, finish_axes, save_figure, char_data, markdown_table, pm, pyplot, train_or_resume, write_results

ETAS = {"η = c·diag(γ)": "c_diag_gamma", "free η (full)": "full"}


def config(ctx: Context, eta: str, seed: int) -> dict[str, Any]:
    q = ctx.quick
    model = {"arch": "nrgpt", "ff": "ff2w", "d_model": 16 if q else 64, "n_heads": 2 if q else 4, "n_steps": 4,
             "block_size": 32 if q else 128, "eta_param": eta}
    train = {"max_steps": 20 if q else 500, "batch_size": 4 if q else 32, "learning_rate": 1e-3, "min_lr": 1e-4,
             "warmup_steps": 5 if q else 50, "eval_interval": 10 if q else 250, "eval_iters": 2 if q else 10,
             "log_interval": 10, "seed": seed, "device": "cpu"}
    return {"model": model, "data": char_data(ctx), "train": train}


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


def run(ctx: Context) -> dict[str, Any]:
    """Train both η parameterizations per seed, trace validation text, tabulate monotone fractions."""
    from energyformer.data import load_split
    from energyformer.runs.rundir import load_run

    results: dict[str, Any] = {}
    rows, names, curves = [], [], {}
    for label, eta in ETAS.items():
        per_seed = []
        for seed in ctx.seed_list():
            name = f"nrgpt_{eta}_s{seed}"
            cfg = config(ctx, eta, seed)
            train_or_resume(ctx, name, cfg)
            names.append(name)
            model, run_cfg, _ = load_run(ctx.runs / name)
            val = np.asarray(load_split(run_cfg.data.path, "val"), dtype=np.int64)
            N = run_cfg.model.block_size
            n_seq = min(8, len(val) // N)
            batch = torch.from_numpy(val[: n_seq * N].reshape(n_seq, N))
            entry = {}
            for steps in (4, 8):
                e = trace_energies(model, batch, steps)
                entry[steps] = {"monotone_from": monotone_fraction(e), "mean_energy": e.mean((1, 2)).tolist()}
            per_seed.append(entry)
            curves.setdefault(label, e[:, 0, : min(16, N)].numpy())
        results[label] = per_seed
        for steps in (4, 8):
            fr = [[s[steps]["monotone_from"][k] for s in per_seed] for k in range(steps)]
            rows.append([label, steps] + [pm(f, 3) for f in (fr[0], fr[min(1, steps - 1)], fr[steps // 2])])
    table = markdown_table(["η", "steps at inference", "monotone from step 0", "from step 1", "from step S/2"], rows)

    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (label, e) in zip(axes.flat, curves.items()):
        for j in range(e.shape[1]):
            ax.plot(range(e.shape[0]), e[:, j], alpha=0.7, linewidth=1)
        ax.axvline(4, color="gray", linestyle=":")
        ax.set_title(f"{label}: total energy per token (8 steps; trained 4)", fontsize=9)
        finish_axes(ax, "step")
    save_figure(ctx, fig, "energy_per_token.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, per_seed in results.items():
        m = np.mean([s[8]["monotone_from"] for s in per_seed], axis=0)
        ax.plot(range(len(m)), m, "o-", label=label)
    ax.set_ylim(-0.02, 1.02)
    finish_axes(ax, "s (monotone from step s on, 8 steps)", "fraction of tokens")
    save_figure(ctx, fig, "monotone_fraction.png")
    header = (f"Energy descent of NRGPT per token (total energy E_AT + s_ff E_FF), {ctx.seeds} seed(s): fraction of "
              "tokens whose energy never rises after step s.")
    return write_results(ctx, table, {"rows": {k: [{str(s): v for s, v in e.items()} for e in vals]
                                               for k, vals in results.items()}}, names, header)
