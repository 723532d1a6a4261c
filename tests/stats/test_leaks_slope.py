"""segmented_theil_sen (harness/stats/slope.py), the fit soak.leaks judges a role's processes with
across restarts: one slope common to segments that each keep their own intercept."""

from __future__ import annotations

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.stats.slope import SEGMENTED, segmented_theil_sen, theil_sen


def test_a_restart_drop_is_no_slope_and_the_common_slope_is_found():
    """Catches a fit that lets a pair span two segments: a leak restarted to its baseline every 10
    points reads as flat (or as a sawtooth) when the segments are joined."""
    x = np.arange(10.0)
    segments = [(x + 10 * k, 100 + 2.0 * x) for k in range(4)]   # each process: from 100, +2 per step
    s = segmented_theil_sen(segments)
    assert s.estimate == pytest.approx(2.0) and s.interval.lo == pytest.approx(2.0)
    assert s.interval.method == SEGMENTED and s.interval.n == 40
    joined = theil_sen(np.concatenate([a for a, _ in segments]), np.concatenate([b for _, b in segments]))
    assert joined.estimate < 1.0     # what one line through the restarts would have said


def test_one_segment_is_theil_sen_and_single_points_add_nothing():
    """Catches a segmented fit that differs from Theil-Sen on one segment, or counts the pairs of
    a one-reading process."""
    rng = np.random.default_rng(3)
    x = np.arange(30.0)
    y = 0.5 * x + rng.normal(0, 2, 30)
    one, plain = segmented_theil_sen([(x, y)]), theil_sen(x, y)
    assert (one.estimate, one.interval.lo, one.interval.hi) == (plain.estimate, plain.interval.lo, plain.interval.hi)
    more = segmented_theil_sen([(x, y), ([100.0], [9e9])])
    assert (more.estimate, more.interval.lo, more.interval.hi) == (plain.estimate, plain.interval.lo, plain.interval.hi)


def test_the_interval_covers_the_true_slope_at_about_its_level():
    """Catches bounds from the wrong variance (one segment's, or the pooled series'): coverage far
    from 95 % over 400 simulated roles of 3 restarted processes with their own baselines."""
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(400):
        segs = []
        for _k in range(3):
            x = np.sort(rng.uniform(0, 10, 8))
            segs.append((x, rng.normal(0, 50) + 1.5 * x + rng.normal(0, 1, 8)))
        i = segmented_theil_sen(segs).interval
        hits += i.lo <= 1.5 <= i.hi
    assert 0.90 <= hits / 400 <= 0.995


def test_too_few_points_leave_the_interval_unbounded_and_bad_input_is_named():
    """Catches bounds invented from too few pairs, and mismatched inputs accepted."""
    s = segmented_theil_sen([([0.0, 1.0], [0.0, 1.0]), ([5.0, 6.0], [3.0, 4.0])])
    assert s.estimate == 1.0 and not s.interval.bounded and s.interval.needs_n is not None
    assert segmented_theil_sen([]).estimate is None
    with pytest.raises(ConfigError, match="1 y values"):
        segmented_theil_sen([([0.0, 1.0], [0.0])])


def test_wrong_fails_stay_under_their_one_sided_level_at_the_limit_and_none_on_healthy_growth():
    """The figures docs/soak.md ('Error rate') quotes for soak.leaks, outside the run's budget: with
    the true growth exactly at the limit (4x for the early fail) the lower bound lands above it at
    most 2.5 % of the time (one side of a 95 % interval), and never on healthy growth at a fourth of
    it. Catches bounds too narrow for heavy-tailed noise (a normal-theory bound, or one segment's
    variance for the pooled slopes), which fail a role whose growth is within the limit. t(3) noise
    of 10 MB on a 30 s median, 1000 simulated roles each, fixed seed."""
    rng = np.random.default_rng(1)
    hour, limit = 3600.0, 256.0

    def wrong(slope_h: float, procs: int, medians: int, over: float) -> float:
        hits = 0
        for _ in range(1000):
            x = np.arange(medians) * 30.0
            segs = [(x, 300 + rng.normal(0, 20) + slope_h / hour * x + 10 * rng.standard_t(3, medians))
                    for _ in range(procs)]
            lo = segmented_theil_sen(segs).scaled(hour).interval.lo
            hits += lo is not None and lo > over
        return hits / 1000

    assert wrong(limit, 2, 20, limit) <= 0.025            # judged at 10 minutes: 2 processes x 20 medians
    assert wrong(4 * limit, 2, 4, 4 * limit) <= 0.025     # the early fail from 8 medians
    assert wrong(limit / 4, 2, 20, limit) == 0.0
