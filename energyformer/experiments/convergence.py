"""Convergence with evidence (docs/experiments.md §1): a line fitted to the validation loss over the
last :data:`WINDOW` of the steps before the learning-rate cooldown; a run is *converged* when the 95%
interval of the fitted change lies within ± :data:`~energyformer.experiments.stats.PLATEAU_REL` (1%)
of the loss (:func:`energyformer.experiments.stats.plateau_test`).
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from energyformer.experiments.stats import PLATEAU_REL, plateau_test
from energyformer.runs.rundir import METRICS_FILE, read_run_config

#: the window: this last fraction of the steps before the cooldown
WINDOW = 0.3


def val_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """``(steps, val_loss)`` of every evaluation in ``run_dir/metrics.jsonl``."""
    steps, vals = [], []
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return steps, vals
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("val_loss") is not None:
            steps.append(int(rec["step"]))
            vals.append(float(rec["val_loss"]))
    return steps, vals


def stable_end(train: Mapping[str, Any]) -> int:
    """The last step before the learning-rate cooldown (``wsd``), else the decay horizon."""
    end = int(train.get("lr_decay_steps") or train["max_steps"])
    if train.get("lr_schedule") == "wsd":
        end -= int(train.get("cooldown_steps") or 0)
    return min(end, int(train["max_steps"]))


def convergence(run_dir: Path) -> dict[str, Any]:
    """Convergence of a run with its evidence (docs/experiments.md §1): the line fitted to the
    validation loss over the last :data:`WINDOW` of the steps before the cooldown, its slope ± standard
    error (nats per 1,000 steps), the fitted drop across the window as a share of the loss with its 95%
    interval, and the verdict of :func:`energyformer.experiments.stats.plateau_test` (``"yes"``: the
    interval lies within ± :data:`PLATEAU_REL`; ``"no"``: its lower bound is a drop over it;
    ``"rising"``: its upper bound is a rise over it; ``"unclear"``: it straddles a bound). ``converged``
    is ``verdict == "yes"``; every value is ``None`` with fewer than 3 evaluations in the window."""
    train = read_run_config(run_dir).to_dict()["train"]
    end = stable_end(train)
    start = end - WINDOW * end
    steps, vals = val_curve(run_dir)
    pts = [(s, v) for s, v in zip(steps, vals) if start <= s <= end]
    out: dict[str, Any] = {"window": [int(start), end], "evals_in_window": len(pts)}
    if len(pts) < 3:
        return {**out, **dict.fromkeys(("slope_per_1k", "slope_se_per_1k", "drop", "drop_rel", "drop_rel_lo",
                                        "drop_rel_hi", "verdict", "converged"))}
    return {**out, **plateau_test([p[0] for p in pts], [p[1] for p in pts], end - start, PLATEAU_REL)}


#: how every table's "converged" column reads (docs/experiments.md §1)
CONVERGED_NOTE = ("Converged: the 95% interval of the fitted change of the val loss over the last 30% of the steps "
                  "before the cooldown lies within ±1% of the loss (yes), is a drop beyond 1% (no: still falling), "
                  "a rise beyond 1% (rising) or none of these (unclear: the interval straddles a ±1% bound); with the "
                  "slope ± its standard error per 1k steps; – with fewer than 3 evaluations in the window.")


def converged_cell(convs: Sequence[Mapping[str, Any]]) -> str:
    """The verdicts over seeds (``"yes"``, ``"no"``, ``"unclear"`` or counts such as ``"2 no, 1 unclear"``)
    with the mean slope ± its standard error (per 1k steps; the mean's error over the seeds' fits)."""
    verdicts = [c.get("verdict") for c in convs if c.get("verdict") is not None]
    if not verdicts:
        return "–"
    counts = {v: verdicts.count(v) for v in ("yes", "no", "rising", "unclear") if v in verdicts}
    word = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{n} {v}" for v, n in counts.items())
    fits = [(c["slope_per_1k"], c["slope_se_per_1k"]) for c in convs if c.get("slope_per_1k") is not None]
    slope = statistics.fmean(f[0] for f in fits)
    se = math.sqrt(sum(f[1] ** 2 for f in fits)) / len(fits)
    return f"{word} ({slope:+.3f} ± {se:.3f}/1k)"


__all__ = ["CONVERGED_NOTE", "WINDOW", "converged_cell", "convergence", "stable_end", "val_curve"]
