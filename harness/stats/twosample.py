"""Intervals of a comparison of two independent runs (docs/compare.md): :func:`mover_ratio` (the
ratio of two estimates from their own intervals) and :func:`difference_interval` (of two proportions).

:func:`wilson` bounds one proportion (Wilson's score interval); :func:`difference_interval` bounds
``p1 - p2`` of two independent proportions by Newcombe's hybrid score method (Newcombe 1998,
method 10): each bound's distance from the estimate is the two Wilson margins on that side added in
quadrature. Unlike the Wald interval it stays sensible at 0 events (0 of 300 lost in both runs:
about +-1.6 points at 1 % one-sided), which is the usual case here. Each bound holds at its own
one-sided miss chance. A leaf: stdlib only.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from harness.errors import ConfigError
from harness.stats.interval import Interval, two_sided

METHOD = "Newcombe hybrid score (Wilson) difference"


def _z(alpha: float) -> float:
    return NormalDist().inv_cdf(1 - alpha)


def wilson(events: float, n: float, alpha_lo: float, alpha_hi: float) -> tuple[float, float]:
    """Wilson score bounds of ``events / n``: the lower at one-sided ``alpha_lo``, the upper at
    ``alpha_hi`` (counts may be fractional: the extrapolation scales them)."""
    if n <= 0 or not 0 <= events <= n:
        raise ConfigError(f"{events} events of {n}", fix="pass 0 <= events <= n, n > 0")
    p = events / n

    def bound(z: float, sign: int) -> float:
        centre = p + z * z / (2 * n)
        margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return min(1.0, max(0.0, (centre + sign * margin) / (1 + z * z / n)))

    return bound(_z(alpha_lo), -1), bound(_z(alpha_hi), +1)


def difference_interval(events1: float, n1: float, events2: float, n2: float, *, alpha_lo: float, alpha_hi: float,
                        noun: str = "requests") -> Interval:
    """Interval of ``events1 / n1 - events2 / n2`` (two independent binomial samples), its lower
    bound at one-sided ``alpha_lo``, its upper at ``alpha_hi``; extrapolates by scaling both counts."""
    p1, p2 = events1 / n1, events2 / n2
    l1, u1 = wilson(events1, n1, alpha_lo, alpha_hi)
    l2, u2 = wilson(events2, n2, alpha_hi, alpha_lo)   # p2's upper bound lowers the difference's lower bound
    d = p1 - p2
    lo = d - math.hypot(p1 - l1, u2 - p2)
    hi = d + math.hypot(u1 - p1, p2 - l2)
    return Interval(max(-1.0, lo), min(1.0, hi), two_sided(alpha_lo, alpha_hi), METHOD, int(n1), noun=noun,
                    n2=int(n2), alpha_lo=alpha_lo, alpha_hi=alpha_hi,
                    extrapolate=lambda k: difference_interval(events1 * k, n1 * k, events2 * k, n2 * k,
                                                              alpha_lo=alpha_lo, alpha_hi=alpha_hi, noun=noun))


def mover_ratio(num: Interval, num_point: float, den: Interval, den_point: float) -> Interval:
    """Interval of num / den for two independent positive estimates from each one's own interval at
    the same one-sided levels: MOVER on the log scale (Zou & Donner 2008, "method of variance
    estimates recovery"): each bound's distance from its estimate is that side's margin of error, and
    the two runs' margins add in quadrature, as independent errors do. The ratio of the bounds
    (harness.stats.intervals.ratio_interval: no independence assumed) is far wider: at the
    tolerance, with 600 requests a run, it called 0 of 400 regressed at a 1.25 % level and so missed
    most real regressions. Extrapolation grows both runs alike."""
    def ln(x: float | None) -> float | None:
        return None if x is None or x <= 0 else math.log(x)

    n_lo, n_hi, d_lo, d_hi = ln(num.lo), ln(num.hi), ln(den.lo), ln(den.hi)
    n0, d0 = ln(num_point), ln(den_point)
    lo = hi = None
    if None not in (n0, d0, n_lo, d_hi):
        lo = math.exp(n0 - d0 - math.hypot(n0 - n_lo, d_hi - d0))  # type: ignore[operator]
    if None not in (n0, d0, n_hi, d_lo):
        hi = math.exp(n0 - d0 + math.hypot(n_hi - n0, d0 - d_lo))  # type: ignore[operator]
    extrapolate = None
    if num.extrapolate is not None and den.extrapolate is not None:
        ne, de = num.extrapolate, den.extrapolate
        extrapolate = lambda k: mover_ratio(ne(k), num_point, de(k), den_point)  # noqa: E731
    needs = max((x for x in (num.needs_n, den.needs_n) if x is not None), default=None)
    return Interval(lo, hi, 1 - num.miss_lo - num.miss_hi, f"MOVER ratio of {num.method} intervals (log scale)",
                    num.n, noun=num.noun, n2=den.n, needs_n=needs, extrapolate=extrapolate,
                    alpha_lo=num.miss_lo, alpha_hi=num.miss_hi)
