"""The statistics the experiment tables rest on (pure functions of numbers, no torch):

- :func:`linear_fit`: a least-squares line with the standard error of its slope;
- :func:`plateau_test`: convergence with evidence (docs/experiments.md §1): a run is *converged*
  when the 95% interval of its fitted change across the window lies within ± a share of the loss,
  *still falling* when even its lower bound is a drop over that share, *rising* when even its
  upper bound is a rise over it, and *unclear* otherwise (a noisy curve, rising or falling, is
  never called converged);
- :func:`paired_difference`: the mean of per-seed differences between two arms trained on the
  same data order (seed s gives every model the same batches) with its 95% t-interval;
- :func:`interpolate_log`: read a loss-vs-size curve at another size (linear in log size), for
  comparisons at matched parameters or FLOPs;
- :func:`matched_difference`: a model's value minus a reference family's curve read at the model's
  size, paired by seed.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: two-sided 95% quantiles of Student's t for 1 … 30 degrees of freedom (standard table values)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(dof: int) -> float:
    """The 97.5% quantile of Student's t with ``dof`` degrees of freedom (a 95% two-sided interval
    is ± this many standard errors): the table for ``dof`` ≤ 30, the Cornish–Fisher expansion
    beyond (error < 1e-3).

    Raises:
        ValueError: ``dof`` < 1.
    """
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1; got {dof}")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Ordinary least squares ``y ≈ a + b·x``.

    Returns:
        ``{"slope", "intercept", "se" (standard error of the slope; 0 for an exact fit), "dof" (n − 2),
        "mean_x", "mean_y"}``.

    Raises:
        ValueError: fewer than 3 points, lengths that differ, or all ``xs`` equal.
    """
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length ({len(xs)} vs {len(ys)})")
    n = len(xs)
    if n < 3:
        raise ValueError(f"a slope with a standard error needs at least 3 points; got {n}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x values are equal: no slope")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    rss = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(rss / (n - 2) / sxx)
    return {"slope": slope, "intercept": intercept, "se": se, "dof": n - 2, "mean_x": mx, "mean_y": my}


#: the plateau threshold: a fitted drop across the window under this share of the loss
PLATEAU_REL = 0.01


def plateau_test(steps: Sequence[float], vals: Sequence[float], width: float,
                 threshold: float = PLATEAU_REL) -> dict[str, Any]:
    """Whether a learning curve has reached its plateau, with the evidence.

    The line fitted to ``(steps, vals)`` gives the drop across a window ``width`` steps wide,
    ``drop = −slope · width``, and its 95% interval ``(−slope ∓ t·se) · width``; relative to the
    mean loss ``L`` of the window:

    - ``"yes"``: the whole interval lies within ``± threshold · L`` (flat, with 95% confidence);
    - ``"no"``: the lower bound of the drop is at least ``threshold · L`` (still falling);
    - ``"rising"``: the upper bound of the drop is at most ``−threshold · L`` (the loss rises: past its
      best, e.g. overfitting);
    - ``"unclear"``: anything else (the interval straddles a bound; never converged).

    Args:
        steps, vals: the evaluations inside the window (at least 3).
        width: the window's width in steps.
        threshold: the plateau share of the loss.

    Returns:
        ``{"slope_per_1k", "slope_se_per_1k", "drop", "drop_rel", "drop_rel_lo", "drop_rel_hi",
        "verdict", "converged"}`` (``converged`` is ``verdict == "yes"``); ``drop_rel*`` are shares of
        the loss.

    Raises:
        ValueError: as :func:`linear_fit`.
    """
    fit = linear_fit(steps, vals)
    t = t975(fit["dof"])
    level = abs(fit["mean_y"]) or 1.0
    drop, half = -fit["slope"] * width, t * fit["se"] * width
    lo, hi = (drop - half) / level, (drop + half) / level
    if -threshold < lo and hi < threshold:
        verdict = "yes"
    elif lo >= threshold:
        verdict = "no"
    elif hi <= -threshold:
        verdict = "rising"
    else:
        verdict = "unclear"
    return {"slope_per_1k": fit["slope"] * 1000, "slope_se_per_1k": fit["se"] * 1000, "drop": drop,
            "drop_rel": drop / level, "drop_rel_lo": lo, "drop_rel_hi": hi, "verdict": verdict,
            "converged": verdict == "yes"}


def paired_difference(a: Mapping[Any, float], b: Mapping[Any, float]) -> dict[str, Any]:
    """``b − a`` paired by key (seed): the mean difference and its 95% t-interval.

    Args:
        a, b: seed → value (e.g. final validation loss); only the seeds in both count.

    Returns:
        ``{"mean", "lo", "hi", "sd", "n", "seeds"}``; with one pair ``lo``/``hi``/``sd`` are ``None``
        (no interval from one pair); with none, ``mean`` is ``None`` too.
    """
    seeds = sorted(set(a) & set(b), key=str)
    diffs = [float(b[s]) - float(a[s]) for s in seeds
             if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s])]
    out: dict[str, Any] = {"n": len(diffs), "seeds": seeds, "mean": None, "lo": None, "hi": None, "sd": None}
    if not diffs:
        return out
    m = statistics.fmean(diffs)
    out["mean"] = m
    if len(diffs) > 1:
        sd = statistics.stdev(diffs)
        half = t975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
        out.update(sd=sd, lo=m - half, hi=m + half)
    return out


def format_difference(d: Mapping[str, Any], digits: int = 4) -> str:
    """``"+0.0123 [+0.0040, +0.0206] (n=3)"``; ``"+0.0123 (n=1)"``; ``"–"`` without pairs."""
    if d.get("mean") is None:
        return "–"
    s = f"{d['mean']:+.{digits}f}"
    if d.get("lo") is not None:
        s += f" [{d['lo']:+.{digits}f}, {d['hi']:+.{digits}f}]"
    return s + f" (n={d['n']})"


def interpolate_log(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """``y`` at ``x`` on the piecewise-linear curve through ``(log xs, ys)``; ``None`` outside the
    range of ``xs`` (no extrapolation).

    Raises:
        ValueError: lengths that differ, or a non-positive x.
    """
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length ({len(xs)} vs {len(ys)})")
    if x <= 0 or any(v <= 0 for v in xs):
        raise ValueError("sizes must be positive for a log scale")
    pts = sorted(zip(xs, ys))
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            if x1 == x0:
                return float(y0)
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return float(y0 + w * (y1 - y0))
    return float(pts[0][1])


def matched_difference(curves: Mapping[Any, Sequence[tuple[float, float]]],
                       points: Mapping[Any, tuple[float, float]]) -> dict[str, Any]:
    """Per seed: a model's value minus the reference family's curve (same seed) read at the model's size
    (:func:`interpolate_log`), then paired over seeds (:func:`paired_difference`).

    Args:
        curves: seed → the reference's ``(size, value)`` points over its widths; fewer than 2 points,
            or a size outside their range, gives no reading for that seed (no extrapolation).
        points: seed → the model's ``(size, value)``.

    Returns:
        :func:`paired_difference`'s dict of ``model − reference at the model's size``.
    """
    ref_at, mine = {}, {}
    for seed, (size, value) in points.items():
        curve = sorted(curves.get(seed, ()))
        if len(curve) < 2:
            continue
        at = interpolate_log([c[0] for c in curve], [c[1] for c in curve], size)
        if at is not None:
            ref_at[seed], mine[seed] = at, value
    return paired_difference(ref_at, mine)


__all__ = ["PLATEAU_REL", "format_difference", "interpolate_log", "linear_fit", "matched_difference",
           "paired_difference", "plateau_test", "t975"]
