"""Seeded percentile bootstrap of a statistic of one or two samples (docs/statistics.md):
the same input always gives the same interval. Re-exported by ``harness/stats/intervals.py``.

A bound at a small one-sided miss chance needs enough resamples to reach that far into the
bootstrap distribution: at least :data:`RESAMPLES_PER_TAIL` / alpha of them (capped at
:data:`MAX_RESAMPLES`, where the bound is the extreme resample and says so by being wide).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from harness.errors import ConfigError
from harness.stats.interval import Interval, tails, two_sided
from harness.stats.levels import LEVEL

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_MIN_N = 8          # fewer samples in a window: the bootstrap's own error dominates (docs)
RESAMPLES_PER_TAIL = 20      # resamples beyond each bound, at least
MAX_RESAMPLES = 200_000

Statistic = Callable[..., np.ndarray]   # arrays [resamples, n_i] per sample -> [resamples]


def mean(a: np.ndarray) -> np.ndarray:
    return a.mean(axis=-1)


def median(a: np.ndarray) -> np.ndarray:
    return np.median(a, axis=-1)


def ratio_of_medians(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.median(a, axis=-1) / np.median(b, axis=-1)


def ratio_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(Covers less than its level on skewed data in small windows: docs/statistics.md; the
    verdicts use medians.)"""
    return a.mean(axis=-1) / b.mean(axis=-1)


STATISTIC_NAMES = {mean: "mean", median: "median", ratio_of_medians: "ratio of medians",
                   ratio_of_means: "ratio of means"}


def resamples_for(alpha_lo: float, alpha_hi: float, least: int = BOOTSTRAP_RESAMPLES) -> int:
    """Resamples enough for both bounds at these one-sided miss chances."""
    return min(MAX_RESAMPLES, max(least, math.ceil(RESAMPLES_PER_TAIL / max(min(alpha_lo, alpha_hi), 1e-9))))


def bootstrap_interval(statistic: Statistic, *samples: Sequence[float], level: float = LEVEL,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, noun: str = "samples",
                       grows: Sequence[int] | None = None, alpha_lo: float | None = None,
                       alpha_hi: float | None = None) -> Interval:
    """Percentile bootstrap of ``statistic`` of one or two samples, resampled independently with a
    seeded generator (same input, same interval). A sample with fewer than BOOTSTRAP_MIN_N values
    gives an unbounded interval. ``grows``: indices of the samples a suite can extend (for
    :func:`more_to_decide`; default all). ``alpha_lo`` / ``alpha_hi``: one-sided miss chances of
    each bound (default ``(1 - level) / 2``); more resamples are drawn when they are small."""
    if not 1 <= len(samples) <= 2:
        raise ConfigError(f"the bootstrap takes one or two samples, got {len(samples)}", fix="pass a, or a and b")
    if not 0 < level < 1 or resamples < 100:
        raise ConfigError(f"bootstrap level {level} / resamples {resamples} out of range",
                          fix="use 0 < level < 1 and at least 100 resamples")
    a_lo, a_hi = tails(level, alpha_lo, alpha_hi)
    level = two_sided(a_lo, a_hi)
    draws = resamples_for(a_lo, a_hi, resamples)
    arrays = [np.asarray([v for v in s if not math.isnan(v)], dtype=float) for s in samples]
    sizes = [len(a) for a in arrays]
    name = STATISTIC_NAMES.get(statistic, getattr(statistic, "__name__", "statistic"))
    method = f"bootstrap of the {name} ({draws} resamples, seed {seed})"
    n2 = sizes[1] if len(sizes) == 2 else None

    def relevel(lo_alpha: float, hi_alpha: float) -> Interval:
        return bootstrap_interval(statistic, *samples, resamples=resamples, seed=seed, noun=noun, grows=grows,
                                  alpha_lo=lo_alpha, alpha_hi=hi_alpha)

    sides = {"alpha_lo": a_lo, "alpha_hi": a_hi, "relevel": relevel}
    if min(sizes) < BOOTSTRAP_MIN_N:
        return Interval(None, None, level, method, sizes[0], noun=noun, n2=n2, needs_n=BOOTSTRAP_MIN_N, **sides)
    rng = np.random.default_rng(seed)
    stats = statistic(*(a[rng.integers(0, len(a), size=(draws, len(a)))] for a in arrays))
    stats = stats[np.isfinite(stats)]
    if len(stats) < draws // 2:  # e.g. a zero median in a denominator
        return Interval(None, None, level, method, sizes[0], noun=noun, n2=n2, **sides)
    lo, hi = (float(x) for x in np.quantile(stats, [a_lo, 1 - a_hi]))
    estimate = float(statistic(*(a[None, :] for a in arrays))[0])
    return Interval(lo, hi, level, method, sizes[0], noun=noun, n2=n2,
                    extrapolate=_shrinking(lo, hi, min(max(estimate, lo), hi), level, sizes,
                                           list(range(len(sizes))) if grows is None else list(grows)), **sides)


def _shrinking(lo: float, hi: float, estimate: float, level: float, sizes: Sequence[int], grows: Sequence[int],
               ) -> Callable[[float], Interval]:
    """Half-widths that shrink like the standard error, sqrt(sum 1/n_i), when the ``grows``
    samples get k times bigger: how a bootstrap interval of a smooth statistic narrows."""
    base = sum(1 / n for n in sizes)

    def at(k: float) -> Interval:
        shrink = math.sqrt(sum(1 / (n * (k if i in grows else 1)) for i, n in enumerate(sizes)) / base)
        return Interval(estimate - (estimate - lo) * shrink, estimate + (hi - estimate) * shrink, level,
                        "extrapolated", math.ceil(sizes[0] * k))
    return at
