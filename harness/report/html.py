"""The self-contained HTML conformance report: inline CSS and inline SVG charts drawn here, no
scripts, no network, so the file can be mailed or archived and still open anywhere."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jinja2
from markupsafe import Markup, escape

from harness.stats.intervals import brackets
from harness.checklists import COMPARISONS
from harness.report.result import RunResult
from harness.report import fabric_plots, item_plots, plots, run_plots
from harness.report.events import event_summary, unique_events
from harness.report.item_plots import RunView
from harness.report.run_plots import SLO_ITEMS, band_key, fault_bands, latency_plot, slo_lines
from harness.report.soak_section import soak_view
from harness.report.scorecard import scorecard
from harness.report.suites import SuiteSpans, item_statuses, status_counts, suite_label
from harness.report.text import fit_words
from harness.report.trend import trend_section

_TEMPLATE_DIR = Path(__file__).parent


def _brief(obj: Any, most: int = 50) -> Any:
    """Evidence as the report shows it: a list of more than ``most`` numbers (6.1.5's raw round trips,
    kept for `harness compare`) as one line saying how many, the rest as it is (results.json has them all)."""
    if isinstance(obj, dict):
        return {k: _brief(v, most) for k, v in obj.items()}
    if isinstance(obj, list):
        if len(obj) > most and all(isinstance(x, (int, float)) for x in obj):
            return f"{len(obj)} numbers, from {min(obj):g} to {max(obj):g} (all in results.json)"
        return [_brief(x, most) for x in obj]
    return obj


def render_html(result: RunResult, past: Sequence[Any] = ()) -> str:
    """The report of ``result``; ``past``: earlier runs of the same cluster (harness/history.py
    entries, oldest first) for the trend section (harness/report/trend.py)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(_TEMPLATE_DIR), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["clock"] = lambda t: _clock(t)
    env.filters["rel"] = lambda t: "" if t is None else f"+{t - result.started:.2f} s"
    env.filters["num"] = _num
    env.filters["brackets"] = brackets   # a figure's interval beside it: "[450-510, 95 %]"
    env.filters["pretty"] = lambda obj: json.dumps(_brief(obj), indent=2, default=str, ensure_ascii=False)
    env.filters["suite"] = suite_label
    spans = SuiteSpans.of(result.verdicts, result.tests)
    end = max([result.finished or result.started] + [w["end"] for w in result.fault_windows])
    run = RunView(result.started, end, result.cluster_samples, result.fault_windows,
                  unique_events(result.timeline), spans)
    # one entry per verdict, in order (an item may have several verdicts, from different tests)
    evidence_plots = [[p for p in (build(v, run) for build in _EVIDENCE_PLOTS.get(v.item, ())) if p]
                      for v in result.verdicts]
    distributions = [samples_chart(v.evidence["samples"], v.threshold, v.op, v.unit)
                     if not plotted and v.item not in _OWN_UNITS
                     and isinstance(v.evidence.get("samples"), list)
                     and any(s.get("value") is not None or s.get("note") for s in v.evidence["samples"])
                     else None for v, plotted in zip(result.verdicts, evidence_plots)]
    statuses = item_statuses(result.verdicts, _checklist_items(result))
    score_rows, machine_note = scorecard(result.verdicts, _checklist_items(result))
    bands = fault_bands(result.fault_windows, spans)
    charts = []
    for metric in sorted({row["metric"] for row in result.latency}):
        slo_verdict = next((v.status.value for v in result.verdicts if v.item == SLO_ITEMS.get(metric)), None)
        charts.append((metric, latency_plot(result.latency, metric, result.started, end, bands,
                                            slo_lines(metric, result.verdicts, result.cluster), slo_verdict)))
    machine = result.machine or {}
    machine_plot = run_plots.machine_plot(machine.get("samples") or [], result.started, result.fault_windows,
                                      machine.get("limits") or {})
    return env.get_template("report.html.j2").render(
        r=result, charts=charts, band_key=band_key(bands, result.started), distributions=distributions,
        evidence_plots=evidence_plots, kv_plot=kv_level_chart(result), events=event_summary(run.events, spans, end),
        statuses=statuses, counts=status_counts(statuses), suites=spans.labels, machine_plot=machine_plot,
        soak=soak_view(getattr(result, "soak", None)), score_rows=score_rows, machine_note=machine_note,
        trends=trend_section(result.verdicts, past, str(result.cluster.get("name") or "?")), past_runs=len(past))


def _evidence(build: Callable[[Mapping[str, Any]], Markup | None]) -> Callable[[Any, RunView], Markup | None]:
    return lambda v, run: build(v.evidence)


# checklist item -> plots drawn from its verdict (a verdict without the data draws none)
_EVIDENCE_PLOTS: dict[str, tuple[Callable[[Any, RunView], Markup | None], ...]] = {
    "6.1.1": (_evidence(fabric_plots.kv_bandwidth_chart),),
    "6.1.2": (_evidence(plots.migration_distribution),),
    # by level over time (the bundled engine); by load on a foreign engine
    "6.1.3": (item_plots.degradation_plot, _evidence(plots.kv_drive_plot)),
    "6.1.4": (_evidence(plots.reschedule_distribution),),
    "6.1.5": (_evidence(fabric_plots.pfc_samples_plot),),
    "ecc": (item_plots.ecc_plot,),
    "nic-flap": (item_plots.flap_plot,),
}
# items whose evidence samples are not in the unit of the verdict's threshold (ECC: requests hit
# per poisoning, 6.1.3: the level reached per step): never drawn against that threshold
_OWN_UNITS = frozenset({"ecc", "6.1.3"})


def _checklist_items(result: RunResult) -> list[str]:
    """The run's checklist items: from its coverage, else the default checklist's."""
    cov = result.coverage or {}
    items = [*cov.get("judged", {}), *cov.get("not_judged", {}), *cov.get("not_run", [])]
    if items:
        return items
    from harness.checklists import default_checklist

    try:
        return list(default_checklist().items)
    except Exception:  # noqa: BLE001 -- counts then cover the items with verdicts only
        return []


def kv_level_chart(result: RunResult) -> Markup | None:
    """KV use and degradation level over the run: the sampled gauges, the 6.1.3 verdict's level
    changes, and its triggers (the checklist's when no 6.1.3 verdict carries them)."""
    item3 = [v for v in result.verdicts if v.item == "6.1.3"]
    changes = [c for v in item3 for c in v.evidence.get("level_changes", [])]
    triggers = {m["key"]: m["threshold"] for v in item3 for m in v.evidence.get("measurements", [])
                if m.get("key") in ("trigger_utilization", "level3_trigger_utilization")}
    if not triggers and (result.cluster_samples or changes):
        from harness.checklists import default_checklist
        try:
            t = default_checklist().item("6.1.3").thresholds
            triggers = {k: t[k].value for k in ("trigger_utilization", "level3_trigger_utilization")}
        except Exception:  # noqa: BLE001 -- a report still renders without the trigger lines
            triggers = {}
    lines = [(v, f"Level {2 if k == 'trigger_utilization' else 3} trigger {v:.0%}") for k, v in triggers.items()]
    return plots.kv_level_plot(result.cluster_samples, result.started, changes, lines, result.fault_windows)


def _clock(t: float | None) -> str:
    if t is None:
        return ""
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3] + "Z"


def _num(x: Any) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def samples_chart(samples: Sequence[dict[str, Any]], threshold: float | None, op: str, unit: str) -> Markup:
    """One bar per sample (e.g. per fault), the threshold as a dashed line; bars that miss it are red."""
    values = [float(s["value"]) for s in samples if s.get("value") is not None]
    height = 26 + 18 * len(samples)
    vmax = max(values + [threshold or 0.0, 1e-9]) * 1.1
    width = 1040
    left, pw = 150, 400  # room on the right for each bar's value and note

    def sx(v: float) -> float:
        return left + v / vmax * pw

    parts = [f'<svg class="distribution" role="img" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg"><title>distribution of samples</title>']
    for i, s in enumerate(samples):
        y = 8 + 18 * i
        value = s.get("value")
        label = escape(str(s.get("label", i + 1)))
        parts.append(f'<text x="{left - 6}" y="{y + 11}" text-anchor="end" class="tick">{label}</text>')
        full = str(s.get("note") or "")
        note = escape(fit_words(full, _NOTE_CHARS))
        tip = f"<title>{escape(full)}</title>" if note != escape(full) else ""
        if value is None:
            parts.append(f'<text x="{left + pw + 10}" y="{y + 11}" class="tick">not completed: {note}{tip}</text>')
            continue
        ok = threshold is None or _holds(float(value), threshold, op)
        parts.append(f'<rect class="sample {"ok" if ok else "bad"}" x="{left}" y="{y}" '
                     f'width="{max(sx(float(value)) - left, 1):.1f}" height="13" '
                     f'fill="{"#16a34a" if ok else "#dc2626"}"/>'
                     f'<text x="{left + pw + 10}" y="{y + 11}" class="tick">{float(value):.3g} '
                     f'{escape(unit)}{" — " + note if note else ""}{tip}</text>')
    if threshold is not None:
        x = sx(threshold)
        parts.append(f'<line class="threshold" x1="{x:.1f}" x2="{x:.1f}" y1="2" y2="{height - 14}" stroke="#111" '
                     f'stroke-dasharray="4 3"/><text x="{x:.1f}" y="{height - 3}" text-anchor="middle" '
                     f'class="tick">threshold {escape(op)} {threshold:g} {escape(unit)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


_NOTE_CHARS = 80  # what fits right of the bars at the report's 10 px tick font


def _holds(value: float, threshold: float, op: str) -> bool:
    compare = COMPARISONS.get(op)
    return True if compare is None else compare(value, threshold)
