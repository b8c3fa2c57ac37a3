"""The statistics behind the experiment tables: slope errors, the plateau test, paired intervals and
reading a curve at a matched size (energyformer.experiments.stats), against closed forms and numpy."""
import math
import random

import numpy as np
import pytest

from energyformer.experiments.stats import (
    format_difference,
    interpolate_log,
    linear_fit,
    paired_difference,
    plateau_test,
    t975,
)


def test_t975_matches_the_table_and_the_normal_limit():
    assert t975(1) == pytest.approx(12.706) and t975(2) == pytest.approx(4.303) and t975(10) == pytest.approx(2.228)
    assert t975(30) == pytest.approx(2.042) and t975(40) == pytest.approx(2.021, abs=1e-3)  # table value 2.021
    assert t975(120) == pytest.approx(1.980, abs=1e-3) and t975(10 ** 6) == pytest.approx(1.95996, abs=1e-4)
    vals = [t975(k) for k in range(1, 200)]
    assert all(a > b for a, b in zip(vals, vals[1:]))  # decreasing towards the normal quantile
    with pytest.raises(ValueError, match="degrees of freedom must be >= 1; got 0"):
        t975(0)


def test_linear_fit_agrees_with_numpy_and_its_standard_error():
    rng = np.random.default_rng(0)
    xs = np.arange(20.0)
    ys = 3.0 - 0.1 * xs + rng.normal(0, 0.05, size=20)
    fit = linear_fit(list(xs), list(ys))
    slope, intercept = np.polyfit(xs, ys, 1)
    resid = ys - (intercept + slope * xs)
    se = math.sqrt((resid ** 2).sum() / 18 / ((xs - xs.mean()) ** 2).sum())
    assert fit["slope"] == pytest.approx(slope) and fit["intercept"] == pytest.approx(intercept)
    assert fit["se"] == pytest.approx(se) and fit["dof"] == 18
    with pytest.raises(ValueError, match="at least 3 points; got 2"):
        linear_fit([1, 2], [1, 2])
    with pytest.raises(ValueError, match="all x values are equal"):
        linear_fit([1, 1, 1], [1, 2, 3])


def test_plateau_test_interval_covers_the_true_slope_about_95_percent_of_the_time():
    """The interval is a real 95% interval: over many noisy lines, the true drop lies inside ≈ 95%."""
    rng = random.Random(1)
    xs = list(range(0, 1300, 100))
    inside = 0
    for _ in range(2000):
        ys = [2.0 - 1e-5 * x + rng.gauss(0, 0.01) for x in xs]
        r = plateau_test(xs, ys, width=1200)
        level = sum(ys) / len(ys)
        true = 1e-5 * 1200 / level
        inside += r["drop_rel_lo"] <= true <= r["drop_rel_hi"]
    assert 0.93 < inside / 2000 < 0.97


def test_plateau_test_verdicts():
    xs = list(range(0, 1300, 100))
    assert plateau_test(xs, [2.0 - 1e-4 * x for x in xs], 1200)["verdict"] == "no"  # 6% drop, exact line
    assert plateau_test(xs, [2.0 + 1e-7 * ((-1) ** i) for i, x in enumerate(xs)], 1200)["verdict"] == "yes"
    noisy = [2.0 + 0.05 * ((-1) ** i) + 1e-5 * x for i, x in enumerate(xs)]  # rising, very noisy
    r = plateau_test(xs, noisy, 1200)
    assert r["slope_per_1k"] > 0 and r["verdict"] == "unclear" and not r["converged"]
    # rising a little (0.6% across the window) but so noisy that a 1% rise cannot be excluded: not flat
    wobbly = [2.0 + 1e-5 * x + 0.02 * ((-1) ** i) for i, x in enumerate(xs)]
    r = plateau_test(xs, wobbly, 1200)
    assert r["drop_rel"] < 0 and r["drop_rel_lo"] < -0.01 and r["verdict"] == "unclear"
    assert plateau_test(xs, [2.0 + 1e-4 * x for x in xs], 1200)["verdict"] == "rising"


def test_paired_difference_and_its_interval():
    a, b = {1: 1.50, 2: 1.52, 3: 1.49}, {1: 1.45, 2: 1.48, 3: 1.46, 4: 9.0}  # seed 4 has no pair
    d = paired_difference(a, b)
    diffs = [-0.05, -0.04, -0.03]
    sd = float(np.std(diffs, ddof=1))
    assert d["n"] == 3 and d["seeds"] == [1, 2, 3] and d["mean"] == pytest.approx(-0.04)
    assert d["lo"] == pytest.approx(-0.04 - 4.303 * sd / math.sqrt(3))
    assert d["hi"] == pytest.approx(-0.04 + 4.303 * sd / math.sqrt(3))
    assert format_difference(d) == f"-0.0400 [{d['lo']:+.4f}, {d['hi']:+.4f}] (n=3)"
    one = paired_difference({1: 1.0}, {1: 1.25})
    assert one["mean"] == pytest.approx(0.25) and one["lo"] is None and format_difference(one) == "+0.2500 (n=1)"
    assert format_difference(paired_difference({1: 1.0}, {2: 1.0})) == "–"


def test_interpolate_log_reads_between_sizes_and_never_extrapolates():
    xs, ys = [1e5, 1e6, 1e7], [2.0, 1.5, 1.2]
    assert interpolate_log(xs, ys, 1e6) == pytest.approx(1.5)
    assert interpolate_log(xs, ys, math.sqrt(1e5 * 1e6)) == pytest.approx(1.75)  # halfway in log size
    assert interpolate_log(list(reversed(xs)), list(reversed(ys)), 3e6) == pytest.approx(1.5 - 0.3 * math.log10(3))
    assert interpolate_log(xs, ys, 5e4) is None and interpolate_log(xs, ys, 2e7) is None
    with pytest.raises(ValueError, match="positive"):
        interpolate_log(xs, ys, 0)
