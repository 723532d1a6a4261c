"""Percentile intervals under serial dependence (issue 33 item 3; harness/stats/dependence.py).

The issue's model: log-latency with lag-1 correlation 0.6 drops the coverage of an independent-
draws p50 interval at n=1000 from 0.95 to about 0.75. Simulated here, seeded: AR(1) Gaussian
series, the true median 0; the interval built ``in_order`` must cover it at its level (within 3
standard deviations of 2000 trials), the old one must not (so the simulation can see the defect),
and on independent draws the correction must cost almost nothing (tau near 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.stats.dependence import MIN_N, autocorrelations, geyer_tau, percentile_dependence
from harness.stats.intervals import percentile_interval

TRIALS = 2000


def ar1(rng: np.random.Generator, n: int, rho: float) -> np.ndarray:
    """A stationary AR(1) series with unit marginal variance (the true median is 0)."""
    e = rng.standard_normal(n) * math.sqrt(1 - rho * rho)
    x = np.empty(n)
    x[0] = rng.standard_normal()
    for i in range(1, n):
        x[i] = rho * x[i - 1] + e[i]
    return x


def coverage(rho: float, in_order: bool, q: float = 50, n: int = 1000, seed: int = 33) -> tuple[float, float]:
    """(share of 95 % intervals that contain the true q-th percentile, mean tau)."""
    rng = np.random.default_rng(seed)
    truth = {50: 0.0, 90: 1.2815515655446004}[q]
    hits, taus = 0, []
    for _ in range(TRIALS):
        x = ar1(rng, n, rho)
        i = percentile_interval(x, q, 0.95, in_order=in_order)
        hits += i.lo <= truth <= i.hi
        taus.append((i.dependence or {}).get("tau", 1.0))
    return hits / TRIALS, float(np.mean(taus))


def test_dependent_latency_keeps_its_coverage_and_the_old_interval_loses_it():
    """Planted defect: percentile_interval ignoring ``in_order`` (the old independent-draws
    interval): its coverage at lag-1 correlation 0.6 is about 0.75, far under 0.95."""
    sd = math.sqrt(0.95 * 0.05 / TRIALS)
    old, _ = coverage(0.6, in_order=False)
    new, tau = coverage(0.6, in_order=True)
    assert old < 0.85, old                  # the defect the issue modelled is really there
    assert new >= 0.95 - 3 * sd, (new, tau)
    # the theory for AR(1) at the median: tau = (1 + r) / (1 - r), r = (2/pi) asin(0.6) ~ 0.41
    r = 2 / math.pi * math.asin(0.6)
    assert 0.7 * (1 + r) / (1 - r) < tau < 1.6 * (1 + r) / (1 - r), tau
    tail, _ = coverage(0.6, in_order=True, q=90)
    assert tail >= 0.95 - 3 * sd, tail


def test_independent_draws_cost_almost_nothing():
    """On independent draws tau stays near 1 and coverage at its level. Planted defect: tau from
    the absolute autocorrelations of 100 lags (noise taken for dependence, not Geyer's initial
    positive sequence): tau about 5 on independent draws, intervals wide for nothing (checked)."""
    sd = math.sqrt(0.95 * 0.05 / TRIALS)
    cov, tau = coverage(0.0, in_order=True)
    assert tau < 1.25, tau
    assert cov >= 0.95 - 3 * sd, cov


def test_small_samples_and_constant_series_assume_nothing_and_say_so():
    """Below MIN_N samples tau is not estimated (independence assumed, ``measured`` False) and
    the interval is the independent one; a series with one value has no dependence to measure.
    Planted defect: estimating tau from a few samples (noise taken for dependence)."""
    rng = np.random.default_rng(1)
    x = ar1(rng, MIN_N - 1, 0.9)
    dep = percentile_dependence(x, 50)
    assert not dep.measured and dep.tau == 1.0
    assert "independence assumed" in dep.to_dict()["method"]
    a, b = percentile_interval(x, 50, in_order=True), percentile_interval(x, 50)
    assert (a.lo, a.hi) == (b.lo, b.hi)
    flat = percentile_dependence([5.0] * 500, 50)
    assert flat.measured and flat.tau == 1.0


def test_autocorrelations_match_the_direct_sum_and_tau_of_ar1():
    """The FFT autocorrelations equal the textbook sums; Geyer's tau of an AR(1) series with
    correlation 0.5 is near (1 + 0.5) / (1 - 0.5) = 3. Planted defect: an FFT without zero
    padding (circular correlation): lag 1 then differs from the direct sum."""
    rng = np.random.default_rng(7)
    x = ar1(rng, 4000, 0.5)
    rho = autocorrelations(x, 5)
    d = x - x.mean()
    direct = [float((d[:-k] * d[k:]).sum() / (d * d).sum()) for k in range(1, 6)]
    assert rho[0] == pytest.approx(1.0)
    assert list(rho[1:]) == pytest.approx(direct, abs=1e-9)
    assert 2.4 < geyer_tau(x) < 3.6
