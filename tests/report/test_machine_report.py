"""The test machine's health in the report: its chart beside the latency charts (fault windows
shaded, limits drawn), each verdict's machine figures, and a run without samples says so."""

import re

from harness.checks.machine import LIMITS, gate
from harness.report import run_plots
from harness.report.html import render_html


def _points(svg: str, name: str) -> int:
    return int(re.search(rf'data-plot="{name}" data-points="(\d+)"', svg).group(1))


def _samples(t0: float, n: int) -> list[dict]:
    return [{"t": t0 + i, "psi_some_pct": 50.0 + i, "load_generator_wait_share_pct": 40.0,
             "fabric_probe_wait_share_pct": None if i == 0 else 30.0, "watched_wait_per_run_ms": 1.0,
             "timer_lag_max_ms": 1.0 + i, "load_generator_cpu_pct": 10.0, "runnable_per_cpu": 2.0, "load1_max": 3.0}
            for i in range(n)]


def test_the_machine_plot_draws_each_series_with_limits_and_fault_windows():
    t0 = 1000.0
    svg = str(run_plots.machine_plot(_samples(t0, 5), t0, [{"start": t0 + 1, "end": t0 + 2, "label": "kill"}],
                                 LIMITS.to_dict()))
    assert _points(svg, "machine-cpu") == 5 + 5 + 4  # PSI, load generator, fabric probes (one sample without)
    assert _points(svg, "machine-lag") == 5 and _points(svg, "machine-timer") == 5  # each on its own axis
    assert svg.count('class="window"') == 3  # the fault shaded in every panel
    assert f"PSI some limit {LIMITS.psi_some_pct:g} %" in svg and f"limit {LIMITS.timer_lag_p99_ms:g} ms" in svg
    assert f"fabric probes without a CPU limit {LIMITS.fabric_probe_wait_share_pct:g} %" in svg
    # issue 37: every legend label fits the legend's 230 px (~38 characters at 10 px), the series'
    # colours differ, and the 4 ms wait limit has an axis of its own (not 0-500 ms): planted, the old
    # chart (one delay axis, "CPU taken by the hypervisor (steal) limit 20 %", steal near load gen.)
    labels = re.findall(r'<text x="[\d.]+" y="[\d.]+" class="tick">([^<]*[a-z][^<]*)</text>', svg)
    assert labels and max(len(x) for x in labels) <= 38, max(labels, key=len)
    colours = [c for _, _, c in run_plots.MACHINE_SHARES] + [d[4] for d in run_plots.MACHINE_DELAYS]
    assert len(set(colours)) == len(colours)
    lag = svg.split('data-plot="machine-lag"')[1].split("</svg>")[0]
    assert f"limit {LIMITS.watched_wait_per_run_ms:g} ms" in lag and f"limit {LIMITS.timer_lag_p99_ms:g} ms" not in lag
    assert run_plots.machine_plot([], t0, [], {}) is None


def test_the_report_shows_the_machine_chart_and_each_verdicts_figures(sample_result):
    t0 = sample_result.started
    sample_result.machine = {"interval_s": 0.5, "cpus": 2, "psi_note": None, "limits": LIMITS.to_dict(),
                             "samples": _samples(t0, 8)}
    starved = {"samples": 20, "psi_some_pct": 99.5, "watched_wait_per_run_ms": 9.0, "timer_lag_p99_ms": 120.0}
    sample_result.verdicts[0] = gate(sample_result.verdicts[0], [starved])  # the failing 6.1.4
    html = render_html(sample_result)
    assert 'id="machine-health"' in html and 'data-plot="machine-cpu"' in html
    figures = re.search(r'<p class="small machine-figures" data-starved="yes">(.*?)</p>', html, re.S).group(1)
    assert "PSI some 99.5 %" in figures and "run-queue wait per run\n9 ms" in figures and "120 ms" in figures
    assert "fail made inconclusive" in figures and "test machine CPU-starved" in figures
    sample_result.machine = {}
    assert "health was not sampled in this run" in render_html(sample_result)
