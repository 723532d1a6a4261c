"""The Theil-Sen slope and its distribution-free interval (harness/stats/slope.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.stats.intervals import decide, more_to_decide
from harness.stats.slope import MAX_POINTS, THEIL_SEN, binned_medians, needs_points, theil_sen


def test_an_exact_line_has_its_slope_and_a_zero_width_interval():
    s = theil_sen([0, 1, 2, 3, 4, 5, 6, 7], [1 + 3 * x for x in range(8)])
    assert s.estimate == pytest.approx(3.0)
    assert (s.interval.lo, s.interval.hi) == (pytest.approx(3.0), pytest.approx(3.0))
    assert s.interval.method == THEIL_SEN and s.interval.n == 8 and s.interval.level == 0.95


def test_a_flat_series_with_ties_is_exactly_flat():
    s = theil_sen(list(range(30)), [5.0] * 30)
    assert (s.estimate, s.interval.lo, s.interval.hi) == (0.0, 0.0, 0.0)


def test_one_outlier_does_not_tilt_it():
    y = [2.0 * x for x in range(40)]
    y[38] = 10_000.0   # a spike near the end: a least-squares line tilts towards it
    s = theil_sen(list(range(40)), y)
    assert s.estimate == pytest.approx(2.0) and s.interval.lo <= 2.0 <= s.interval.hi
    assert np.polyfit(range(40), y, 1)[0] > 5


def test_too_few_points_leave_the_interval_unbounded_and_say_how_many_would_do():
    assert needs_points() == 5
    s = theil_sen([0, 1, 2, 3], [0, 1, 1, 3])
    assert s.estimate is not None and not s.interval.bounded and s.interval.needs_n == 5
    assert theil_sen([1], [1]).estimate is None and theil_sen([2, 2, 2], [1, 2, 3]).estimate is None  # no distinct x
    assert theil_sen([0, 1, 2, 3, 4, 5], [0, 1, 2, math.nan, 4, 5]).interval.n == 5   # NaN pairs dropped


@pytest.mark.parametrize("n", [12, 40])
def test_the_95_percent_interval_covers_the_true_slope_about_95_percent_of_the_time(n):
    rng = np.random.default_rng(7)
    x = np.arange(n, dtype=float)
    covered = 0
    for _ in range(300):
        s = theil_sen(x, 0.5 * x + rng.standard_t(3, n) * 3)   # heavy tails: least squares' bad case
        covered += s.interval.lo <= 0.5 <= s.interval.hi
    assert 0.91 <= covered / 300 <= 0.99


def test_the_interval_scales_and_extrapolates_to_a_longer_series():
    rng = np.random.default_rng(3)
    x = np.arange(20, dtype=float)
    s = theil_sen(x, 10.0 * x + rng.normal(0, 20, 20))
    per_hour = s.scaled(3600)
    assert per_hour.estimate == pytest.approx(s.estimate * 3600)
    assert per_hour.interval.lo == pytest.approx(s.interval.lo * 3600)
    longer = s.interval.extrapolate(4.0)
    assert longer.hi - longer.lo == pytest.approx((s.interval.hi - s.interval.lo) / 8)   # 4 ** -1.5
    limit = s.interval.lo + (s.estimate - s.interval.lo) / 2   # inside the interval, below the estimate
    assert decide(s.interval, limit, lambda v: v <= limit) is None
    assert more_to_decide(s.interval, limit, lambda v: v <= limit) is not None


def test_binned_medians_reduce_readings_to_one_point_per_bin():
    t = [0, 1, 2, 10, 11, 35, 36, 37]
    y = [5, 6, 100, 1, 3, 7, 8, 9]
    assert binned_medians(t, y, 10) == ([1.0, 10.5, 36.0], [6.0, 2.0, 8.0])
    assert binned_medians([], [], 10) == ([], [])
    with pytest.raises(ConfigError, match="positive"):
        binned_medians(t, y, 0)


def test_bad_input_is_refused_with_a_fix():
    with pytest.raises(ConfigError, match="one y per x"):
        theil_sen([1, 2], [1])
    with pytest.raises(ConfigError, match="bin the readings"):
        theil_sen(range(MAX_POINTS + 1), range(MAX_POINTS + 1))
    with pytest.raises(ConfigError, match="confidence level"):
        theil_sen([1, 2], [1, 2], level=1.0)
