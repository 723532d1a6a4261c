"""The terminal's lines for ``--baseline`` (docs/compare.md): each compared figure, then what could
not be compared and why, and where the tolerances came from."""

from rich.console import Console

from harness.report.terminal import _print_regression


def test_the_terminal_names_items_not_comparable_and_where_the_tolerances_came_from():
    """Planted defects: the 'not comparable' items (6.1.3: one reading a level, no interval) or the
    tolerances' origin (a cluster file's override) left out of the terminal, so a reader of the CI
    log cannot tell why 6.1.3 has no line or which tolerance judged a figure."""
    console = Console(record=True, width=200)
    _print_regression(console, {
        "baseline": "reports/base", "alpha": 0.05,
        "figures": [{"figure": "6.2.ttft ttft_p99_ms", "status": "within tolerance", "reason": "1.02 x [0.97-1.08]"}],
        "not_comparable": {"6.1.3": "a run reads each trigger level once: no interval to compare"},
        "not_compared": ["6.1.4 reschedule_p50_s"],
        "tolerances_from": "checklists/section6.yaml, overridden by clusters/prod-a.yaml"})
    text = console.export_text()
    assert "6.2.ttft ttft_p99_ms: within tolerance: 1.02 x [0.97-1.08]" in text
    assert "6.1.3 not comparable: a run reads each trigger level once" in text
    assert "tolerances: checklists/section6.yaml, overridden by clusters/prod-a.yaml" in text
    assert "not compared (neither run measured them): 6.1.4 reschedule_p50_s" in text
