"""Evidence plots that need the run around a verdict (its suite's time span, the sampled KV use,
the engine's events), each in the units of the threshold it is judged by, the threshold drawn as
a line and the judged figure green where it holds and red where it does not."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from markupsafe import Markup

from harness.report.plots import PALETTE, Axes, threshold_of, kv_level_plot
from harness.report.suites import SuiteSpans

_GREY = "#9ca3af"
_DETAIL_FIELD = re.compile(r"(\w+)=([^,]*)")


@dataclass
class RunView:
    """What a plot may need from the run besides the verdict: times, gauges, windows, events."""

    started: float
    finished: float
    cluster_samples: Sequence[Mapping[str, Any]] = ()
    fault_windows: Sequence[Mapping[str, Any]] = ()
    events: Sequence[Mapping[str, Any]] = ()
    spans: SuiteSpans = field(default_factory=lambda: SuiteSpans({}))


def _holds(m: Mapping[str, Any] | None) -> bool | None:
    return None if m is None else m.get("holds")


def ecc_plot(verdict: Any, run: RunView) -> Markup | None:
    """ECC: per poisoning, the poisoned blocks left in service (judged: at most the threshold, 0)
    beside the blocks quarantined (context: quarantining them is the point)."""
    poisonings = [p for p in verdict.evidence.get("poisonings") or [] if p.get("blocks")]
    judged = threshold_of(verdict.evidence, "poisoned_blocks_reused")
    if not poisonings or judged is None:
        return None
    limit = float(judged["threshold"])
    rows = []
    for p in poisonings:
        seen = p.get("min_quarantined")
        left = None if seen is None else max(0, len(p["blocks"]) - seen)
        rows.append((f"{p['worker']} {p['blocks']}", left, None if seen is None else min(seen, len(p["blocks"]))))
    top = max([len(p["blocks"]) for p in poisonings] + [limit, 1.0])
    n = len(rows)
    ax = Axes("ecc-left-in-service", "Poisoned KV blocks left in service, per poisoning", "poisoning (worker, blocks)",
              "blocks", (-0.5, n - 0.5), (-0.05 * top, top * 1.25), height=240)
    ax.bars([(label, q) for label, _, q in rows], _GREY, offset=-0.17, share=0.3, css="bar context")
    colours = ["#16a34a" if left is not None and left <= limit else "#dc2626" for _, left, _ in rows]
    ax.bars([(label, left) for label, left, _ in rows], colours, offset=0.17, share=0.3, css="bar judged",
            labels=False)
    for i, (label, left, _) in enumerate(rows):
        if left is not None:
            ax.mark(i + 0.17, left, f"{label}: {left} left in service", left <= limit, legend=False)
    ax.legend += [(_GREY, "quarantined (context)", "line"),
                  ("#16a34a" if judged.get("holds") else "#dc2626", "left in service (judged)", "dot")]
    ax.hline(limit, f"allowed left in service: {judged['op']} {limit:g}", "#dc2626")
    return ax.render(x_ticks=False, verdict=verdict.status.value)


def degradation_plot(verdict: Any, run: RunView) -> Markup | None:
    """6.1.3 on the bundled engine: KV use over the suite's time with the Level 2/3 triggers, the
    level as steps below it, and the KV use at each level's entry (the judged figures) marked."""
    changes = [c for c in verdict.evidence.get("level_changes") or [] if c.get("wall_time") is not None]
    if not changes:
        return None
    span = run.spans.span(_label(verdict), run.finished) or (changes[0]["wall_time"] - 10, changes[-1]["wall_time"] + 5)
    start, end = span
    samples = [s for s in run.cluster_samples if start <= s["t"] <= end]
    triggers, marks = [], []
    for key, level in (("trigger_utilization", 2), ("level3_trigger_utilization", 3)):
        m = threshold_of(verdict.evidence, key)
        if m is None or m.get("threshold") is None:
            continue
        triggers.append((float(m["threshold"]), f"Level {level} trigger {m['op']} {float(m['threshold']):.0%}"))
        entry = next((c for c in changes if c.get("to_level") == level and (c.get("from_level") or 0) < level), None)
        if entry is not None and m.get("value") is not None:
            marks.append((entry["wall_time"], float(m["value"]), f"KV use at Level {level} entry "
                          f"{float(m['value']):.1%} (judged)", _holds(m)))
    windows = [w for w in run.fault_windows if w["end"] >= start and w["start"] <= end]
    return kv_level_plot(samples, start, changes, triggers, windows, marks=marks, verdict=verdict.status.value,
                         x_label="seconds since the suite started", names=("item3-kv-use", "item3-level"))


def _label(verdict: Any) -> str:
    from harness.report.suites import suite_label

    return suite_label(verdict.test)


def _fields(detail: str) -> dict[str, str]:
    return dict(_DETAIL_FIELD.findall(detail or ""))


def flap_plot(verdict: Any, run: RunView) -> Markup | None:
    """NIC flap: every probe transfer's KV bandwidth before the flaps (in order) and after them
    (at its time) against the median before and the required fraction of it, the median after
    marked (the judged figure); below, every KV transfer the engine made during the flaps (its
    time on the wire, per decode worker), the NIC-down windows shaded in both."""
    ev = verdict.evidence
    flaps = ev.get("flaps") or {}
    transitions = sorted(flaps.get("transitions") or [], key=lambda t: t["t_wall"])
    baseline = ev.get("baseline_gbit_per_s")
    if not transitions or baseline is None:
        return None
    t0 = transitions[0]["t_wall"]
    last_up = max((t["t_wall"] for t in transitions if t["state"] == "up"), default=transitions[-1]["t_wall"])
    after = [(last_up - t0 + a["t_s"], a["gbit_per_s"]) for a in ev.get("after") or []]
    before = list(ev.get("before_gbit_per_s") or [])
    pace = statistics.median([a["t_s"] - a.get("start_s", a["t_s"]) for a in ev.get("after") or []] or [0.5]) or 0.5
    before_pts = [(-(len(before) - i) * pace, g) for i, g in enumerate(before)]
    judged = threshold_of(ev, "kv_bandwidth_recovered_fraction")
    need = float(judged["threshold"]) if judged else 0.95
    xs = [x for x, _ in before_pts + after] + [last_up - t0]
    x_range = (min(xs + [0.0]) - pace, max(xs) + pace)
    ymax = max([baseline] + [g for _, g in before_pts + after]) * 1.2
    ax = Axes("nic-flap", f"KV bandwidth to {flaps.get('target', 'the flapped host')}, probe transfers",
              "seconds since the first flap", "KV bandwidth (Gbit/s)", x_range, (0, ymax))
    downs = _down_windows(transitions)
    for a, b in downs:
        ax.band(a - t0, b - t0, "NIC down")
    ax.hline(baseline, f"median before {baseline:.3g} Gbit/s", "#111", "none")
    ax.hline(need * baseline, f"{need:.0%} of before (required)", "#dc2626")
    ax.series(before_pts, f"before the flaps ({len(before)}, in order)", "#111", line=False)
    ax.series(after, f"after the flaps ({len(after)})", PALETTE[0], line=False)
    if judged and judged.get("value") is not None and after:
        ax.mark(statistics.median(x for x, _ in after), float(judged["value"]) * baseline,
                f"median after {float(judged['value']):.2f} x before (judged)", _holds(judged))
    panels = [ax.render(verdict=verdict.status.value)]
    during = _transfers_during(run.events, downs, last_up)
    if during:
        wire = Axes("nic-flap-engine", "KV transfers the engine made during the flaps (load)",
                    "seconds since the first flap", "time on the wire (ms)", x_range,
                    (0, max(ms for _, pts in during.items() for _, ms in pts) * 1.15), height=220)
        for a, b in downs:
            wire.band(a - t0, b - t0, "NIC down")
        for i, (worker, pts) in enumerate(sorted(during.items())):
            wire.series([(t - t0, ms) for t, ms in pts], f"to {worker} ({len(pts)})", PALETTE[i % len(PALETTE)],
                        line=False)
        panels.append(wire.render())
    return Markup("".join(panels))


def _down_windows(transitions: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    out, down = [], None
    for t in transitions:
        if t["state"] == "down":
            down = t["t_wall"]
        elif down is not None:
            out.append((down, t["t_wall"]))
            down = None
    return out


def _transfers_during(events: Sequence[Mapping[str, Any]], downs: Sequence[tuple[float, float]],
                      last_up: float) -> dict[str, list[tuple[float, float]]]:
    """The engine's kv_transfer events from the first flap to 5 s after the last, per decode worker."""
    if not downs:
        return {}
    first = downs[0][0]
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("kind") != "kv_transfer" or not first <= e["t"] <= last_up + 5:
            continue
        f = _fields(str(e.get("detail") or ""))
        try:
            out.setdefault(f.get("decode", "?"), []).append((e["t"], float(f["transfer_s"]) * 1e3))
        except (KeyError, ValueError):
            continue
    return out
