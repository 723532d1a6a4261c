"""Terminal output with rich: one line per verdict as it is recorded, a summary table at the end."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from harness.stats.intervals import brackets
from harness.checks import reasons
from harness.checks.verdict import Status, Verdict
from harness.report.result import RunResult
from harness.report.suites import suite_label

_STYLE = {Status.PASS: "bold green", Status.FAIL: "bold red", Status.INCONCLUSIVE: "bold yellow",
          Status.ERROR: "bold magenta"}
_EXIT_STYLE = {0: "bold green", 1: "bold red", 2: "bold yellow", 3: "bold magenta", 4: "bold magenta"}


def verdict_line(v: Verdict) -> Text:
    line = Text()
    line.append(f"[{v.status.value.upper():>12}] ", style=_STYLE[v.status])
    line.append(f"{v.item} ", style="bold")
    line.append(reasons.render_line(v.causes))
    return line


def print_verdict(console: Console, v: Verdict) -> None:
    console.print(verdict_line(v), soft_wrap=True)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(1, width - 1)] + "…"


def short_reason(v: Verdict) -> str:
    """The reason's own words for the end table, rendered from its causes without the figure and
    threshold its columns show: what was measured (``p100 rescheduling time over 12 fault(s)``),
    a capability's names (its why and fix in the report), an inconclusive's why, a starved
    machine as three words; the whole reason stays in the lines above, the report and results.json."""
    return reasons.render_short(v.causes)


def print_summary(console: Console, result: RunResult, run_dir: Path | None) -> None:
    """The end table, one line per verdict (issue 37): item, suite, status, figure with its interval,
    threshold, and the reason's own words cut to what the terminal's width leaves (the full reason is
    printed as each verdict is recorded and kept in the report)."""
    rows = []
    for v in result.verdicts:
        measured = "—" if v.measured is None else f"{v.measured:.4g} {v.unit} {brackets(v.interval)}".strip()
        threshold = "—" if v.threshold is None else f"{v.op} {v.threshold:g} {v.unit}"
        rows.append((v, [v.item, suite_label(v.test), v.status.value, _cut(measured, 40), threshold]))
    heads = ["item", "suite", "status", "measured", "threshold", "reason"]
    widths = [max([len(h)] + [len(r[i]) for _, r in rows]) for i, h in enumerate(heads[:-1])]
    # each column's padding (2) and rule (1), the outer rule (1); a narrow terminal takes from the
    # widest of suite, measured and threshold first, so the reason keeps 20 columns
    frame = 3 * len(heads) + 1
    while sum(widths) + 20 + frame > console.width and max(widths[1], widths[3], widths[4]) > 8:
        widest = max((1, 3, 4), key=lambda i: widths[i])
        widths[widest] -= 1
    room = max(20, console.width - sum(widths) - frame)
    table = Table(title=f"Conformance of cluster {result.cluster.get('name', '?')}", show_lines=False)
    for head, width in zip(heads, widths + [room]):
        table.add_column(head, no_wrap=True, min_width=width, max_width=width,
                         justify="right" if head in ("measured", "threshold") else "left")
    for v, cells in rows:
        cells = [_cut(c, w) for c, w in zip(cells, widths)]
        table.add_row(*cells[:2], Text(cells[2], style=_STYLE[v.status]), *cells[3:], _cut(short_reason(v), room))
    console.print(table)
    _print_coverage(console, result.coverage)
    _print_regression(console, result.regression)
    for message in result.revert_failures:
        console.print(Text(f"revert failed: {message}", style="bold magenta"))
    for message in result.harness_errors:
        console.print(Text(f"harness error: {message}", style="bold magenta"))
    console.print(Text(f"exit {result.exit_code}: {result.exit_meaning}", style=_EXIT_STYLE.get(result.exit_code, "")))
    if run_dir is not None:
        console.print(f"report: {run_dir / 'report.html'} (also results.json, junit.xml; "
                      f"{run_dir.parent / 'latest'} links to it)")


def _print_regression(console: Console, regression: dict) -> None:
    """--baseline: one line per compared figure (docs/compare.md); its error is a harness error below."""
    if not regression.get("figures"):
        return
    console.print(f"against the baseline {regression['baseline']} (chance of a wrong 'regressed' <= "
                  f"{regression['alpha']:g} over the {len(regression['figures'])} figures):")
    styles = {"regressed": "bold red", "inconclusive": "yellow", "within tolerance": "green", "improved": "green"}
    for f in regression["figures"]:
        console.print(Text(f"  {f['figure']}: {f['status']}: {f['reason']}", style=styles.get(f["status"], "")))
    for difference in regression.get("differences") or ():
        console.print(f"  compared anyway, though the runs differ in {difference}")
    for item, why in (regression.get("not_comparable") or {}).items():
        console.print(Text(f"  {item} not comparable: {why}", style="dim"))
    if regression.get("not_compared"):
        console.print(Text("  not compared (neither run measured them): " + ", ".join(regression["not_compared"]),
                           style="dim"))
    if regression.get("tolerances_from"):
        console.print(Text(f"  tolerances: {regression['tolerances_from']}", style="dim"))


def _print_coverage(console: Console, coverage: dict) -> None:
    """Which items were judged, and why the others could not be (one line each)."""
    if not coverage:
        return
    judged = coverage.get("judged", {})
    if judged:
        console.print(Text("judged: " + ", ".join(f"{i} ({s})" for i, s in judged.items()), style="bold"))
    for item, reasons in coverage.get("not_judged", {}).items():
        head = f"not judged: {item}: "
        line = Text(head, style="bold yellow")   # one line each: the whole reason is above and in the report
        line.append(_cut(" | ".join(reasons), max(20, console.width - len(head))))
        console.print(line, soft_wrap=True)
    if coverage.get("not_run"):
        console.print(Text("not run (no suite reported on them): " + ", ".join(coverage["not_run"]), style="dim"))
