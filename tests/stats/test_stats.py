import math

import pytest

from harness.checks import reschedule
from harness.stats import nearest_rank, percentile_or_nan
from harness.errors import ProbeError
from harness.probes.client.analysis import percentiles


def test_nearest_rank_returns_observed_values():
    values = [4.0, 1.0, 3.0, 2.0]
    assert nearest_rank(values, 50) == 2.0          # rank ceil(0.5*4)=2, not the interpolated 2.5
    assert nearest_rank(values, 75) == 3.0
    assert nearest_rank(values, 100) == 4.0 and nearest_rank(values, 0) == 1.0
    assert nearest_rank([float(i) for i in range(1, 101)], 99) == 99.0
    assert nearest_rank([1.0, 2.0], 99) == 2.0      # few samples: the tail is the worst one seen


def test_nearest_rank_ignores_nan_and_refuses_nothing_or_bad_q():
    assert nearest_rank([math.nan, 5.0, 1.0], 100) == 5.0
    with pytest.raises(ProbeError, match="no values"):
        nearest_rank([math.nan], 50)
    with pytest.raises(ProbeError, match=r"\[0, 100\]"):
        nearest_rank([1.0], 0.99 * 1000)
    assert math.isnan(percentile_or_nan([], 50))


def test_every_percentile_of_the_project_uses_the_one_definition():
    values = [10.0, 20.0, 30.0, 40.0]
    p = percentiles(values, qs=(50, 99))
    assert p["p50"] == 20.0 and p["p99"] == 40.0    # latency summaries
    assert reschedule.nearest_rank is nearest_rank   # the verdicts (and migration.py, which imports it from there)
