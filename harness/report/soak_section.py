"""The report's Soak section (issue 27): the fault timeline with every fault's verdict, the faults
by kind, the per-window 6.2 figures, the leak charts and every fault in a table. Drawn from
``RunResult.soak`` (written by suites/test_soak.py), tolerant of older or partial dicts: a dry
run's, with only its ``schedule``, draws the planned timeline."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from markupsafe import Markup, escape

from harness.report.plots import PALETTE, Axes, ticks

log = logging.getLogger(__name__)

STATUSES = ("recovered", "not recovered", "undecided", "not injected")
COUNTS = ("scheduled", *STATUSES)
COLOURS = {"recovered": "#16a34a", "not recovered": "#dc2626", "undecided": "#d97706", "not injected": "#9ca3af",
           "planned": "#2563eb"}
BADGES = {"recovered": "pass", "not recovered": "fail", "undecided": "inconclusive", "not injected": "not-run",
          "planned": "not-run", "pass": "pass", "fail": "fail", "inconclusive": "inconclusive", "error": "error"}
WINDOW_COLOURS = {"pass": "#16a34a", "fail": "#dc2626", "inconclusive": "#d97706"}
LEAK_COLUMNS = ("t_rel_s", "rss_mb", "fds", "threads", "kv_blocks_used")
LEAK_PANELS = (("rss_mb", "Resident memory (RSS) per worker", "MB"), ("fds", "Open file descriptors per worker", "fds"),
               ("threads", "Threads per worker", "threads"), ("kv_blocks_used", "KV blocks in use per worker", "blocks"))
MAX_POINTS = 300  # per drawn line
MAX_LANES = 24    # more workers than this: only the faulted ones get a lane


@dataclass
class SoakView:
    """What the template draws; every key always present (the template runs with StrictUndefined)."""

    error: str = ""
    dry_run: bool = False
    seed: Any = None
    duration_s: float | None = None
    replay: str = ""
    faults_per_min: Any = None
    max_role_share: Any = None
    requests: Any = None
    started: float | None = None
    load_s: float | None = None
    scheduled: int = 0
    injected: int | None = None
    kinds: list[str] = field(default_factory=list)
    timeline: Markup | None = None
    by_kind: list[dict[str, Any]] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)
    windows: list[dict[str, Any]] = field(default_factory=list)
    leak_plots: list[Markup] = field(default_factory=list)
    leak_legend: list[tuple[str, str, bool]] = field(default_factory=list)   # (colour, label, dashed)
    leak_notes: list[str] = field(default_factory=list)
    leak_samples: str = ""
    faults: list[dict[str, Any]] = field(default_factory=list)


def soak_view(soak: Mapping[str, Any] | None) -> SoakView | None:
    """The section's data, or None where the run was no soak (the section is then left out)."""
    if not soak:
        return None
    try:
        return _build(soak)
    except Exception as exc:  # noqa: BLE001 -- a malformed soak dict must not cost the whole report
        log.warning("soak section not drawn: %s", exc, exc_info=True)
        return SoakView(error=f"{type(exc).__name__}: {exc}")


def _build(soak: Mapping[str, Any]) -> SoakView:
    schedule = _dict(soak.get("schedule"))
    outcomes = [o for o in soak.get("outcomes") or [] if isinstance(o, Mapping)]
    dry = not (outcomes or soak.get("windows") or soak.get("leaks") or soak.get("requests") is not None)
    faults = merge_faults(schedule, outcomes, dry)
    started, ended = _float(soak.get("started")), _float(soak.get("load_ended"))
    view = SoakView(dry_run=dry, seed=schedule.get("seed"), duration_s=_float(schedule.get("duration_s")),
                    faults_per_min=schedule.get("faults_per_min"), max_role_share=schedule.get("max_role_share"),
                    requests=soak.get("requests"), started=started,
                    load_s=None if started is None or ended is None else ended - started,
                    kinds=[str(k) for k in schedule.get("kinds") or soak.get("kinds") or []],
                    leak_samples=str(soak.get("leak_samples") or ""), faults=faults)
    view.replay = replay_options(view.seed, view.duration_s)
    view.scheduled = len(faults)
    if not dry:
        view.injected = sum(f["status"] != "not injected" for f in faults)
    view.by_kind, view.totals = by_kind_rows(soak.get("by_kind"), faults, dry)
    view.windows = window_rows(soak.get("windows"))
    inventory = [(str(w[0]), str(w[1]) if len(w) > 1 else "") for w in schedule.get("inventory") or []
                 if isinstance(w, Sequence) and not isinstance(w, str) and w]
    span = max([view.duration_s or 0.0, view.load_s or 0.0, 1.0]
               + [f["start_s"] + (f["hold_s"] or 0.0) for f in faults if f["start_s"] is not None]
               + [f["until_s"] for f in faults if f["until_s"] is not None]
               + [w["end_s"] for w in view.windows if w["end_s"] is not None and not w["whole"]])
    view.timeline = timeline_svg(faults, inventory, view.windows, span, dry)
    leaks = _dict(soak.get("leaks"))
    if leaks:
        view.leak_plots, view.leak_legend = leak_charts(leaks)
        view.leak_notes = leak_notes(leaks)
    return view


def merge_faults(schedule: Mapping[str, Any], outcomes: Sequence[Mapping[str, Any]], dry: bool) -> list[dict[str, Any]]:
    """One row per fault, numbered from 1: the schedule's plan joined with its outcome (schedule
    indexes count from 0, outcome indexes from 1; both are checked against kind and target)."""
    by_index: dict[Any, Mapping[str, Any]] = {o.get("index"): o for o in outcomes}
    used: set[int] = set()
    rows = []
    for k, f in enumerate(s for s in schedule.get("faults") or [] if isinstance(s, Mapping)):
        idx = f.get("index", k)
        outcome = next((o for o in (by_index.get(_int(idx, k) + 1), by_index.get(idx)) if o is not None
                        and o.get("kind") == f.get("kind") and o.get("target") == f.get("target")
                        and id(o) not in used), None)
        if outcome is not None:
            used.add(id(outcome))
        rows.append(_row(_int(idx, k) + 1, f, outcome or {}, dry))
    for o in outcomes:
        if id(o) not in used:
            rows.append(_row(_int(o.get("index"), len(rows) + 1), {}, o, dry))
    return sorted(rows, key=lambda r: (r["start_s"] is None, r["start_s"] or 0.0, r["index"]))


def _row(index: int, plan: Mapping[str, Any], o: Mapping[str, Any], dry: bool) -> dict[str, Any]:
    planned = _float(o.get("planned_offset_s", plan.get("offset_s")))
    actual = _float(o.get("offset_s")) if o else None
    hold = _float(o.get("hold_s", plan.get("hold_s")))
    status = "planned" if dry else str(o.get("status") or "not injected")
    why = str(o.get("why") or ("" if dry or o else "no outcome was recorded for this fault"))
    return {"index": index, "kind": str(o.get("kind") or plan.get("kind") or "?"),
            "target": str(o.get("target") or plan.get("target") or "?"), "role": str(plan.get("role") or ""),
            "planned_s": planned, "offset_s": actual, "start_s": actual if actual is not None else planned,
            "hold_s": hold, "until_s": _float(plan.get("planned_until_s")), "status": status,
            "badge": BADGES.get(status, "not-run"), "why": why, "reschedule_s": _float(o.get("reschedule_s")),
            "back_after_healthy_s": _float(o.get("back_after_healthy_s")), "detail": str(o.get("detail") or "")}


def by_kind_rows(given: Any, faults: Sequence[Mapping[str, Any]],
                 dry: bool) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per fault kind its counts (the verdict's, else counted from the faults) and the totals."""
    counts: dict[str, dict[str, int]] = {}
    if isinstance(given, Mapping) and given:
        for kind, row in given.items():
            row = _dict(row)
            counts[str(kind)] = {c: _int(row.get(c), 0) for c in COUNTS}
    else:
        for f in faults:
            row = counts.setdefault(f["kind"], dict.fromkeys(COUNTS, 0))
            row["scheduled"] += 1
            if not dry and f["status"] in row:
                row[f["status"]] += 1
    rows = [{"kind": k, **v} for k, v in sorted(counts.items())]
    return rows, {c: sum(r[c] for r in rows) for c in COUNTS}


def window_rows(windows: Any) -> list[dict[str, Any]]:
    rows = []
    for w in windows or []:
        if not isinstance(w, Mapping):
            continue
        ttft, tpot = _dict(w.get("ttft")), _dict(w.get("tpot"))
        status = str(w.get("status") or "inconclusive")
        why = [f"{name}: {m.get('reason')}" for name, m in (("TTFT", ttft), ("TPOT", tpot))
               if m.get("reason") and m.get("status") != "pass"]
        rows.append({"window": w.get("window", "?"), "whole": w.get("window") == "whole run",
                     "start_s": _float(w.get("start_s")), "end_s": _float(w.get("end_s")),
                     "requests": w.get("requests"), "left_out": w.get("left_out") or 0,
                     "status": status, "badge": BADGES.get(status, "not-run"),
                     "ttft_p50": ttft.get("p50_ms"), "ttft_p99": ttft.get("p99_ms"), "ttft_status": ttft.get("status"),
                     "tpot_p50": tpot.get("p50_ms"), "tpot_p99": tpot.get("p99_ms"), "tpot_status": tpot.get("status"),
                     "why": "; ".join(str(x) for x in why)})
    return rows


def timeline_svg(faults: Sequence[Mapping[str, Any]], inventory: Sequence[tuple[str, str]],
                 windows: Sequence[Mapping[str, Any]], span: float, dry: bool) -> Markup:
    """One lane per worker (the inventory's; only the faulted ones beyond MAX_LANES), each fault a
    bar from its start for its hold coloured by its status, its planned recovery pale after it; the
    6.2 windows as a strip on top."""
    targets = list(dict.fromkeys(f["target"] for f in faults))
    roles = dict(inventory) | {f["target"]: f["role"] for f in faults if f["role"]}
    lanes = [w for w, _ in inventory] if 0 < len(inventory) <= MAX_LANES else []
    lanes += [t for t in targets if t not in lanes]
    if len(lanes) > MAX_LANES:
        lanes = [w for w in lanes if w in targets]
    strip = [w for w in windows if not w["whole"] and w["start_s"] is not None and w["end_s"] is not None]
    width, ml, mr, lane_h, mt = 1040, 150, 170, 20, 28 + (22 if strip else 0)
    height = mt + lane_h * max(len(lanes), 1) + 40
    pw = width - ml - mr

    def sx(t: float) -> float:
        return ml + max(0.0, min(t, span)) / span * pw

    title = "Soak schedule (dry run: planned, nothing injected)" if dry else "Soak: every fault and its verdict"
    p = [f'<svg class="plot soak-timeline" data-plot="soak-timeline" data-points="{len(faults)}" role="img" '
         f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
         f'<title>{escape(title)}</title><text x="{ml}" y="15" class="axis">{escape(title)}</text>']
    bottom = mt + lane_h * max(len(lanes), 1)
    for v in ticks(0.0, span, 8):
        p.append(f'<line x1="{sx(v):.1f}" x2="{sx(v):.1f}" y1="{mt}" y2="{bottom}" stroke="#e5e7eb"/>'
                 f'<text x="{sx(v):.1f}" y="{bottom + 15}" text-anchor="middle" class="tick">{v:g}</text>')
    if strip:
        p.append(f'<text x="{ml - 6}" y="{mt - 9}" text-anchor="end" class="tick">6.2 per window</text>')
        for w in strip:
            a, b = sx(w["start_s"]), sx(w["end_s"])
            left = f"{w['left_out']} left out (VM steal bursts), " if w["left_out"] else ""
            tip = (f"window {w['window']} (+{w['start_s']:g}-{w['end_s']:g} s): {w['status']}; {w['requests']} requests, "
                   f"{left}TTFT p99 {_ms(w['ttft_p99'])}, TPOT p99 {_ms(w['tpot_p99'])}" + (f"; {w['why']}" if w["why"] else ""))
            p.append(f'<rect class="soak-window" data-status="{escape(w["status"])}" x="{a:.1f}" y="{mt - 20}" '
                     f'width="{max(b - a - 1, 1):.1f}" height="14" fill="{WINDOW_COLOURS.get(w["status"], "#9ca3af")}" '
                     f'fill-opacity="0.75"><title>{escape(tip)}</title></rect>')
            label = f"{w['window']}: {w['status']}"
            if b - a >= 6.5 * len(label):
                p.append(f'<text class="bar-tag" x="{a + 4:.1f}" y="{mt - 9}">{escape(label)}</text>')
    for i, lane in enumerate(lanes):
        y = mt + lane_h * i
        if i % 2:
            p.append(f'<rect x="{ml}" y="{y}" width="{pw}" height="{lane_h}" fill="#f9fafb"/>')
        label = f"{lane} ({roles[lane]})" if roles.get(lane) else lane
        p.append(f'<text class="tick lane" data-lane="{escape(lane)}" x="{ml - 6}" y="{y + 14}" '
                 f'text-anchor="end">{escape(label)}</text>')
    free: dict[str, float] = {}   # per lane, where the last bar or number drawn ends (numbers never overlap)
    for f in faults:
        if f["start_s"] is None or f["target"] not in lanes:
            continue
        y = mt + lane_h * lanes.index(f["target"]) + 3
        colour = COLOURS.get(f["status"], "#9ca3af")
        a, b = sx(f["start_s"]), sx(f["start_s"] + (f["hold_s"] or 0.0))
        if f["until_s"] is not None and f["until_s"] > f["start_s"] + (f["hold_s"] or 0.0):
            p.append(f'<rect class="recovery" x="{b:.1f}" y="{y + 3}" width="{max(sx(f["until_s"]) - b, 0):.1f}" '
                     f'height="{lane_h - 12}" fill="{colour}" fill-opacity="0.25"/>')
        tip = (f"#{f['index']} {f['kind']} on {f['target']}, +{_s(f['start_s'])} for {_s(f['hold_s'])}: {f['status']}"
               + (f": {f['why']}" if f["why"] else ""))
        p.append(f'<rect class="fault-bar" data-index="{f["index"]}" data-status="{escape(f["status"])}" '
                 f'data-target="{escape(f["target"])}" x="{a:.1f}" y="{y}" width="{max(b - a, 3):.1f}" '
                 f'height="{lane_h - 6}" fill="{colour}" stroke="#fff" stroke-width="0.5">'
                 f'<title>{escape(tip)}</title></rect>')
        tag = 6 * len(str(f["index"])) + 3
        if b - a >= tag + 3:   # its number on it, else left of it where that is free
            p.append(f'<text class="bar-tag" x="{a + 3:.1f}" y="{y + 11}">{f["index"]}</text>')
        elif a - tag >= free.get(f["target"], ml):
            p.append(f'<text class="tick" x="{a - 2:.1f}" y="{y + 11}" text-anchor="end">{f["index"]}</text>')
        free[f["target"]] = max(b, a + 3)
    p.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{bottom}" y2="{bottom}" stroke="#9ca3af"/>'
             f'<text x="{ml + pw / 2:.1f}" y="{height - 6}" text-anchor="middle" class="axis">seconds since the '
             f'soak&#39;s load started</text>')
    keys = ["planned"] if dry else [s for s in STATUSES if any(f["status"] == s for f in faults)] or list(STATUSES)
    legend = [(COLOURS[k], k, 1.0) for k in keys] + [("#6b7280", "planned recovery", 0.25)]
    for i, (colour, label, opacity) in enumerate(legend):
        y = mt + 4 + 16 * i
        p.append(f'<rect x="{ml + pw + 12}" y="{y - 8}" width="14" height="10" fill="{colour}" fill-opacity="{opacity}"/>'
                 f'<text x="{ml + pw + 30}" y="{y}" class="tick">{escape(label)}</text>')
    if not lanes:
        p.append(f'<text x="{ml + pw / 2:.1f}" y="{mt + 14}" text-anchor="middle" class="axis">no fault scheduled</text>')
    p.append("</svg>")
    return Markup("".join(p))


def leak_lines(series: Any, columns: Sequence[str]) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(label, rows as dicts)`` per drawn line from the leak evidence's ``series``: keyed per worker
    (rows), or per worker then per process (``{"decode-0": {"1234": rows}}``), or a list of
    ``{"worker", "pid", "rows"}``; each row a list in ``columns`` order or a dict."""
    out: list[tuple[str, list[dict[str, Any]]]] = []

    def add(label: str, rows: Any) -> None:
        if isinstance(rows, Mapping) and "rows" not in rows and not any(c in rows for c in columns):
            for sub, sub_rows in rows.items():   # per process under its worker
                add(f"{label} (pid {sub})" if str(sub).isdigit() else f"{label} {sub}", sub_rows)
            return
        if isinstance(rows, Mapping):
            rows = rows.get("rows") or []
        parsed = [dict(r) if isinstance(r, Mapping) else dict(zip(columns, r)) for r in rows or []
                  if isinstance(r, (Mapping, list, tuple))]
        out.append((label, parsed))

    if isinstance(series, Mapping):
        for key in sorted(series, key=str):
            add(str(key), series[key])
    elif isinstance(series, list):
        for entry in series:
            if isinstance(entry, Mapping):
                label = str(entry.get("worker") or entry.get("label") or "?")
                add(f"{label} (pid {entry['pid']})" if entry.get("pid") is not None else label, entry)
    return out


def leak_charts(leaks: Mapping[str, Any]) -> tuple[list[Markup], list[tuple[str, str, bool]]]:
    """Small multiples on one time axis: per quantity one panel, one line per worker (or process),
    and the harness's own RSS; a shared legend (the panels are too narrow for their own)."""
    columns = [str(c) for c in leaks.get("series_columns") or LEAK_COLUMNS]
    lines = leak_lines(leaks.get("series"), columns)
    harness = [(_float(r[0]), _float(r[1])) for r in leaks.get("harness_rss_mb") or []
               if isinstance(r, (list, tuple)) and len(r) >= 2]
    xs = [_float(r.get("t_rel_s")) for _, rows in lines for r in rows] + [t for t, _ in harness]
    x_hi = max([x for x in xs if x is not None] + [1.0])
    scale, xlabel = (60.0, "minutes") if x_hi > 6000 else (1.0, "seconds")
    legend = [(PALETTE[i % len(PALETTE)], label, i >= len(PALETTE)) for i, (label, _) in enumerate(lines)]
    panels = [(key, title, unit, [(label, colour, dashed, [(_float(r.get("t_rel_s")), _float(r.get(key))) for r in rows])
                                  for (label, rows), (colour, _, dashed) in zip(lines, legend)])
              for key, title, unit in LEAK_PANELS]
    if harness:
        panels.append(("harness_rss_mb", "The harness's own RSS", "MB", [("harness", "#111827", False, harness)]))
        legend.append(("#111827", "harness (its own panel)", False))
    plots = []
    for key, title, unit, drawn in panels:
        pts = [[(x, y) for x, y in line if x is not None] for *_, line in drawn]
        ys = [y for line in pts for _, y in line if y is not None]
        if not ys:
            continue
        ax = Axes(f"soak-leak-{key.replace('_', '-')}", title, f"{xlabel} since the first leak sample", unit,
                  (0.0, x_hi / scale), _y_range(ys), width=520, height=200)
        ax.mr = 18
        for (label, colour, dashed, _), line in zip(drawn, pts):
            ax.series([(x / scale, y) for x, y in downsample(line)], label, colour, dots=False, width=1.6,
                      dash="5 3" if dashed else None)
        ax.legend = []   # the shared one below the panels
        plots.append(ax.render())
    return plots, legend if plots else []


def leak_notes(leaks: Mapping[str, Any]) -> list[str]:
    notes = []
    taken = leaks.get("samples_taken", leaks.get("samples"))
    if isinstance(taken, int):
        notes.append(f"{taken} leak samples over {_s(_float(leaks.get('duration_s')))}")
    harness = _dict(leaks.get("harness"))
    for text in (leaks.get("growth_note"), harness.get("note"), _dict(leaks.get("kv")).get("note")):
        if text:
            notes.append(str(text))
    return notes


def downsample(points: Sequence[Any], limit: int = MAX_POINTS) -> list[Any]:
    """At most ``limit`` points, evenly spaced by index, the first and the last kept."""
    if len(points) <= limit:
        return list(points)
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def replay_options(seed: Any, duration_s: float | None) -> str:
    parts = [f"--soak-seed={seed}" if seed is not None else "", f"--soak={duration(duration_s)}" if duration_s else ""]
    return " ".join(p for p in parts if p)


def duration(seconds: float) -> str:
    """Seconds as ``--soak`` reads them: ``3m``, ``1h30m``, ``95s``."""
    if seconds != int(seconds):
        return f"{seconds:g}s"
    h, rest = divmod(int(seconds), 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"


def _y_range(ys: Sequence[float]) -> tuple[float, float]:
    """Zoomed on the data (growth shows), never below 0."""
    lo, hi = min(ys), max(ys)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.05, 1.0)
    return max(lo - pad, 0.0), hi + pad


def _dict(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


def _float(x: Any) -> float | None:
    try:
        return None if x is None or isinstance(x, bool) else float(x)
    except (TypeError, ValueError):
        return None


def _int(x: Any, default: int) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def _s(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f} s"


def _ms(x: Any) -> str:
    v = _float(x)
    return "—" if v is None else f"{v:.4g} ms"
