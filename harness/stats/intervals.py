"""Confidence intervals for timing verdicts (docs/statistics.md states each method and its assumptions).

Every timing verdict is a claim about a distribution from a finite sample, so it carries an
:class:`Interval`; a verdict passes only when the whole interval is on the good side of its
threshold, fails only when the whole interval is beyond it (:func:`decide`). Methods:

- :func:`percentile_interval`: distribution-free bounds of a percentile from order statistics
  (exact binomial ranks); a bound needs a minimum number of samples (:func:`min_samples`).
- :func:`bootstrap_interval`: a seeded percentile bootstrap of a statistic of one or two samples
  (ratio of medians or means between two windows, a mean): same input, same interval.
- :func:`ratio_interval`: a conservative interval for a ratio of two quantities from their own
  intervals (each at :func:`ratio_input_level`, Bonferroni).
- :func:`clopper_pearson_lower`: one-sided lower bound of a proportion ("at least X % of faults").
- :func:`measured_within`: bounds from measurement resolution (no probability: level 1).

:func:`more_to_decide` says how many more samples would decide a straddling interval, assuming
the observed distribution holds. :class:`Interval`, :func:`decide` and :func:`more_to_decide` live
in ``interval.py``, the bootstrap in ``bootstrap.py`` (both re-exported here), the one-sided levels a
verdict spends in ``levels.py``. Each builder attaches how to recompute its interval at other
one-sided levels (:meth:`Interval.at`). A leaf package: stdlib and numpy only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from harness.errors import ConfigError
from harness.stats.dependence import Dependence, percentile_dependence
from harness.stats.bootstrap import (BOOTSTRAP_MIN_N, BOOTSTRAP_RESAMPLES, STATISTIC_NAMES, Statistic,  # noqa: F401
                                     bootstrap_interval, mean, median, ratio_of_means, ratio_of_medians)
from harness.stats.interval import (DECIDE_FACTOR, Decision, Interval, brackets, decide, more_to_decide,  # noqa: F401
                                    tails as _tails, two_sided)
from harness.stats.levels import LEVEL

ORDER_STATISTICS = "order statistics"
RESOLUTION = "measurement resolution"


# -- order statistics ---------------------------------------------------------------------------

def _binomial_cdf(n: int, p: float) -> np.ndarray:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, p), 0 < p < 1 (pmf by its ratio recursion in log space)."""
    k = np.arange(n, dtype=float)
    steps = np.log((n - k) / (k + 1)) + math.log(p) - math.log1p(-p)
    log_pmf = n * math.log1p(-p) + np.concatenate(([0.0], np.cumsum(steps)))
    return np.minimum(np.cumsum(np.exp(log_pmf)), 1.0)


def order_statistic_ranks(n: int, q: float, level: float = LEVEL, *, alpha_lo: float | None = None,
                          alpha_hi: float | None = None) -> tuple[int | None, int | None]:
    """1-based ranks (r, s) of the sorted sample whose values bound the q-th percentile: the lower
    misses with at most ``alpha_lo``, the upper with at most ``alpha_hi`` (default ``(1 - level) / 2``
    each); None where n is too small for that bound. For continuous data P(x_(r) <= xi_q) = P(B >= r),
    B ~ Bin(n, q/100)."""
    _check_q(q)
    return _ranks(n, q / 100, *_tails(level, alpha_lo, alpha_hi))


@functools.lru_cache(maxsize=8192)
def _ranks(n: int, p: float, a_lo: float, a_hi: float) -> tuple[int | None, int | None]:
    if n < 1:
        return None, None
    if p == 1.0:   # p100: the largest value is a certain lower bound, nothing observed bounds it above
        return n, None
    if p == 0.0:
        return None, 1
    cdf = _binomial_cdf(n, p)[:n]                      # F(0) .. F(n-1)
    below = int(np.searchsorted(cdf, a_lo, side="right"))    # how many k have F(k) <= a_lo
    above = int(np.searchsorted(cdf, 1 - a_hi, side="left"))  # first k with F(k) >= 1 - a_hi
    return (below or None), (above + 1 if above < n else None)


def min_samples(q: float, level: float = LEVEL, *, alpha_lo: float | None = None,
                alpha_hi: float | None = None) -> tuple[int | None, int | None]:
    """The fewest samples for which the lower and the upper bound of the q-th percentile exist
    (e.g. p99 at 95 %: (1, 368); p50: (6, 6)); None: never (p100 has no upper bound)."""
    _check_q(q)
    return _min_samples(q / 100, *_tails(level, alpha_lo, alpha_hi))


@functools.lru_cache(maxsize=1024)
def _min_samples(p: float, a_lo: float, a_hi: float) -> tuple[int | None, int | None]:
    lower = None if p == 0 else (1 if p == 1 else math.ceil(math.log(a_lo) / math.log1p(-p) - 1e-9))
    # (p^n <= a_hi for the upper bound, (1-p)^n <= a_lo for the lower one; 1e-9 absorbs rounding)
    upper = None if p == 1 else (1 if p == 0 else math.ceil(math.log(a_hi) / math.log(p) - 1e-9))
    return lower, upper


def percentile_interval(values: Sequence[float], q: float, level: float = LEVEL, *, noun: str = "samples",
                        alpha_lo: float | None = None, alpha_hi: float | None = None,
                        in_order: bool = False) -> Interval:
    """Distribution-free interval of the q-th percentile of the population ``values`` were drawn
    from (NaN ignored); each bound at its own one-sided miss chance when ``alpha_lo`` / ``alpha_hi``
    are given (default ``(1 - level) / 2`` each). Independent draws are assumed unless
    ``in_order``: ``values`` are then in the order they were taken, and the interval is built from
    the effective samples their serial dependence leaves (harness/stats/dependence.py; evidence
    ``dependence``)."""
    _check_q(q)
    arr = np.asarray(values, dtype=float)
    ordered = np.sort(arr[~np.isnan(arr)]).tolist()
    dep = percentile_dependence(arr, q) if in_order else None
    return _from_sorted(ordered, q, *_tails(level, alpha_lo, alpha_hi), noun, len(ordered), dep)


def _from_sorted(ordered: list[float], q: float, a_lo: float, a_hi: float, noun: str, n: int,
                 dep: Dependence | None = None) -> Interval:
    """Interval of n samples; n above len(ordered) extrapolates: the bounds are then the observed
    distribution's quantiles (linear between observed values) at the same fraction of ranks.
    ``dep``: the samples' serial dependence; the ranks are those of n / tau effective samples."""
    inflation = 1.0 if dep is None else dep.tau
    n_ranks = max(1, int(n / inflation)) if n else 0
    r, s = _ranks(n_ranks, q / 100, a_lo, a_hi)
    m = len(ordered)

    def at(rank: int | None) -> float | None:
        if rank is None or not m:
            return None
        if n_ranks == m:
            return ordered[rank - 1]
        pos = min(max(rank / n_ranks * m - 1, 0.0), m - 1.0)   # 0-based position: rank r of m is r - 1
        i = int(pos)
        return ordered[i] + (ordered[min(i + 1, m - 1)] - ordered[i]) * (pos - i)

    lower, upper = _min_samples(q / 100, a_lo, a_hi)
    needs = None if r is not None and s is not None else max((math.ceil(x * inflation) for x in (lower, upper)
                                                             if x is not None), default=None)
    extrapolate = (lambda k: _from_sorted(ordered, q, a_lo, a_hi, noun, math.ceil(m * k), dep)) if m else None
    relevel = (lambda lo_alpha, hi_alpha: _from_sorted(ordered, q, lo_alpha, hi_alpha, noun, m, dep)) if n == m else None
    dependence = None if dep is None else replace(dep, n=n).to_dict()   # n_eff of these n samples
    return Interval(at(r), at(s), two_sided(a_lo, a_hi), ORDER_STATISTICS, n, noun=noun, needs_n=needs,
                    extrapolate=extrapolate, alpha_lo=a_lo, alpha_hi=a_hi, relevel=relevel, dependence=dependence)


def _check_q(q: float) -> None:
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile must be in [0, 100], got {q!r}", fix="pass e.g. 99 for p99")


# -- combinations, proportions, resolution --------------------------------------------------------

def ratio_input_level(level: float = LEVEL) -> float:
    """The level each of two intervals needs for their ratio to hold at ``level`` (Bonferroni)."""
    return 1 - (1 - level) / 2


def ratio_interval(num: Interval, den: Interval, *, den_floor: float = 0.0) -> Interval:
    """Conservative interval of num / den for positive quantities: [num.lo / den.hi, num.hi / den.lo],
    at level 1 - (miss_num + miss_den) (Bonferroni: no independence assumed). ``den_floor``
    raises both denominator bounds to at least that (a noise floor). Extrapolation grows both."""
    d_lo = None if den.lo is None else max(den.lo, den_floor)
    d_hi = None if den.hi is None else max(den.hi, den_floor)
    lo = None if num.lo is None or d_hi is None or d_hi <= 0 else num.lo / d_hi
    hi = None if num.hi is None or d_lo is None or d_lo <= 0 else num.hi / d_lo
    a_lo, a_hi = num.miss_lo + den.miss_hi, num.miss_hi + den.miss_lo   # each bound misses if either input's does
    extrapolate = relevel = None
    if num.extrapolate is not None and den.extrapolate is not None:
        ne, de = num.extrapolate, den.extrapolate
        extrapolate = lambda k: ratio_interval(ne(k), de(k), den_floor=den_floor)  # noqa: E731
    if num.relevel is not None and den.relevel is not None:   # half of each side's chance to each input
        relevel = lambda a, b: ratio_interval(num.at(a / 2, b / 2), den.at(b / 2, a / 2),  # noqa: E731
                                              den_floor=den_floor)
    needs = max((x for x in (num.needs_n, den.needs_n) if x is not None), default=None)
    return Interval(lo, hi, max(two_sided(a_lo, a_hi), 0.01), f"ratio of {num.method} bounds (Bonferroni)", num.n,
                    noun=num.noun, n2=den.n, needs_n=needs, extrapolate=extrapolate,
                    alpha_lo=min(a_lo, 0.4999), alpha_hi=min(a_hi, 0.4999), relevel=relevel)


def _binomial_sf(k: int, n: int, p: float) -> float:
    """P(B >= k), B ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if p <= 0 or p >= 1:
        return float(p >= 1)
    if n <= 1000:   # exact sum (binomial coefficients still fit a float); bisection calls this often
        return min(1.0, math.fsum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1)))
    return max(0.0, 1.0 - float(_binomial_cdf(n, p)[k - 1]))


def clopper_pearson_lower(successes: int, n: int, level: float = LEVEL) -> float:
    """One-sided lower confidence bound of a proportion (exact, Clopper-Pearson): the smallest p
    for which ``successes`` of ``n`` is still plausible at 1 - level. 6 of 6: 0.607 at 95 %."""
    if not 0 <= successes <= n or n < 1:
        raise ConfigError(f"{successes} successes of {n} trials", fix="pass 0 <= successes <= n, n >= 1")
    if successes == 0:
        return 0.0
    alpha, lo, hi = 1 - level, 0.0, 1.0
    for _ in range(60):   # bisection: P(B >= successes | p) rises with p
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _binomial_sf(successes, n, mid) < alpha else (lo, mid)
    return lo


def share_statement(ok: int, n: int, noun: str, condition: str, level: float = LEVEL) -> str:
    """``6 of 6 faults rescheduled <= 3 s: with 95 % confidence at least 61 % of all faults do``."""
    return (f"{ok} of {n} {noun} {condition}: with {level * 100:g} % confidence at least "
            f"{clopper_pearson_lower(ok, n, level) * 100:.0f} % of all {noun} do")


def measured_within(value: float, *, below: float, above: float, n: int = 1, noun: str = "samples") -> Interval:
    """Bounds from measurement resolution: the true value lies in [value - below, value + above]
    for certain (level 1), and more samples do not narrow it."""
    if below < 0 or above < 0:
        raise ConfigError(f"resolution {below}/{above} must not be negative", fix="pass widths >= 0")
    return Interval(value - below, value + above, 1.0, RESOLUTION, n, noun=noun)


def across(intervals: Sequence[Interval], q: float, *, noun: str = "samples") -> Interval:
    """The nearest-rank q-th percentile of several bounded values, each known only within its own
    interval: [q-th of the lower bounds, q-th of the upper bounds] (nearest rank is monotone)."""
    if not intervals or not all(i.bounded for i in intervals):
        raise ConfigError("across() needs bounded intervals", fix="pass at least one bounded interval")

    def rank(vals: list[float]) -> float:
        ordered = sorted(vals)
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]
    return Interval(rank([i.lo for i in intervals]), rank([i.hi for i in intervals]),  # type: ignore[misc]
                    min(i.level for i in intervals), intervals[0].method, len(intervals), noun=noun)
