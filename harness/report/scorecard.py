"""The report's scorecard (issue 37): what a release manager reads first, on one screen.

One row per checklist item that has a verdict, in the checklist's order: its status (the worst of
its verdicts: an item recorded by several suites, as nothing-lost is, is as good as its worst),
that verdict's figure and interval drawn against the threshold in the threshold's own units (a
bullet chart: the passing side shaded green, the failing side red, the interval a bar, the figure
a dot, the threshold a line), the margin to the threshold, and the suite. Above it, one line when
the test machine was CPU-starved while any verdict was measured, naming the items it touched
(harness/checks/machine.py's evidence), so a starved run says so before anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from markupsafe import Markup, escape

from harness.checks.verdict import Status, Verdict
from harness.report.suites import suite_label
from harness.stats.intervals import brackets

_RANK = {Status.FAIL: 0, Status.ERROR: 1, Status.INCONCLUSIVE: 2, Status.PASS: 3}
WIDTH, HEIGHT = 220, 26


@dataclass(frozen=True)
class ScoreRow:
    item: str
    title: str
    status: str
    figure: str            # "0.8884 s" or "—"
    interval: str          # "[0.874-0.889, bounds]" or "" (an exact count)
    threshold: str         # "<= 3 s" or "—"
    margin: str | None     # "70 % inside" / "12 % beyond"
    chart: Markup | None
    suites: str            # the suites that recorded it
    verdicts: int
    machine: bool          # measured while the test machine was starved


def headline(verdicts: Sequence[Verdict]) -> Verdict:
    """The verdict an item is shown by: its worst (fail, error, inconclusive, pass), the first such."""
    return min(verdicts, key=lambda v: _RANK.get(v.status, 9))


def starved(v: Verdict) -> bool:
    machine = (v.evidence or {}).get("machine") or {}
    return bool(machine.get("starved") or machine.get("gated"))


def scorecard(verdicts: Sequence[Verdict], order: Iterable[str] = ()) -> tuple[list[ScoreRow], str | None]:
    """The rows in ``order`` (checklist item ids; items not in it after, in their first verdict's
    order) and the starved-machine line (None: the machine did not touch any verdict)."""
    by_item: dict[str, list[Verdict]] = {}
    for v in verdicts:
        by_item.setdefault(v.item, []).append(v)
    order = list(order)
    items = [i for i in order if i in by_item] + [i for i in by_item if i not in order]
    rows = []
    for item in items:
        vs = by_item[item]
        v = headline(vs)
        suites = ", ".join(dict.fromkeys(suite_label(x.test) for x in vs if x.test)) or "—"
        rows.append(ScoreRow(item=item, title=v.title, status=v.status.value,
                             figure="—" if v.measured is None else f"{_num(v.measured)} {v.unit}".strip(),
                             interval=brackets(v.interval),
                             threshold="—" if v.threshold is None else f"{v.op} {_num(v.threshold)} {v.unit}".strip(),
                             margin=margin(v), chart=bullet(v), suites=suites, verdicts=len(vs),
                             machine=any(starved(x) for x in vs)))
    touched = [r for r in rows if r.machine]
    note = None
    if touched:
        changed = [r.item for r in touched if r.status != "pass"]
        note = (f"The test machine was CPU-starved while {len(touched)} of {len(rows)} items were measured "
                f"({', '.join(r.item for r in touched)})"
                + (f"; {', '.join(changed)} undecided for it" if changed else "")
                + ": a starved machine can only make figures worse, so a pass stands, but a figure near its "
                  "limit may be the machine's, not the cluster's (see Test machine health).")
    return rows, note


def _num(x: float) -> str:
    return f"{x:.4g}"


def _figure(v: Verdict) -> str:
    if v.measured is None:
        return "—"
    return f"{_num(v.measured)} {v.unit} {brackets(v.interval)}".strip()


def margin(v: Verdict) -> str | None:
    """How far the figure is inside (or beyond) its threshold, as a share of the threshold."""
    if v.measured is None or v.threshold is None or v.threshold == 0 or v.op not in ("<", "<=", ">", ">="):
        return None
    share = (v.threshold - v.measured) / abs(v.threshold)
    if v.op in (">", ">="):
        share = -share
    return f"{abs(share) * 100:.0f} % {'inside' if share >= 0 else 'beyond'}"


def bullet(v: Verdict) -> Markup | None:
    """The figure, its interval and the threshold on one axis in the threshold's units (inline SVG)."""
    if v.measured is None or v.threshold is None or v.op not in ("<", "<=", ">", ">="):
        return None
    iv = v.interval or {}
    lo, hi = iv.get("lo"), iv.get("hi")
    values = [x for x in (v.measured, v.threshold, lo, hi) if x is not None]
    top = max(values) * 1.15 or 1.0
    bottom = min(0.0, min(values))
    if v.threshold == 0 and v.op in ("<", "<="):   # an exact count held to 0: show its passing side too
        top = max(top, 1.0)
        bottom = -0.25 * top
    span = top - bottom or 1.0

    def x(val: float) -> float:
        return round(4 + (val - bottom) / span * (WIDTH - 8), 1)

    below_ok = v.op in ("<", "<=")
    t = x(v.threshold)
    good = (4, t) if below_ok else (t, WIDTH - 4)
    bad = (t, WIDTH - 4) if below_ok else (4, t)
    parts = [f'<rect class="zone good" x="{good[0]}" y="4" width="{max(0, good[1] - good[0]):.1f}" height="18" fill="#dcfce7"/>',
             f'<rect class="zone bad" x="{bad[0]}" y="4" width="{max(0, bad[1] - bad[0]):.1f}" height="18" fill="#fee2e2"/>']
    if v.interval:   # an exact count has none
        a = x(lo if lo is not None else bottom)
        b = x(hi if hi is not None else top)
        faint = ' opacity="0.5"' if lo is None or hi is None else ""   # one side unbounded
        parts.append(f'<rect class="interval" x="{a}" y="10" width="{max(1.0, b - a):.1f}" height="6" '
                     f'fill="#6b7280"{faint}/>')
    colour = {"pass": "#16a34a", "fail": "#dc2626", "inconclusive": "#d97706"}.get(v.status.value, "#7c3aed")
    parts.append(f'<circle class="figure" cx="{x(v.measured)}" cy="13" r="4" fill="{colour}"/>')
    parts.append(f'<line class="threshold" x1="{t}" y1="1" x2="{t}" y2="25" stroke="#111827" stroke-width="2"/>')
    label = f"{v.item}: {_figure(v)} against {v.op} {_num(v.threshold)} {v.unit}"
    return Markup(f'<svg class="bullet" role="img" aria-label="{escape(label)}" width="{WIDTH}" height="{HEIGHT}" '
                  f'viewBox="0 0 {WIDTH} {HEIGHT}" data-figure="{v.measured}" data-threshold="{v.threshold}" '
                  f'data-op="{escape(v.op)}">' + "".join(parts) + "</svg>")


__all__ = ["ScoreRow", "bullet", "headline", "margin", "scorecard", "starved"]
