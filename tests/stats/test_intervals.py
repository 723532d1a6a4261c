"""Each interval method covers at its stated level on samples from known distributions.

1000 seeded trials per case. If a method truly covers at least 95 %, the share of 1000 trials
that cover is at least 0.95 - 3 * sqrt(0.95 * 0.05 / 1000) = 0.929 with probability > 99.8 %:
COVERAGE_TOLERANCE is that binomial allowance (3 standard deviations). The seeds make every run
of these tests the same, so they never flake; the tolerance is what a change of seed may cost.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from harness.stats.intervals import (BOOTSTRAP_MIN_N, LEVEL, Interval, across, bootstrap_interval,
                                   clopper_pearson_lower, decide, mean, measured_within, min_samples,
                                   more_to_decide, order_statistic_ranks, percentile_interval,
                                   ratio_input_level, ratio_interval, ratio_of_medians)
from harness.errors import ConfigError

TRIALS = 1000
COVERAGE_TOLERANCE = 3 * math.sqrt(LEVEL * (1 - LEVEL) / TRIALS)   # 0.0207


def _covers(interval: Interval, truth: float) -> bool:
    lo = -math.inf if interval.lo is None else interval.lo
    hi = math.inf if interval.hi is None else interval.hi
    return lo <= truth <= hi


# (name, draw(rng, n), true q-th quantile)
DISTRIBUTIONS = {
    "exponential": (lambda rng, n: rng.exponential(1.0, n), lambda p: -math.log(1 - p)),
    "lognormal": (lambda rng, n: rng.lognormal(0.0, 1.0, n), lambda p: math.exp(NormalDist().inv_cdf(p))),
}


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("n, q", [(50, 50), (400, 50), (50, 99), (400, 99)])
def test_order_statistic_interval_covers_the_true_percentile(dist, n, q):
    draw, quantile = DISTRIBUTIONS[dist]
    truth = quantile(q / 100)
    rng = np.random.default_rng(1000 * n + q)
    intervals = [percentile_interval(draw(rng, n).tolist(), q) for _ in range(TRIALS)]
    coverage = sum(_covers(i, truth) for i in intervals) / TRIALS
    assert coverage >= LEVEL - COVERAGE_TOLERANCE, coverage
    if q == 99 and n == 50:   # a p99 of 50 samples is not a p99: no upper bound, and it says how many
        assert all(i.hi is None and i.lo is not None and i.needs_n == 368 for i in intervals)
        return
    assert all(i.bounded for i in intervals)
    # not absurdly wide: the median width stays within the spread of true quantiles that a sample of
    # n can tell apart (p +- 4 binomial standard deviations of the rank fraction)
    sd = math.sqrt(q / 100 * (1 - q / 100) / n)
    spread = quantile(min(q / 100 + 4 * sd, 0.9999)) - quantile(max(q / 100 - 4 * sd, 1e-4))
    assert float(np.median([i.hi - i.lo for i in intervals])) < spread


def test_order_statistic_ranks_and_minimum_counts():
    assert min_samples(99) == (1, 368) and min_samples(50) == (6, 6) and min_samples(95) == (2, 72)
    assert min_samples(100) == (1, None)           # nothing observed bounds a maximum from above
    assert order_statistic_ranks(367, 99)[1] is None and order_statistic_ranks(368, 99) == (360, 368)
    assert order_statistic_ranks(5, 50) == (None, None) and order_statistic_ranks(6, 50) == (1, 6)
    assert order_statistic_ranks(8, 100) == (8, None)
    with pytest.raises(ConfigError, match="percentile"):
        order_statistic_ranks(10, 101)


def _lognormal_pair(rng, n):
    # a: median 2, b: median 1 -> the true ratio of medians is 2
    return rng.lognormal(math.log(2.0), 1.0, n), rng.lognormal(0.0, 0.5, n)


@pytest.mark.parametrize("n", [BOOTSTRAP_MIN_N, 50])
def test_bootstrap_ratio_of_medians_covers_on_lognormal_samples(n):
    rng = np.random.default_rng(n)
    intervals = []
    for trial in range(TRIALS):
        a, b = _lognormal_pair(rng, n)
        intervals.append(bootstrap_interval(ratio_of_medians, a.tolist(), b.tolist(), seed=trial))
    coverage = sum(_covers(i, 2.0) for i in intervals) / TRIALS
    assert coverage >= LEVEL - COVERAGE_TOLERANCE, coverage
    widths = [i.hi - i.lo for i in intervals]
    assert float(np.median(widths)) < (6.0 if n == BOOTSTRAP_MIN_N else 2.0)   # measured 4.2 and 1.6


def test_bootstrap_mean_covers_on_mildly_skewed_samples():
    """The mean is offered for mild skew at n >= 50 (docs/statistics.md: heavy skew undercovers)."""
    rng = np.random.default_rng(5)
    truth = math.exp(0.25 ** 2 / 2)
    intervals = [bootstrap_interval(mean, rng.lognormal(0.0, 0.25, 50).tolist(), seed=t) for t in range(TRIALS)]
    assert sum(_covers(i, truth) for i in intervals) / TRIALS >= LEVEL - COVERAGE_TOLERANCE
    assert float(np.median([i.hi - i.lo for i in intervals])) < 0.25


def test_bootstrap_is_deterministic_and_refuses_tiny_windows():
    a, b = [1.0, 1.1, 0.9, 1.05, 1.2, 0.95, 1.0, 1.02, 0.99], [2.0, 2.1, 1.9, 2.05, 2.2, 1.95, 2.0, 2.02]
    first = bootstrap_interval(ratio_of_medians, a, b)
    assert first == bootstrap_interval(ratio_of_medians, a, b) and first.bounded
    assert first.lo <= 0.5 <= first.hi and (first.n, first.n2) == (9, 8)
    tiny = bootstrap_interval(ratio_of_medians, a[:3], b)
    assert tiny.lo is None and tiny.hi is None and tiny.needs_n == BOOTSTRAP_MIN_N


def test_ratio_of_two_percentile_intervals_covers_the_ratio_of_true_percentiles():
    """TCP round trips during vs before: p99 of each window at ratio_input_level, then the ratio."""
    rng = np.random.default_rng(11)
    inner = ratio_input_level()
    truth = 1.25   # during = 1.25 x before, same shape: the ratio of p99s is 1.25
    covered, widths = 0, []
    for _ in range(TRIALS):
        before = rng.exponential(1.0, 600)
        during = 1.25 * rng.exponential(1.0, 600)
        r = ratio_interval(percentile_interval(during.tolist(), 99, inner), percentile_interval(before.tolist(), 99, inner))
        assert r.bounded and r.level == pytest.approx(LEVEL)
        covered += _covers(r, truth)
        widths.append(r.hi - r.lo)
    assert covered / TRIALS >= LEVEL - COVERAGE_TOLERANCE   # measured 1.000: conservative by construction
    assert float(np.median(widths)) < 1.5 * truth           # measured 1.47 (0.71-2.17): a p99 of 600 is loose


def test_clopper_pearson_lower_bound_covers_the_true_proportion():
    rng = np.random.default_rng(3)
    for n, p in ((6, 0.9), (20, 0.97)):
        bounds = [clopper_pearson_lower(int(k), n) for k in rng.binomial(n, p, TRIALS)]
        assert sum(b <= p for b in bounds) / TRIALS >= LEVEL - COVERAGE_TOLERANCE
    assert clopper_pearson_lower(6, 6) == pytest.approx(0.05 ** (1 / 6), abs=1e-9)   # 0.607
    assert clopper_pearson_lower(0, 5) == 0.0


def _holds_below(limit):
    return lambda x: x < limit


def test_decide_needs_the_whole_interval_and_a_missing_bound_on_the_failing_side_never_passes():
    """Catches a pass without the bound whose level is the wrong-pass chance (no upper bound below
    a limit) and, since one-sided levels (issue 33), a pass refused only because the other bound,
    at its stricter wrong-fail level, needs more samples than the pass does."""
    below = _holds_below(500)
    assert decide(Interval(450, 490, LEVEL, "m", 10), 500, below) == "pass"
    assert decide(Interval(510, 560, LEVEL, "m", 10), 500, below) == "fail"
    assert decide(Interval(500, 560, LEVEL, "m", 10), 500, below) == "fail"    # < 500: 500 itself misses
    assert decide(Interval(480, 560, LEVEL, "m", 10), 500, below) is None
    assert decide(Interval(300, None, LEVEL, "m", 10), 500, below) is None     # no upper bound: never passes
    assert decide(Interval(600, None, LEVEL, "m", 10), 500, below) == "fail"   # ... but may fail
    assert decide(Interval(None, 100, LEVEL, "m", 10), 500, below) == "pass"   # the upper bound alone decides it
    assert decide(Interval(None, 600, LEVEL, "m", 10), 500, below) is None
    assert decide(Interval(None, 900, LEVEL, "m", 10), 500, lambda x: x >= 500) is None   # no lower bound above


def test_more_to_decide_assumes_the_observed_distribution_holds():
    rng = np.random.default_rng(2)
    values = rng.exponential(100.0, 200).tolist()   # true p99 = 460
    p99 = percentile_interval(values, 99, noun="requests")
    assert p99.hi is None
    more = more_to_decide(p99, 2000.0, _holds_below(2000.0))
    assert more is not None and 168 <= more <= 400      # at least up to 368, where the upper bound exists
    assert decide(p99.extrapolate((200 + more) / 200), 2000.0, _holds_below(2000.0)) == "pass"
    # a threshold right at the observed p99: the interval closes in on it from both sides, never decides
    point = sorted(values)[math.ceil(0.99 * 200) - 1]
    assert more_to_decide(p99, point, _holds_below(point)) is None
    assert more_to_decide(measured_within(1.0, below=0.1, above=0.1), 1.05, _holds_below(1.05)) is None


def test_resolution_bounds_and_their_percentile():
    faults = [measured_within(v, below=0.05, above=0.01, noun="faults") for v in (0.8, 1.2, 2.99)]
    p100 = across(faults, 100, noun="faults")
    assert (p100.lo, p100.hi, p100.level, p100.n) == (pytest.approx(2.94), pytest.approx(3.0), 1.0, 3)
    assert p100.brackets() == "[2.94-3, bounds]"
    with pytest.raises(ConfigError):
        measured_within(1.0, below=-1, above=0)


def test_interval_text_and_json():
    i = Interval(480.0, 560.0, 0.95, "order statistics", 412, noun="requests")
    assert i.describe("ms") == "480-560 ms (95 %, order statistics, n=412)"
    assert i.brackets() == "[480-560, 95 %]"
    assert i.to_dict()["n"] == 412 and "extrapolate" not in i.to_dict()
    assert i.scaled(0.5).span() == "240-280"
    with pytest.raises(ConfigError, match="above its upper bound"):
        Interval(2.0, 1.0, 0.95, "m", 3)


def test_an_interval_from_an_old_results_json_reads_its_levels_as_symmetric():
    """A results.json written before issue 33 (tests/report/data/real_run_results.json: no
    alpha_lo / alpha_hi) reads back as (1 - level) / 2 on each side and renders as before, and a
    new one keeps its one-sided levels through a JSON round trip. Catches from_dict requiring the
    new keys (old reports no longer open) and to_dict dropping them (new ones read as symmetric)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[1] / "report/data/real_run_results.json").read_text())
    old = next(v["interval"] for v in data["verdicts"] if v.get("interval"))
    assert "alpha_lo" not in old and "alpha_hi" not in old
    iv = Interval.from_dict(old)
    assert iv.miss_lo == pytest.approx(0.025) and iv.miss_hi == pytest.approx(0.025) and iv.symmetric
    assert iv.brackets().endswith(", 95 %]") and iv.to_dict()["alpha_lo"] == pytest.approx(0.025)
    new = percentile_interval(list(range(1, 601)), 99, alpha_lo=0.000125, alpha_hi=0.025 / 6)
    back = Interval.from_dict(json.loads(json.dumps(new.to_dict())))
    assert (back.miss_lo, back.miss_hi) == (0.000125, 0.025 / 6) and back.brackets() == new.brackets()
    assert back.brackets().endswith("99.9875/99.5833 %]")


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "=="])
def test_a_verdict_needs_the_bound_computed_at_its_own_sides_level(op):
    """Soundness of one-sided levels (harness/stats/levels.py): the bound levels.one_sided puts at
    the wrong-fail alpha is the only one that can make decide() fail, the one at the wrong-pass
    alpha the only one that can make it pass. With that bound missing (too few samples for its
    level) no threshold and no value of the other bound gives that decision. Catches decide()
    passing on the fail-side bound alone (a pass at the stricter level's bound, its wrong-pass
    chance then unbounded) and one_sided orienting a threshold's bounds the wrong way round."""
    from harness.checklists.models import COMPARISONS
    from harness.stats import levels

    holds_op = COMPARISONS[op]
    fail_lo = levels.one_sided(op, 0.001, 0.02)[0] == 0.001   # is the lower bound the fail-side one?
    values = [-5.0, 0.0, 1.0, 2.0, 5.0]
    for t in (0.0, 1.0, 2.0):
        holds = lambda x, t=t: holds_op(x, t)  # noqa: E731
        for v in values:
            for w in values:
                lo, hi = min(v, w), max(v, w)
                fail_side_missing = Interval(None, hi, LEVEL, "m", 10) if fail_lo else Interval(lo, None, LEVEL, "m", 10)
                pass_side_missing = Interval(lo, None, LEVEL, "m", 10) if fail_lo else Interval(None, hi, LEVEL, "m", 10)
                if op != "==":
                    assert decide(fail_side_missing, t, holds) != "fail", (op, t, lo, hi)
                    assert decide(pass_side_missing, t, holds) != "pass", (op, t, lo, hi)
                else:   # both bounds at the stricter level: neither decision on one bound alone that a pass needs
                    assert decide(Interval(None, hi, LEVEL, "m", 10), t, holds) != "pass"
                    assert decide(Interval(lo, None, LEVEL, "m", 10), t, holds) != "pass"
