"""The :class:`Interval` every timing verdict carries, and how a threshold is decided on it
(:func:`decide`, :func:`more_to_decide`). The methods that build intervals are in
``harness/stats/intervals.py`` (which re-exports this module); error control in ``levels.py``.

An interval's two bounds may hold at different one-sided levels (``alpha_lo``, ``alpha_hi``: the
chance that the true value lies below ``lo``, above ``hi``): the bound that can make a verdict
fail is computed at its wrong-fail share, the one that can make it pass at its wrong-pass share
(harness/checks/verdict.py orients it through :meth:`Interval.at`). A leaf: stdlib, levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

from harness.errors import ConfigError
from harness.stats.levels import percent

DECIDE_FACTOR = 10           # "about N more would decide" looks this far: beyond, "more than 10x"

Decision = Literal["pass", "fail"]


@dataclass(frozen=True)
class Interval:
    """Where a measured quantity lies: ``lo``..``hi`` at confidence ``level`` by ``method`` from
    ``n`` samples (``n2``: the second window of a two-sample statistic). A bound of None is
    unbounded: too few samples for it (``needs_n`` says how many give both bounds).
    ``alpha_lo`` / ``alpha_hi``: each bound's own one-sided miss chance when they differ (None:
    ``(1 - level) / 2`` each); ``level`` is then ``1 - alpha_lo - alpha_hi``."""

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
    alpha_lo: float | None = None
    alpha_hi: float | None = None
    # the same samples' interval at other one-sided levels (alpha_lo, alpha_hi); None: it has no
    # probability to re-spend (a resolution bound) or its builder cannot recompute it
    relevel: Callable[[float, float], Interval] | None = field(default=None, compare=False, repr=False)
    # serial dependence allowed for (harness/stats/dependence.py: tau, n_eff, measured, lag1,
    # method); None: independent draws assumed
    dependence: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise ConfigError(f"interval lower bound {self.lo} is above its upper bound {self.hi}",
                              fix="pass the bounds in order (lo <= hi)")
        if not 0 < self.level <= 1:
            raise ConfigError(f"confidence level {self.level} is not in (0, 1]", fix="pass e.g. 0.95")
        for a in (self.alpha_lo, self.alpha_hi):
            if a is not None and not 0 <= a < 0.5:
                raise ConfigError(f"one-sided miss chance {a} is not in [0, 0.5)", fix="pass e.g. 0.025")

    @property
    def miss_lo(self) -> float:
        """The chance the true value lies below ``lo`` (one-sided)."""
        return (1 - self.level) / 2 if self.alpha_lo is None else self.alpha_lo

    @property
    def miss_hi(self) -> float:
        return (1 - self.level) / 2 if self.alpha_hi is None else self.alpha_hi

    @property
    def symmetric(self) -> bool:
        return self.level >= 1 or math.isclose(self.miss_lo, self.miss_hi, rel_tol=1e-9, abs_tol=1e-15)

    def at(self, alpha_lo: float, alpha_hi: float) -> Interval:
        """The same samples' interval with its lower bound at one-sided miss chance ``alpha_lo``
        and its upper at ``alpha_hi``; itself when it cannot be recomputed (:attr:`relevel` None)."""
        return self if self.relevel is None else self.relevel(alpha_lo, alpha_hi)

    @property
    def bounded(self) -> bool:
        return self.lo is not None and self.hi is not None

    @property
    def sizes(self) -> str:
        text = f"n={self.n}" if self.n2 is None else f"n={self.n}+{self.n2}"
        dep = self.dependence
        if dep and dep.get("measured") and dep["tau"] > 1:
            text += f" ~ {dep['n_eff']} effective (serial dependence, tau {dep['tau']:.3g})"
        return text

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
    def confidence(self) -> str:
        """``95 %`` (both sides alike), ``lower 99.985 %, upper 99.5 %`` (one-sided each), or "" (bounds)."""
        if self.level >= 1:
            return ""
        if self.symmetric:
            return f"{self.level * 100:.6g} %"
        return f"lower {percent(self.miss_lo)}, upper {percent(self.miss_hi)}"

    @property
    def how(self) -> str:
        """``95 %, order statistics, n=412`` (a resolution bound states no level)."""
        level = f"{self.confidence}, " if self.confidence else ""
        need = f", both bounds need n >= {self.needs_n}" if self.needs_n is not None and not self.bounded else ""
        return f"{level}{self.method}, {self.sizes}{need}"

    def describe(self, unit: str = "") -> str:
        """``480-560 ms (95 %, order statistics, n=412)``."""
        return f"{self.span(unit)} ({self.how})"

    def brackets(self) -> str:
        """The short form shown beside a figure: ``[450-510, 95 %]``, ``[450-510, 99.985/99.5 %]``."""
        if self.level >= 1:
            level = "bounds"
        elif self.symmetric:
            level = f"{self.level * 100:.6g} %"
        else:
            level = f"{(1 - self.miss_lo) * 100:.6g}/{(1 - self.miss_hi) * 100:.6g} %"
        return f"[{self.span(digits=3)}, {level}]"

    def scaled(self, factor: float) -> Interval:
        """The same interval in other units (factor > 0), e.g. Gbit/s -> fraction of line rate."""
        if factor <= 0:
            raise ConfigError(f"scale factor {factor} must be positive", fix="divide by a positive rate")
        ext, rel = self.extrapolate, self.relevel
        return replace(self, lo=None if self.lo is None else self.lo * factor,
                       hi=None if self.hi is None else self.hi * factor,
                       extrapolate=None if ext is None else (lambda k: ext(k).scaled(factor)),
                       relevel=None if rel is None else (lambda a, b: rel(a, b).scaled(factor)))

    def to_dict(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi, "level": self.level, "method": self.method, "n": self.n,
                "n2": self.n2, "noun": self.noun, "needs_n": self.needs_n, "alpha_lo": self.miss_lo,
                "alpha_hi": self.miss_hi, **({} if self.dependence is None else {"dependence": self.dependence})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interval:
        """Back from :meth:`to_dict` (results.json, old files without alpha_lo/alpha_hi too); it
        no longer extrapolates nor re-levels."""
        return cls(data["lo"], data["hi"], data["level"], data["method"], data["n"], noun=data.get("noun", "samples"),
                   n2=data.get("n2"), needs_n=data.get("needs_n"), alpha_lo=data.get("alpha_lo"),
                   alpha_hi=data.get("alpha_hi"), dependence=data.get("dependence"))


def brackets(data: dict[str, Any] | None) -> str:
    """``[450-510, 95 %]`` from an interval's dict, "" for none: what reports show beside a figure."""
    return "" if not data else Interval.from_dict(data).brackets()


def tails(level: float, alpha_lo: float | None, alpha_hi: float | None) -> tuple[float, float]:
    """Each bound's one-sided miss chance: given, else ``(1 - level) / 2`` (every interval builder)."""
    if not 0 < level < 1:
        raise ConfigError(f"confidence level {level!r} is not in (0, 1)", fix="pass e.g. 0.95")
    a_lo = (1 - level) / 2 if alpha_lo is None else alpha_lo
    a_hi = (1 - level) / 2 if alpha_hi is None else alpha_hi
    if not (0 < a_lo < 0.5 and 0 < a_hi < 0.5):
        raise ConfigError(f"one-sided miss chances {a_lo!r}, {a_hi!r} are not in (0, 0.5)", fix="pass e.g. 0.025")
    return a_lo, a_hi


def two_sided(alpha_lo: float, alpha_hi: float) -> float:
    """The level an interval with these one-sided miss chances holds at (union bound)."""
    return min(max(1 - alpha_lo - alpha_hi, 1e-9), 1.0)


def decide(interval: Interval, threshold: float, holds: Callable[[float], bool]) -> Decision | None:
    """"pass" when every point of the interval holds, "fail" when none does (an unbounded side
    reaches infinity either way), else None: the interval straddles the threshold. So a pass needs
    the bound on the failing side of the threshold (the upper one where values must be small), the
    one whose level is the wrong-pass chance; the other bound may be missing (too few samples for
    its stricter wrong-fail level) without making the pass any less sure."""
    lo = -math.inf if interval.lo is None else interval.lo
    hi = math.inf if interval.hi is None else interval.hi
    lo_ok, hi_ok = holds(lo), holds(hi)
    if lo_ok and hi_ok:
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
    sizes = _trial_sizes((DECIDE_FACTOR - 1) * n)

    def decides(i: int) -> bool:
        return decide(interval.extrapolate((n + sizes[i]) / n), threshold, holds) is not None  # type: ignore[misc]

    # galloping, then bisection: the extrapolated interval narrows as n grows, so the first size
    # that decides is found in ~2 log2(len(sizes)) tries
    undecided, i = -1, 0
    while i < len(sizes) and not decides(i):
        undecided, i = i, 2 * i + 1
    if i >= len(sizes):
        if undecided == len(sizes) - 1 or not decides(len(sizes) - 1):
            return None
        i = len(sizes) - 1
    while i - undecided > 1:
        mid = (undecided + i) // 2
        undecided, i = (undecided, mid) if decides(mid) else (mid, i)
    return sizes[i]


def _trial_sizes(most: int, growth: float = 1.05) -> list[int]:
    """1, 2, ... then ~5 % apart up to ``most``: at most ~150 sizes, however many samples."""
    sizes, x = [], 1.0
    while int(x) < most:
        if not sizes or int(x) > sizes[-1]:
            sizes.append(int(x))
        x = max(x * growth, x + 1)
    return sizes + [most]
