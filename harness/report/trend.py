"""The report's trend (issue 36 item 4): each item's headline figure in this run beside the same
figure in the last runs of the same cluster, read from the reports folder the run is written to
(harness/history.py's index: every ``<run>/results.json`` there, so it cannot go stale).

One small chart per item that an earlier run also measured: the runs oldest first and this run
last, each figure a dot with its interval as a grey bar, the threshold as a line, this run's dot
green or red as it holds or not. A trend is evidence for a reader, not a verdict: the rollout gate
is ``--baseline`` (harness/compare.py), which states its error rates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from markupsafe import Markup, escape

from harness.checks.verdict import Verdict
from harness.history import Entry, index
from harness.report.plots import PALETTE, Axes

log = logging.getLogger(__name__)

MOST_RUNS = 12   # this run and the 11 before it


@dataclass(frozen=True)
class TrendPoint:
    run: str                  # run id, or "this run"
    label: str                # label, commit or the run id's date
    value: float | None
    lo: float | None
    hi: float | None


@dataclass(frozen=True)
class Trend:
    item: str
    key: str
    unit: str
    op: str
    threshold: float | None
    points: tuple[TrendPoint, ...]   # oldest first, this run last

    @property
    def figure(self) -> str:
        return f"{self.item}.{self.key}"


def past_runs(reports: Path, cluster: str | None, run_id: str, most: int = MOST_RUNS - 1) -> list[Entry]:
    """The ``most`` newest readable runs of ``cluster`` under ``reports`` before ``run_id``, oldest first;
    [] when the folder cannot be read (a trend is never worth failing a report for)."""
    if not cluster:
        return []
    try:
        entries = index(reports)
    except Exception as exc:  # noqa: BLE001 -- the report is written without a trend, saying why in the log
        log.info("no trend: %s", exc)
        return []
    same = [e for e in entries if e.unreadable is None and e.cluster == cluster and e.run_id != run_id]
    return list(reversed(same[:most]))


def _headline(v: Verdict) -> dict[str, Any] | None:
    """The verdict's headline measurement (its head cause's key, else its first), as results.json has it."""
    measurements = [m for m in v.evidence.get("measurements") or () if isinstance(m, dict)]
    key = v.cause.get("key")
    return next((m for m in measurements if m.get("key") == key), measurements[0] if measurements else None)


def trends(verdicts: Sequence[Verdict], past: Sequence[Entry]) -> list[Trend]:
    """One trend per item whose headline figure an earlier run measured too (the item's first verdict,
    as history.py reads each run)."""
    out, seen = [], set()
    for v in verdicts:
        if v.item in seen:
            continue
        seen.add(v.item)
        m = _headline(v)
        if m is None or m.get("key") is None:
            continue
        figure = f"{v.item}.{m['key']}"
        before = [TrendPoint(e.run_id, e.label or e.commit or e.run_id[:15], *e.measured[figure])
                  for e in past if figure in e.measured and isinstance(e.measured[figure][0], (int, float))]
        if not before:
            continue
        iv = m.get("interval") if isinstance(m.get("interval"), dict) else {}
        now = TrendPoint("this run", "this run", m.get("value"), iv.get("lo"), iv.get("hi"))
        out.append(Trend(v.item, m["key"], str(m.get("unit") or ""), str(m.get("op") or ""), m.get("threshold"),
                         (*before, now)))
    return out


def _holds(t: Trend, value: float) -> bool | None:
    if t.threshold is None or not t.op:
        return None
    return {"<": value < t.threshold, "<=": value <= t.threshold, ">": value > t.threshold,
            ">=": value >= t.threshold}.get(t.op)


def trend_chart(t: Trend, cluster: str) -> Markup:
    """The figure run by run: a dot per run, its interval a grey bar, the threshold a red line."""
    pts = t.points
    tops = [x for p in pts for x in (p.value, p.hi, p.lo) if isinstance(x, (int, float))]
    ymax = (max(tops + [t.threshold or 0.0]) or 1.0) * 1.15   # counts at 0 every run: a 0-1 axis, not 0-1e-9
    ax = Axes(f"trend-{t.item}", f"{t.item} {t.key}: the last {len(pts)} runs of {cluster}",
              "run (oldest first, this run last)", t.unit, (-0.5, len(pts) - 0.5), (0, ymax), width=640, height=200)
    for i, p in enumerate(pts):
        if isinstance(p.lo, (int, float)) or isinstance(p.hi, (int, float)):
            lo = p.lo if isinstance(p.lo, (int, float)) else 0.0
            hi = p.hi if isinstance(p.hi, (int, float)) else ymax
            ax.body.append(f'<line class="interval" x1="{ax.sx(i):.1f}" x2="{ax.sx(i):.1f}" y1="{ax.sy(lo):.1f}" '
                           f'y2="{ax.sy(min(hi, ymax)):.1f}" stroke="#9ca3af" stroke-width="4">'
                           f'<title>{escape(p.label)}: interval {lo:.4g}-{hi:.4g}</title></line>')
        ax.body.append(f'<text x="{ax.sx(i):.1f}" y="{ax.mt + ax.ph + 15}" text-anchor="middle" class="tick">'
                       f'{escape(p.label[-10:])}</text>')
    if t.threshold is not None:
        ax.hline(float(t.threshold), f"threshold {t.op} {float(t.threshold):.4g} {t.unit}".strip(), "#dc2626")
    ax.series([(i, p.value) for i, p in enumerate(pts[:-1])], "earlier runs", PALETTE[0])
    last = pts[-1]
    if isinstance(last.value, (int, float)):
        ax.mark(len(pts) - 1, float(last.value), f"this run: {last.value:.4g} {t.unit}".strip(), _holds(t, last.value))
    return ax.render(x_ticks=False)


def trend_section(verdicts: Sequence[Verdict], past: Sequence[Entry], cluster: str) -> list[tuple[Trend, Markup]]:
    """(trend, chart) per item an earlier run of this cluster measured too."""
    return [(t, trend_chart(t, cluster)) for t in trends(verdicts, past)]


__all__ = ["MOST_RUNS", "Trend", "TrendPoint", "past_runs", "trend_chart", "trend_section", "trends"]
