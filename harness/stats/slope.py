"""How fast a quantity grows over time, with its confidence interval: the Theil-Sen slope.

A leak shows as a trend under noise (an allocator's sawtooth, a garbage collector's cycles, a burst
of requests), so the slope is the median of every pairwise slope (Theil-Sen): one spike moves it
little, where it would tilt a least-squares line. Its interval is distribution-free (Sen 1968,
Gilbert 1987 section 16.5): with N pairwise slopes and Kendall's S variance, the bounds are the
M1-th and (M2 + 1)-th smallest slopes, M1,2 = (N -/+ z * sqrt(Var S)) / 2. The points are taken as
independent draws around the trend; callers that sample often should first reduce their readings
to medians over time bins (neighbouring readings of a process are not independent). A leaf module:
stdlib and numpy only (docs/statistics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

from harness.errors import ConfigError
from harness.stats.intervals import LEVEL, Interval

THEIL_SEN = "Theil-Sen slope, Kendall rank bounds"
SEGMENTED = "Theil-Sen slope within segments (seasonal Kendall), Kendall rank bounds"
MAX_POINTS = 3000   # 4.5 M pairwise slopes: beyond, a caller bins its readings first


@dataclass(frozen=True)
class Slope:
    """``estimate`` (units of y per unit of x) and its ``interval``; estimate None: fewer than two
    distinct x values, nothing to fit."""

    estimate: float | None
    interval: Interval

    def scaled(self, factor: float) -> Slope:
        """The same slope in other units (factor > 0), e.g. per second -> per hour."""
        return Slope(None if self.estimate is None else self.estimate * factor, self.interval.scaled(factor))

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "interval": self.interval.to_dict()}


def _pairwise(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Sorted slopes of every pair of points with distinct x."""
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx != 0
    return np.sort((y[j] - y[i])[keep] / dx[keep])


def _kendall_var(y: np.ndarray) -> float:
    """Var(S) of Kendall's statistic for n points, corrected for ties among the y values."""
    n = len(y)
    _, counts = np.unique(y, return_counts=True)
    ties = sum(int(t) * (int(t) - 1) * (2 * int(t) + 5) for t in counts if t > 1)
    return (n * (n - 1) * (2 * n + 5) - ties) / 18


def _bound_ranks(n_slopes: int, var_s: float, level: float) -> tuple[int | None, int | None]:
    """1-based ranks of the lower and upper bound among ``n_slopes`` sorted slopes (None: too few)."""
    c = NormalDist().inv_cdf(0.5 + level / 2) * math.sqrt(max(var_s, 0.0))
    lower = round((n_slopes - c) / 2)
    upper = round((n_slopes + c) / 2) + 1
    return (lower if lower >= 1 else None), (upper if upper <= n_slopes else None)


def needs_points(level: float = LEVEL) -> int:
    """The fewest points (distinct x, no tied y) whose Theil-Sen interval has both bounds."""
    for n in range(3, 200):
        lo, hi = _bound_ranks(n * (n - 1) // 2, n * (n - 1) * (2 * n + 5) / 18, level)
        if lo is not None and hi is not None:
            return n
    raise ConfigError(f"no Theil-Sen interval at level {level}", fix="use e.g. level 0.95")


def theil_sen(x: Sequence[float], y: Sequence[float], level: float = LEVEL, *, noun: str = "points") -> Slope:
    """The Theil-Sen slope of y over x with its two-sided ``level`` interval (see the module
    docstring). NaN pairs are dropped. The interval extrapolates (for ``more_to_decide``) to k
    times as many points at the same spacing, i.e. a k times longer series: its half-widths
    shrink as k ** -1.5, as a slope's standard error does."""
    if not 0 < level < 1:
        raise ConfigError(f"confidence level {level!r} is not in (0, 1)", fix="pass e.g. 0.95")
    if len(x) != len(y):
        raise ConfigError(f"theil_sen got {len(x)} x values and {len(y)} y values", fix="pass one y per x")
    xs, ys = _clean(x, y)
    n = len(xs)
    if n > MAX_POINTS:
        raise ConfigError(f"theil_sen of {n} points ({n * (n - 1) // 2} pairwise slopes)",
                          fix=f"bin the readings to at most {MAX_POINTS} points (medians per time bin)")
    slopes = _pairwise(xs, ys) if n >= 2 else np.empty(0)
    return _fit(slopes, _kendall_var(ys) if n else 0.0, n, level, noun, THEIL_SEN)


def segmented_theil_sen(segments: Sequence[tuple[Sequence[float], Sequence[float]]], level: float = LEVEL, *,
                        noun: str = "points") -> Slope:
    """One slope common to several series that each have an intercept of their own, e.g. the
    processes of one role, a restarted one starting again from its baseline: the median of every
    pairwise slope *within* a segment (no pair spans two segments, so a restart's drop is no
    slope), with the bounds of :func:`theil_sen` from the pooled slopes and the sum of the
    segments' Kendall variances (the seasonal Kendall slope: Hirsch, Slack & Smith 1982; Gilbert
    1987 section 17.6). A segment of one point adds nothing. Extrapolates as :func:`theil_sen`."""
    if not 0 < level < 1:
        raise ConfigError(f"confidence level {level!r} is not in (0, 1)", fix="pass e.g. 0.95")
    parts, var_s, n = [], 0.0, 0
    for x, y in segments:
        xs, ys = _clean(x, y)
        n += len(xs)
        if len(xs) >= 2:
            parts.append(_pairwise(xs, ys))
            var_s += _kendall_var(ys)
    if n > MAX_POINTS:
        raise ConfigError(f"segmented_theil_sen of {n} points", fix=f"bin the readings to at most {MAX_POINTS} points")
    slopes = np.sort(np.concatenate(parts)) if parts else np.empty(0)
    return _fit(slopes, var_s, n, level, noun, SEGMENTED)


def _clean(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """x and y as float arrays without the pairs holding a NaN."""
    if len(x) != len(y):
        raise ConfigError(f"theil_sen got {len(x)} x values and {len(y)} y values", fix="pass one y per x")
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = ~(np.isnan(xs) | np.isnan(ys))
    return xs[keep], ys[keep]


def _fit(slopes: np.ndarray, var_s: float, n: int, level: float, noun: str, method: str) -> Slope:
    """The median of sorted ``slopes`` and its rank bounds given Kendall's ``var_s``."""
    need = needs_points(level)
    if not len(slopes):
        return Slope(None, Interval(None, None, level, method, n, noun=noun, needs_n=need))
    estimate = float(np.median(slopes))
    lo_rank, hi_rank = _bound_ranks(len(slopes), var_s, level)
    lo = None if lo_rank is None else float(slopes[lo_rank - 1])
    hi = None if hi_rank is None else float(slopes[hi_rank - 1])
    bounded = lo is not None and hi is not None

    def extrapolate(k: float) -> Interval:
        shrink = max(k, 1.0) ** -1.5
        return Interval(None if lo is None else estimate - (estimate - lo) * shrink,
                        None if hi is None else estimate + (hi - estimate) * shrink, level, "extrapolated",
                        math.ceil(n * k), noun=noun)

    return Slope(estimate, Interval(lo, hi, level, method, n, noun=noun, needs_n=None if bounded else need,
                                    extrapolate=extrapolate if bounded else None))


def binned_medians(t: Sequence[float], y: Sequence[float], bin_s: float) -> tuple[list[float], list[float]]:
    """(median time, median value) of each ``bin_s`` wide time bin holding readings, from the first
    reading on: what :func:`theil_sen` fits when readings come every few seconds."""
    if not bin_s > 0:
        raise ConfigError(f"bin width {bin_s!r} s must be positive", fix="pass e.g. 30")
    if len(t) != len(y):
        raise ConfigError(f"binned_medians got {len(t)} times and {len(y)} values", fix="pass one value per time")
    if not len(t):
        return [], []
    ts, ys = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    order = np.argsort(ts, kind="stable")
    ts, ys = ts[order], ys[order]
    bins = np.floor((ts - ts[0]) / bin_s).astype(int)
    cuts = np.flatnonzero(np.diff(bins)) + 1
    return ([float(np.median(a)) for a in np.split(ts, cuts)], [float(np.median(a)) for a in np.split(ys, cuts)])


__all__ = ["MAX_POINTS", "SEGMENTED", "Slope", "THEIL_SEN", "binned_medians", "needs_points", "segmented_theil_sen",
           "theil_sen"]
