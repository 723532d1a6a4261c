"""Terminal output with rich: one line per verdict as it is recorded, a summary table at the end."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from harness.stats.intervals import brackets
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
    line.append(v.reason)
    return line


def print_verdict(console: Console, v: Verdict) -> None:
    console.print(verdict_line(v), soft_wrap=True)


def print_summary(console: Console, result: RunResult, run_dir: Path | None) -> None:
    table = Table(title=f"Conformance of cluster {result.cluster.get('name', '?')}", show_lines=False)
    for col, kw in (("item", {}), ("suite", {"overflow": "fold"}), ("status", {}), ("measured", {"justify": "right"}),
                    ("threshold", {"justify": "right"}), ("reason", {"overflow": "fold"})):
        table.add_column(col, **kw)
    for v in result.verdicts:
        measured = "—" if v.measured is None else f"{v.measured:.4g} {v.unit} {brackets(v.interval)}".strip()
        threshold = "—" if v.threshold is None else f"{v.op} {v.threshold:g} {v.unit}"
        table.add_row(v.item, suite_label(v.test), Text(v.status.value, style=_STYLE[v.status]), measured, threshold,
                      v.reason)
    console.print(table)
    _print_coverage(console, result.coverage)
    for message in result.revert_failures:
        console.print(Text(f"revert failed: {message}", style="bold magenta"))
    for message in result.harness_errors:
        console.print(Text(f"harness error: {message}", style="bold magenta"))
    console.print(Text(f"exit {result.exit_code}: {result.exit_meaning}", style=_EXIT_STYLE.get(result.exit_code, "")))
    if run_dir is not None:
        console.print(f"report: {run_dir / 'report.html'} (also results.json, junit.xml; "
                      f"{run_dir.parent / 'latest'} links to it)")


def _print_coverage(console: Console, coverage: dict) -> None:
    """Which items were judged, and why the others could not be (one line each)."""
    if not coverage:
        return
    judged = coverage.get("judged", {})
    if judged:
        console.print(Text("judged: " + ", ".join(f"{i} ({s})" for i, s in judged.items()), style="bold"))
    for item, reasons in coverage.get("not_judged", {}).items():
        line = Text(f"not judged: {item}: ", style="bold yellow")
        line.append(" | ".join(reasons))
        console.print(line, soft_wrap=True)
    if coverage.get("not_run"):
        console.print(Text("not run (no suite reported on them): " + ", ".join(coverage["not_run"]), style="dim"))
