"""The run-wide latency charts: one per metric, percentiles over time with the SLO lines of the
Section 6.2 targets, gaps without data left as gaps, and the fault windows shaded as numbered
bands keyed below the chart by suite, fault and target."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from markupsafe import Markup, escape

from harness.report.plots import PALETTE, Axes, union_windows
from harness.report.suites import SuiteSpans

log = logging.getLogger(__name__)

TITLES = {"ttft_ms": "TTFT: time to first token (ms)", "tpot_ms": "TPOT: time per output token after the first (ms)",
          "itl_ms": "ITL: time between streamed chunks (ms)", "e2e_ms": "E2E: request latency, end to end (ms)"}
# percentile -> (colour, stroke width, dash): the tails dashed and drawn first, so a percentile
# that equals another (few requests in a window) still shows beside it
STYLES = {"p99": ("#dc2626", 3.0, None), "max": ("#6b7280", 1.2, "1 3"), "p95": ("#0891b2", 1.8, "7 4"),
          "p90": ("#9333ea", 1.6, "2 3"), "p50": ("#2563eb", 2.0, None)}
SLO_ITEMS = {"ttft_ms": "6.2.ttft", "tpot_ms": "6.2.tpot"}
_MERGE_GAP_S = 2.0  # fault windows of one suite closer than this are one band


def slo_lines(metric: str, verdicts: Sequence[Any], cluster: Mapping[str, Any]) -> dict[str, tuple[str, float]]:
    """``{"p50": (op, ms), "p99": (op, ms)}`` for a metric: from the run's 6.2 verdict, else the
    checklist with the cluster's overrides; empty for a metric without targets."""
    item = SLO_ITEMS.get(metric)
    if item is None:
        return {}
    base = metric[:-3]
    out: dict[str, tuple[str, float]] = {}
    for v in verdicts:
        if v.item == item:
            for m in v.evidence.get("measurements", []):
                for p in ("p50", "p99"):
                    if m.get("key") == f"{base}_{p}_ms" and m.get("threshold") is not None:
                        out[p] = (m["op"], float(m["threshold"]))
    if out:
        return out
    from harness.checklists import default_checklist

    try:
        checklist = default_checklist().with_overrides(cluster.get("threshold_overrides") or None, origin="cluster file")
        thresholds = checklist.item(item).thresholds
    except Exception as exc:  # noqa: BLE001 -- the chart still draws without its SLO lines
        log.warning("no SLO lines for %s: %s", metric, exc)
        return {}
    return {p: (thresholds[k].op, thresholds[k].value) for p in ("p50", "p99")
            if (k := f"{base}_{p}_ms") in thresholds}


def fault_bands(windows: Sequence[Mapping[str, Any]], spans: SuiteSpans) -> list[dict[str, Any]]:
    """Fault windows grouped per suite: overlapping or close windows of one suite become one band
    ``{"n", "start", "end", "suite", "faults": ["ecc_poison decode-1 x4", ...]}``."""
    bands: list[dict[str, Any]] = []
    for w in sorted(windows, key=lambda w: w["start"]):
        suite = spans.at(w["start"])
        label = str(w.get("label") or "fault").split(" via ", 1)[0]
        last = bands[-1] if bands else None
        if last is not None and last["suite"] == suite and w["start"] - last["end"] <= _MERGE_GAP_S:
            last["end"] = max(last["end"], w["end"])
            last["counts"][label] = last["counts"].get(label, 0) + 1
            continue
        bands.append({"n": len(bands) + 1, "start": w["start"], "end": max(w["end"], w["start"]), "suite": suite,
                      "counts": {label: 1}})
    for b in bands:
        b["faults"] = [f"{label} x{n}" if n > 1 else label for label, n in b.pop("counts").items()]
    return bands


def latency_plot(rows: Sequence[Mapping[str, Any]], metric: str, started: float, end: float,
                 bands: Sequence[Mapping[str, Any]], slo: Mapping[str, tuple[str, float]],
                 verdict: str | None = None) -> Markup:
    """Percentiles of one metric per time window; the SLO targets as dashed lines in their
    percentile's colour; the fault bands numbered (keyed by :func:`band_key`)."""
    rows = sorted((r for r in rows if r["metric"] == metric), key=lambda r: r["t"])
    series = [k for k in STYLES if any(r.get(k) is not None for r in rows)]
    steps = sorted({round(b["t"] - a["t"], 6) for a, b in zip(rows, rows[1:]) if b["t"] > a["t"]})
    gap = steps[0] * 1.5 if steps else None
    x1 = max([end - started] + [r["t"] - started for r in rows] + [b["end"] - started for b in bands] + [1e-3])
    top = max([r[k] for r in rows for k in series if r.get(k) is not None] + [v for _, v in slo.values()] + [1e-9])
    ax = Axes(f"latency-{metric}", TITLES.get(metric, metric.replace("_", " ")), "seconds since run start",
              "ms", (0.0, x1), (0.0, top * 1.1), height=250)
    for b in bands:
        ax.band(b["start"] - started, b["end"] - started, f"{b['n']}. {b['suite']}: {', '.join(b['faults'])}",
                tag=str(b["n"]), legend=False, css="fault-window")
    if bands:
        ax.legend.append(("#f97316", "fault windows (numbered)", "band"))
    for key in series:
        colour, width, dash = STYLES[key]
        pts = [(r["t"] - started, r.get(key)) for r in rows]
        ax.series(pts, key, colour, dots=False, gap=gap, width=width, dash=dash)
    for key, (op, value) in slo.items():
        ax.hline(value, f"SLO {key} {op} {value:g} ms", STYLES[key][0], "6 3")
    return ax.render(verdict=verdict)


def band_key(bands: Sequence[Mapping[str, Any]], started: float) -> Markup:
    """The numbered fault bands as a list: suite, faults and targets, when."""
    if not bands:
        return Markup("")
    items = "".join(f'<li value="{b["n"]}"><code>{escape(b["suite"])}</code>: {escape(", ".join(b["faults"]))} '
                    f'<span class="small">(+{b["start"] - started:.0f} to +{b["end"] - started:.0f} s)</span></li>'
                    for b in bands)
    return Markup(f'<ol class="band-key small">{items}</ol>')


#: the machine chart's series: distinct colours, limits dashed in their series' colour, labels that
#: fit the legend (about 38 characters with their limit)
MACHINE_SHARES = (("psi_some_pct", "PSI some", "#2563eb"),
                  ("load_generator_wait_share_pct", "load gen. without a CPU", "#be123c"),
                  ("fabric_probe_wait_share_pct", "fabric probes without a CPU", "#16a34a"),
                  ("steal_pct", "steal (hypervisor)", "#9333ea"))
MACHINE_DELAYS = (("watched_wait_per_run_ms", "machine-lag", "run-queue wait per run (our processes)",
                   "watched_wait_per_run_ms", "#0891b2"),
                  ("timer_lag_max_ms", "machine-timer", "timer lag (max per point)", "timer_lag_p99_ms", "#b45309"))


def machine_plot(samples: Sequence[Mapping[str, Any]], started: float, fault_windows: Sequence[Mapping[str, Any]],
                 limits: Mapping[str, float]) -> Markup | None:
    """The test machine's health over the run (results.json ``machine.samples``), on the latency
    charts' time axis with the fault windows shaded: CPU pressure and the shares of runnable time
    the load generator and the fabric probes spent without a CPU (%); then the scheduler's delay
    per run of our processes and the sampler's timer lag, each on its own axis so its limit (4 ms,
    500 ms) is not flattened onto the other's scale (issue 37)."""
    if not samples:
        return None
    xs = [s["t"] - started for s in samples] + [w["end"] - started for w in fault_windows]
    x_range = (0.0, max(xs + [1.0]) * 1.02)
    shares = Axes("machine-cpu", "Test machine: CPU pressure and time without a CPU", "seconds since run start",
                  "%", x_range, (0, 105), height=220)
    panels = [shares]
    for key, label, colour in MACHINE_SHARES:
        shares.series([(s["t"] - started, s.get(key)) for s in samples], label, colour, dots=len(samples) < 60)
        if key in limits:
            shares.hline(limits[key], f"{label} limit {limits[key]:g} %", colour)
    for key, name, label, limit, colour in MACHINE_DELAYS:
        top = max([s.get(key) or 0.0 for s in samples] + [limits.get(limit, 0.0), 1e-3])
        ax = Axes(name, f"Test machine: {label}", "seconds since run start", "ms", x_range, (0, top * 1.15),
                  height=180)
        ax.series([(s["t"] - started, s.get(key)) for s in samples], label, colour, dots=len(samples) < 60)
        if limit in limits:
            ax.hline(limits[limit], f"limit {limits[limit]:g} ms", colour)
        panels.append(ax)
    for ax in panels:
        for a, b in union_windows(fault_windows):
            ax.band(a - started, b - started, "fault window(s) active")
    return Markup("".join(ax.render() for ax in panels))
