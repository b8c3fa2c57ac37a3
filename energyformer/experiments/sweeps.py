"""Learning-rate sweeps of the experiments (docs/experiments.md §2): each LR of a grid trained with
seed 1, the lowest final validation loss chosen, the grid extended past an edge.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from energyformer.experiments import common
from energyformer.experiments.common import Context
from energyformer.experiments.report import markdown_table


def lr_sweep(ctx: Context, family: str, make_cfg: Callable[[float, int], dict[str, Any]],
             lrs: Sequence[float], steps: int, max_extend: int = 2) -> dict[str, Any]:
    """Train ``make_cfg(lr, steps)`` (seed 1) for every ``lr`` and pick the one with the lowest
    final validation loss (a diverged run loses). ``lrs`` must be fixed values, not read from another
    sweep still training: in deferred mode (``--jobs``) this sweep's runs are queued beside the
    pending runs of every other sweep. When the best is the largest or the smallest LR
    tried, the sweep extends by one more value in that direction (the grid's ratio), at most
    ``max_extend`` times, so the chosen LR is never at the edge of what was tried unless the
    extension stops improving.

    Returns:
        ``{"family", "steps" (each run's ``max_steps``), "lrs" (ascending), "final_val_loss" (per lr; inf
        when diverged), "best_lr"}``.
    """
    tried: dict[float, float] = {}
    trained = int(make_cfg(lrs[0], steps).get("train", {}).get("max_steps", steps))  # quick mode shrinks it

    def loss_at(lr: float) -> float:
        if lr not in tried:
            # a sweep's runs have their LR fixed, so they are queued even while another sweep is
            # still training (``waiting_for_sweep`` holds back only runs configured from a sweep's result)
            waiting, ctx.waiting_for_sweep = ctx.waiting_for_sweep, False
            try:
                s = common.train_or_resume(ctx, f"sweep_{family}_lr{lr:g}", make_cfg(lr, steps),
                                           require_weights=False)
            finally:
                ctx.waiting_for_sweep = waiting
            if s.get("missing"):  # --interim: an arm's LR is unknown until its check is recorded
                raise ValueError(f"--interim: LR check run sweep_{family}_lr{lr:g} in {ctx.records} is "
                                 f"{s['why']}; the tables need every arm's LR check recorded with the "
                                 "experiment's config (train the experiment until its LR checks are in)")
            if s.get("pending"):
                tried[lr] = math.nan
                return math.nan
            v = math.inf if s.get("diverged") else float(s["final_val_loss"])
            tried[lr] = v if math.isfinite(v) else math.inf
        return tried[lr]

    for lr in lrs:
        loss_at(lr)
    if any(math.isnan(v) for v in tried.values()):  # deferred: queued; the caller stops at need_runs
        ctx.waiting_for_sweep = True
        return {"family": family, "steps": trained, "lrs": sorted(tried), "final_val_loss": [], "best_lr": lrs[0],
                "pending": True}
    for _ in range(max_extend if len(lrs) > 1 else 0):
        grid = sorted(tried)
        best = min(grid, key=lambda lr: tried[lr])
        if best == grid[-1]:
            extra = loss_at(half_decade(best, up=True))
        elif best == grid[0]:
            extra = loss_at(half_decade(best, up=False))
        else:
            break
        if math.isnan(extra):
            ctx.waiting_for_sweep = True
            tried.pop(half_decade(best, up=best == grid[-1]))
            return {"family": family, "steps": trained, "lrs": sorted(tried), "final_val_loss": [],
                    "best_lr": best, "pending": True}
    grid = sorted(tried)
    best = min(grid, key=lambda lr: tried[lr])
    ctx.say_once(f"  LR sweep {family}: " + ", ".join(f"{lr:g} → {tried[lr]:.4f}" for lr in grid) + f"; using {best:g}")
    return {"family": family, "steps": trained, "lrs": grid, "final_val_loss": [tried[lr] for lr in grid],
            "best_lr": best}


def half_decade(lr: float, up: bool) -> float:
    """The next value of the 1-3-10 grid above (or below) ``lr``: 3e-3 → 1e-2, 1e-3 → 3e-4."""
    exp = math.floor(math.log10(lr) + 1e-9)
    steps = [(1, exp), (3, exp), (1, exp + 1)] if up else [(3, exp - 1), (1, exp), (3, exp)]
    cands = [m * 10.0 ** e for m, e in steps]
    pick = [c for c in cands if (c > lr * 1.05 if up else c < lr / 1.05)]
    value = min(pick) if up else max(pick)
    return float(f"{value:.3g}")


def sweep_table(sweeps: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per family, one column per LR (final val loss), the chosen LR."""
    rows = []
    for s in sweeps:
        cells = [("diverged" if not math.isfinite(v) else f"{v:.4f}") for v in s["final_val_loss"]]
        rows.append([s["family"], s["steps"], " / ".join(f"{lr:g}" for lr in s["lrs"]), " / ".join(cells),
                     f"{s['best_lr']:g}"])
    return markdown_table(["family", "sweep steps", "learning rates", "final val loss", "chosen"], rows)


__all__ = ["half_decade", "lr_sweep", "sweep_table"]
