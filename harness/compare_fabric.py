"""The fabric items' comparison figures (docs/compare.md), beside harness/compare.py which judges the rest:

- 6.1.5's two ratios within each run, the storm side over the calm side (:func:`window_ratio`): the p99
  round trip (the calm p99 at no less than the loopback floor) and the median TCP bulk flow; each run's
  interval is the ratio of the two sides' order-statistic bounds (half of the level to each, as the
  verdict's p99 ratio), and harness/compare.py combines the two runs' by MOVER;
- nic-flap's recovery time (:func:`recovery_figure`): each run's time is known only to within its
  probe transfers (bounds from measurement resolution, no probability), so the two runs' bounds are
  compared, not a sample: the difference lies in [candidate low - baseline high, candidate high -
  baseline low] for certain. A run whose verdict holds several recoveries counts its slowest.
"""

from __future__ import annotations

from typing import Any

from harness.compare_samples import Recovery, RttRatio
from harness.stats import nearest_rank
from harness.stats.interval import Interval
from harness.stats.intervals import RESOLUTION, percentile_interval, ratio_interval


def window_ratio(sample: RttRatio, q: float, a: float, noun: str) -> tuple[float | None, Interval]:
    """One run's q-th percentile during the storm over the calm one (no lower than the floor), and its
    interval, each bound at one-sided ``a`` (``a / 2`` to each side's percentile)."""
    during, calm = nearest_rank(sample.during, q), max(nearest_rank(sample.calm, q), sample.floor)
    iv = ratio_interval(percentile_interval(sample.during, q, alpha_lo=a / 2, alpha_hi=a / 2, noun=noun),
                        percentile_interval(sample.calm, q, alpha_lo=a / 2, alpha_hi=a / 2, noun=noun),
                        den_floor=sample.floor)
    return (during / calm if calm > 0 else None), iv


def _s(x: float | None, sign: str = "") -> str:
    return "?" if x is None else f"{x:{sign}.3g}"


def recovery_figure(base: Recovery, cand: Recovery, tolerance: float) -> dict[str, Any]:
    """The FigureResult fields (baseline, candidate, ratio, interval, status, reason, difference) of the
    recovery times' comparison: regressed when the candidate's lower bound exceeds the baseline's upper
    bound by more than ``tolerance`` s; improved when its upper bound is below the baseline's lower
    bound; within tolerance when the whole difference is at most ``tolerance``; else inconclusive."""
    (b_lo, b_hi), (c_lo, c_hi) = base.slowest(), cand.slowest()
    lo = None if b_hi is None else c_lo - b_hi
    hi = None if c_hi is None else c_hi - b_lo
    iv = Interval(lo, hi, 1.0, f"difference of {RESOLUTION} bounds", len(cand.bounds), noun="flaps",
                  n2=len(base.bounds))
    several = any(len(r.bounds) > 1 for r in (base, cand))
    what = "the slowest of each run's recoveries" if several else "recovery"

    def side(name: str, a: float, b: float | None) -> str:
        return f"{name} {_s(a)} to {_s(b)} s" if b is not None else f"{name} not back, later than {_s(a)} s"

    said = (f"{what}: {side('candidate', c_lo, c_hi)} against {side('baseline', b_lo, b_hi)} after the last flap: "
            f"{_s(lo, '+')} to {_s(hi, '+')} s longer, allowed <= +{tolerance:g} s")
    if lo is not None and lo > tolerance:
        status = "regressed"
    elif hi is not None and hi < 0:
        status = "improved"
    elif hi is not None and hi <= tolerance:
        status = "within tolerance"
    else:
        status = "inconclusive"
        unbounded = [n for n, x in (("candidate", c_hi), ("baseline", b_hi)) if x is None]
        said += ("; undecided: " + (f"the {unbounded[0]}'s KV bandwidth was not back by its last probe transfer, "
                                    "so its recovery has no upper bound (a run that probes until it is back would "
                                    "bound it)" if unbounded else
                                    "each run's time is known only to within its probe transfers, and the "
                                    "difference straddles the tolerance: a shorter probe transfer (finer "
                                    "resolution) in both runs would decide it; more flaps would not, as each "
                                    "recovery keeps its own resolution"))
    point = None if c_hi is None or b_hi is None else c_hi - b_hi   # the verdicts' values: recovered by
    return {"baseline": b_hi, "candidate": c_hi, "ratio": None, "interval": iv, "status": status, "reason": said,
            "difference": point}


def change_cells(kind: str, difference: float | None, interval: Interval | None) -> tuple[str, str] | None:
    """The terminal table's change and interval cells of a figure judged on a difference (a share's
    points, a recovery's seconds); None for a ratio."""
    def fmt(x: float | None, scale: float) -> str:
        return "?" if x is None else f"{x * scale:+.2g}"

    unit, scale = {"max_rise": ("pt", 100.0), "max_rise_s": ("s", 1.0)}.get(kind, (None, 0.0))
    if unit is None:
        return None
    iv = "-" if interval is None else f"[{fmt(interval.lo, scale)}, {fmt(interval.hi, scale)}] {unit}"
    return ("?" if difference is None else f"{fmt(difference, scale)} {unit}"), iv
