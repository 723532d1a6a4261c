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
the observed distribution holds. A leaf module: stdlib and numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence

import numpy as np

from harness.errors import ConfigError

LEVEL = 0.95                 # two-sided confidence of every interval unless a caller says otherwise
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_MIN_N = 8          # fewer samples in a window: the bootstrap's own error dominates (docs)
DECIDE_FACTOR = 10           # "about N more would decide" looks this far: beyond, "more than 10x"
ORDER_STATISTICS = "order statistics"
RESOLUTION = "measurement resolution"

Decision = Literal["pass", "fail"]


@dataclass(frozen=True)
class Interval:
    """Where a measured quantity lies: ``lo``..``hi`` at confidence ``level`` by ``method`` from
    ``n`` samples (``n2``: the second window of a two-sample statistic). A bound of None is
    unbounded: too few samples for it (``needs_n`` says how many give both bounds)."""

    lo: float | None
    hi: float | None
    level: float
    method: str
    n: int
    noun: str = "samples"                 # what n counts: requests, transfers, migrations, faults
    n2: int | None = None
    needs_n: int | None = None
    # the interval expected with k times the samples (k >= 1), the observed distribution holding;
    # None: more samples would not narrow it (a resolution bound)
    extrapolate: Callable[[float], Interval] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ConfigError(f"interval lower bound {self.lo} is above its upper bound {self.hi}",
                              fix="pass the bounds in order (lo <= hi)")
        if not 0 < self.level <= 1:
            raise ConfigError(f"confidence level {self.level} is not in (0, 1]", fix="pass e.g. 0.95")

    @property
    def bounded(self) -> bool:
        return self.lo is not None and self.hi is not None

    @property
    def sizes(self) -> str:
        return f"n={self.n}" if self.n2 is None else f"n={self.n}+{self.n2}"

    def span(self, unit: str = "", digits: int = 4) -> str:
        """``480-560 ms``; ``>= 312 ms`` / ``<= 40 ms`` when one side is unbounded."""
        def f(x: float) -> str:
            return f"{x:.{digits}g}"
        unit = f" {unit}" if unit else ""
        if self.bounded:
            return f"{f(self.lo)}-{f(self.hi)}{unit}"  # type: ignore[arg-type]
        if self.lo is not None:
            return f">= {f(self.lo)}{unit}, no upper bound"
        if self.hi is not None:
            return f"<= {f(self.hi)}{unit}, no lower bound"
        return "unbounded"

    @property
    def how(self) -> str:
        """``95 %, order statistics, n=412`` (a resolution bound states no level)."""
        level = "" if self.level >= 1 else f"{self.level * 100:g} %, "
        need = f", both bounds need n >= {self.needs_n}" if self.needs_n is not None and not self.bounded else ""
        return f"{level}{self.method}, {self.sizes}{need}"

    def describe(self, unit: str = "") -> str:
        """``480-560 ms (95 %, order statistics, n=412)``."""
        return f"{self.span(unit)} ({self.how})"

    def brackets(self) -> str:
        """The short form shown beside a figure: ``[450-510, 95 %]``."""
        level = "bounds" if self.level >= 1 else f"{self.level * 100:g} %"
        return f"[{self.span(digits=3)}, {level}]"

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (factor > 0), e.g. Gbit/s -> fraction of line rate."""
        if factor <= 0:
            raise ConfigError(f"scale factor {factor} must be positive", fix="divide by a positive rate")
        ext = self.extrapolate
        return replace(self, lo=None if self.lo is None else self.lo * factor,
                       hi=None if self.hi is None else self.hi * factor,
                       extrapolate=None if ext is None else (lambda k: ext(k).scaled(factor)))

    def to_dict(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi, "level": self.level, "method": self.method, "n": self.n,
                "n2": self.n2, "noun": self.noun, "needs_n": self.needs_n}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interval:
        """Back from :meth:`to_dict` (results.json); it no longer extrapolates."""
        return cls(data["lo"], data["hi"], data["level"], data["method"], data["n"], noun=data.get("noun", "samples"),
                   n2=data.get("n2"), needs_n=data.get("needs_n"))


def brackets(data: dict[str, Any] | None) -> str:
    """``[450-510, 95 %]`` from an interval's dict, "" for none: what reports show beside a figure."""
    return "" if not data else Interval.from_dict(data).brackets()


def decide(interval: Interval, threshold: float, holds: Callable[[float], bool]) -> Decision | None:
    """"pass" when both bounds exist and hold, "fail" when no point of the interval holds (an
    unbounded side reaches infinity), else None: the interval straddles the threshold."""
    lo = -math.inf if interval.lo is None else interval.lo
    hi = math.inf if interval.hi is None else interval.hi
    lo_ok, hi_ok = holds(lo), holds(hi)
    if interval.bounded and lo_ok and hi_ok:
        return "pass"
    if not lo_ok and not hi_ok and not (lo <= threshold <= hi and holds(threshold)):
        return "fail"
    return None


def more_to_decide(interval: Interval, threshold: float, holds: Callable[[float], bool]) -> int | None:
    """About how many more samples (of the window that grows) would decide a straddling
    interval, assuming the observed distribution holds; None when DECIDE_FACTOR times the
    samples would not (or more samples cannot narrow it)."""
    if interval.extrapolate is None or decide(interval, threshold, holds) is not None:
        return None
    n = max(interval.n, 1)
    step = max(1, math.ceil((DECIDE_FACTOR - 1) * n / 200))   # at most ~200 trial sizes
    for n_more in range(step, (DECIDE_FACTOR - 1) * n + 1, step):
        if decide(interval.extrapolate((n + n_more) / n), threshold, holds) is not None:
            return n_more
    return None


# -- order statistics ---------------------------------------------------------------------------

def _binomial_cdf(n: int, p: float) -> np.ndarray:
    """P(B <= k) for k = 0..n, B ~ Binomial(n, p), 0 < p < 1 (pmf by its ratio recursion in log space)."""
    k = np.arange(n, dtype=float)
    steps = np.log((n - k) / (k + 1)) + math.log(p) - math.log1p(-p)
    log_pmf = n * math.log1p(-p) + np.concatenate(([0.0], np.cumsum(steps)))
    return np.minimum(np.cumsum(np.exp(log_pmf)), 1.0)


def order_statistic_ranks(n: int, q: float, level: float = LEVEL) -> tuple[int | None, int | None]:
    """1-based ranks (r, s) of the sorted sample whose values bound the q-th percentile with
    two-sided confidence ``level`` (each side misses with at most (1 - level) / 2); None where n
    is too small for that bound. For continuous data P(x_(r) <= xi_q) = P(B >= r), B ~ Bin(n, q/100)."""
    _check_q_level(q, level)
    p, tail = q / 100, (1 - level) / 2
    if n < 1:
        return None, None
    if p == 1.0:   # p100: the largest value is a certain lower bound, nothing observed bounds it above
        return n, None
    if p == 0.0:
        return None, 1
    cdf = _binomial_cdf(n, p)[:n]                      # F(0) .. F(n-1)
    below = int(np.searchsorted(cdf, tail, side="right"))    # how many k have F(k) <= tail
    above = int(np.searchsorted(cdf, 1 - tail, side="left"))  # first k with F(k) >= 1 - tail
    return (below or None), (above + 1 if above < n else None)


def min_samples(q: float, level: float = LEVEL) -> tuple[int | None, int | None]:
    """The fewest samples for which the lower and the upper bound of the q-th percentile exist
    (e.g. p99 at 95 %: (1, 368); p50: (6, 6)); None: never (p100 has no upper bound)."""
    _check_q_level(q, level)
    p, tail = q / 100, (1 - level) / 2
    lower = None if p == 0 else (1 if p == 1 else math.ceil(math.log(tail) / math.log1p(-p) - 1e-9))
    # (p^n <= tail for the upper bound, (1-p)^n <= tail for the lower one; 1e-9 absorbs rounding)
    upper = None if p == 1 else (1 if p == 0 else math.ceil(math.log(tail) / math.log(p) - 1e-9))
    return lower, upper


def percentile_interval(values: Sequence[float], q: float, level: float = LEVEL, *, noun: str = "samples") -> Interval:
    """Distribution-free interval of the q-th percentile of the population ``values`` were drawn
    from (independent draws assumed; NaN ignored)."""
    ordered = sorted(v for v in values if not math.isnan(v))
    return _from_sorted(ordered, q, level, noun, len(ordered))


def _from_sorted(ordered: list[float], q: float, level: float, noun: str, n: int) -> Interval:
    """Interval of n samples; n above len(ordered) extrapolates: the bounds are then the observed
    distribution's quantiles (linear between observed values) at the same fraction of ranks."""
    r, s = order_statistic_ranks(n, q, level)
    m = len(ordered)

    def at(rank: int | None) -> float | None:
        if rank is None or not m:
            return None
        if n == m:
            return ordered[rank - 1]
        pos = min(max(rank / n * m - 1, 0.0), m - 1.0)   # 0-based position: rank r of m is r - 1
        i = int(pos)
        return ordered[i] + (ordered[min(i + 1, m - 1)] - ordered[i]) * (pos - i)

    lower, upper = min_samples(q, level)
    needs = None if r is not None and s is not None else max((x for x in (lower, upper) if x is not None),
                                                             default=None)
    extrapolate = (lambda k: _from_sorted(ordered, q, level, noun, math.ceil(m * k))) if m else None
    return Interval(at(r), at(s), level, ORDER_STATISTICS, n, noun=noun, needs_n=needs, extrapolate=extrapolate)


def _check_q_level(q: float, level: float) -> None:
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile must be in [0, 100], got {q!r}", fix="pass e.g. 99 for p99")
    if not 0 < level < 1:
        raise ConfigError(f"confidence level {level!r} is not in (0, 1)", fix="pass e.g. 0.95")


# -- bootstrap ----------------------------------------------------------------------------------

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


def bootstrap_interval(statistic: Statistic, *samples: Sequence[float], level: float = LEVEL,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, noun: str = "samples",
                       grows: Sequence[int] | None = None) -> Interval:
    """Percentile bootstrap of ``statistic`` of one or two samples, resampled independently with a
    seeded generator (same input, same interval). A sample with fewer than BOOTSTRAP_MIN_N values
    gives an unbounded interval. ``grows``: indices of the samples a suite can extend (for
    :func:`more_to_decide`; default all)."""
    if not 1 <= len(samples) <= 2:
        raise ConfigError(f"the bootstrap takes one or two samples, got {len(samples)}", fix="pass a, or a and b")
    if not 0 < level < 1 or resamples < 100:
        raise ConfigError(f"bootstrap level {level} / resamples {resamples} out of range",
                          fix="use 0 < level < 1 and at least 100 resamples")
    arrays = [np.asarray([v for v in s if not math.isnan(v)], dtype=float) for s in samples]
    sizes = [len(a) for a in arrays]
    name = STATISTIC_NAMES.get(statistic, getattr(statistic, "__name__", "statistic"))
    method = f"bootstrap of the {name} ({resamples} resamples, seed {seed})"
    n2 = sizes[1] if len(sizes) == 2 else None
    if min(sizes) < BOOTSTRAP_MIN_N:
        return Interval(None, None, level, method, sizes[0], noun=noun, n2=n2, needs_n=BOOTSTRAP_MIN_N)
    rng = np.random.default_rng(seed)
    stats = statistic(*(a[rng.integers(0, len(a), size=(resamples, len(a)))] for a in arrays))
    stats = stats[np.isfinite(stats)]
    if len(stats) < resamples // 2:  # e.g. a zero median in a denominator
        return Interval(None, None, level, method, sizes[0], noun=noun, n2=n2)
    lo, hi = (float(x) for x in np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2]))
    estimate = float(statistic(*(a[None, :] for a in arrays))[0])
    return Interval(lo, hi, level, method, sizes[0], noun=noun, n2=n2,
                    extrapolate=_shrinking(lo, hi, min(max(estimate, lo), hi), level, sizes,
                                           list(range(len(sizes))) if grows is None else list(grows)))


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
    level = max(1 - (1 - num.level) - (1 - den.level), 0.01)
    extrapolate = None
    if num.extrapolate is not None and den.extrapolate is not None:
        ne, de = num.extrapolate, den.extrapolate
        extrapolate = lambda k: ratio_interval(ne(k), de(k), den_floor=den_floor)  # noqa: E731
    needs = max((x for x in (num.needs_n, den.needs_n) if x is not None), default=None)
    return Interval(lo, hi, level, f"ratio of {num.method} bounds (Bonferroni)", num.n,
                    noun=num.noun, n2=den.n, needs_n=needs, extrapolate=extrapolate)


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
