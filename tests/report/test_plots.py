"""Evidence plots: each is drawn from a verdict's evidence as the suites record it, with its
threshold line; a verdict without the data draws nothing (never an empty frame)."""

import re

from harness.checklists import Checklist
from harness.checks.verdict import Measurement, judge
from harness.report import RunResult
from harness.report.events import event_summary
from harness.report.html import render_html
from harness.report import fabric_plots, plots


def _points(svg: str, name: str) -> int:
    return int(re.search(rf'data-plot="{name}" data-points="(\d+)"', svg).group(1))


def test_kv_bandwidth_plot_has_curve_line_rate_and_required_fraction():
    evidence = {"line_rate": {"bps": 5e8}, "raw_probe": {"bps": 4.7e8},
                "measurements": [{"key": "line_rate_fraction", "threshold": 0.8}],
                "kv_curve": [{"size_mib": s, "median_gbit_per_s": g, "gbit_per_s": [g, g * 0.9]}
                             for s, g in ((1, 0.1), (8, 0.3), (128, 0.45))]}
    svg = str(plots.kv_bandwidth_plot(evidence))
    assert _points(svg, "kv-bandwidth") == 9  # 3 medians + 6 repeats
    assert "line rate (0.5 Gbit/s)" in svg and "0.8 x line rate (required)" in svg and "raw TCP probe 0.94" in svg
    # issue 37: drawn in the verdict's unit, a fraction of the line rate (planted: the Gbit/s chart)
    assert "x line rate (1 = 0.5 Gbit/s)" in svg
    ys = [float(y) for y in re.findall(r'<circle class="point" cx="[\d.]+" cy="([\d.]+)"', svg)]
    line = float(re.search(r'<line class="threshold" x1="[\d.]+" x2="[\d.]+" y1="([\d.]+)"[^>]*stroke="#111"', svg).group(1))
    assert len(ys) == 9 and all(y > line for y in ys)   # every point under the line rate (1), as measured
    assert plots.kv_bandwidth_plot({"kv_curve": []}) is None


def test_pfc_plot_draws_all_three_samples_with_limits():
    samples = [{"label": lb, "rtt_p99_ms": r, "throughput_bps": t} for lb, r, t in
               (("before", 0.4, 2e8), ("during", 0.5, 1.9e8), ("after", 0.4, 2e8))]
    evidence = {"samples": samples, "rtt_noise_floor_ms": 0.5,
                "measurements": [{"key": "tcp_p99_latency_ratio", "threshold": 2.0},
                                 {"key": "tcp_throughput_ratio", "threshold": 0.8}]}
    svg = str(fabric_plots.pfc_samples_plot(evidence))
    assert _points(svg, "pfc-latency") == 3 and _points(svg, "pfc-throughput") == 3
    assert {m for m in re.findall(r'class="bar" data-label="(\w+)"', svg)} == {"before", "during", "after"}
    assert "allowed 1 ms" in svg and "required 0.16 Gbit/s" in svg


def test_distributions_per_request_and_per_stream():
    per_fault = [{"fault": {"kind": "process_kill", "role": "decode"}, "replaced_s": {"a": 0.2, "b": 0.3}},
                 {"fault": {"kind": "process_hang", "role": "prefill"}, "replaced_s": {"c": 2.1}}]
    svg = str(plots.reschedule_distribution({"per_fault": per_fault,
                                             "measurements": [{"key": "reschedule_p100_s", "threshold": 3.0}]}))
    # the legend counts requests and the faults they were on (issue 37; planted: "n=2" alone)
    assert _points(svg, "reschedule-requests") == 3 and "kill decode, 1 fault (2 requests)" in svg and "limit 3 s" in svg
    assert "hang prefill, 1 fault (1 request)" in svg
    per_migration = [{"phase": "idle", "excess_ms": 12.0}, {"phase": "loaded", "excess_ms": 80.0},
                     {"phase": "loaded", "excess_ms": None}]
    svg = str(plots.migration_distribution({"per_migration": per_migration}))
    assert _points(svg, "migration-requests") == 2
    assert plots.migration_distribution({"per_migration": []}) is None


def test_report_draws_kv_plot_from_samples_and_6_1_5_without_not_completed(sample_result):
    cl = Checklist.load()
    item5 = cl.item("6.1.5")
    samples = [{"label": lb, "rtt_p99_ms": 0.4, "throughput_bps": 2e8, "rtt_p50_ms": 0.2} for lb in ("before", "during", "after")]
    v = judge(item5, [Measurement(item5.thresholds["tcp_p99_latency_ratio"], 1.0, "ratio"),
                      Measurement(item5.thresholds["tcp_throughput_ratio"], 1.0, "ratio")],
              evidence={"samples": samples, "rtt_noise_floor_ms": 0.5})
    sample_result.verdicts.append(v)
    t0 = sample_result.started
    sample_result.cluster_samples = [{"t": t0 + i, "kv_usage": i / 20, "degradation_level": i // 6} for i in range(18)]
    html = render_html(sample_result)
    assert "not completed" not in html.split("Evidence for 6.1.5")[1]
    assert _points(html, "kv-degradation") == 18 and _points(html, "degradation-level") == 18
    assert "Level 2 trigger 85%" in html and "Level 3 trigger 90%" in html


def test_event_summary_groups_by_kind_and_summarises_bulk_kinds_as_rates():
    events = [{"t": float(i), "source": "router", "kind": "kv_transfer", "detail": f"seq={i}"} for i in range(5)]
    events.append({"t": 2.5, "source": "faults", "kind": "inject", "detail": "kill"})
    summary = event_summary(events)
    assert [(k["kind"], k["count"], k["bulk"]) for k in summary["kinds"]] == [("inject", 1, False),
                                                                            ("kv_transfer", 5, True)]
    assert summary["kinds"][1]["events"] == [] and summary["kinds"][0]["events"][0]["detail"] == "kill"
    result = RunResult(run_id="x", started=0.0, finished=10.0, exit_code=0, timeline=events)
    html = render_html(result)
    assert html.count('<details class="event-group"') == 1 and "<script" not in html
    assert 'data-kind="kv_transfer" data-count="5" data-bulk="yes"' in html


def test_latency_plot_leaves_gaps_and_draws_slo_lines_and_numbered_bands():
    from harness.report.run_plots import band_key, fault_bands, latency_plot
    from harness.report.suites import SuiteSpans

    rows = [{"t": 100.0 + t, "metric": "ttft_ms", "p50": 40.0, "p99": 90.0, "n": 5} for t in (0, 2, 4, 20, 22)]
    rows.append({"t": 124.0, "metric": "ttft_ms", "p50": None, "p99": None, "n": 0})  # a window without requests
    rows += [{"t": 100.0 + t, "metric": "ttft_ms", "p50": 41.0, "p99": 95.0, "n": 5} for t in (26, 28)]
    windows = [{"start": 101.0, "end": 103.0, "label": "process_kill decode-0 via http://x/admin"},
               {"start": 103.5, "end": 104.0, "label": "process_kill decode-0 via http://x/admin"},
               {"start": 121.0, "end": 122.0, "label": "hbm_fill decode-1"}]
    bands = fault_bands(windows, SuiteSpans({"test_a.py": 100.0, "test_b.py": 110.0}))
    assert [(b["suite"], b["faults"]) for b in bands] == [("test_a.py", ["process_kill decode-0 x2"]),
                                                          ("test_b.py", ["hbm_fill decode-1"])]
    svg = str(latency_plot(rows, "ttft_ms", 100.0, 130.0, bands, {"p50": ("<", 200.0), "p99": ("<", 500.0)}))
    assert svg.count('data-series="p50"') == 3  # 0-4 s, 20-22 s, 26-28 s: no line across the gaps
    assert "TTFT: time to first token (ms)" in svg and "SLO p50 &lt; 200 ms" in svg and "SLO p99 &lt; 500 ms" in svg
    assert svg.count('class="fault-window"') == 2 and "http://" not in str(band_key(bands, 100.0))


def test_ecc_plot_judges_blocks_left_in_service_not_quarantined_ones():
    from types import SimpleNamespace

    from harness.checks.verdict import Status
    from harness.report.item_plots import RunView, ecc_plot

    evidence = {"measurements": [{"key": "poisoned_blocks_reused", "threshold": 0.0, "op": "<=", "value": 0,
                                  "holds": True}],
                "poisonings": [{"worker": "decode-1", "blocks": [13, 5], "min_quarantined": 2}]}
    verdict = SimpleNamespace(evidence=evidence, status=Status.PASS, test="suites/test_ecc_poisoning.py::t")
    svg = str(ecc_plot(verdict, RunView(0.0, 1.0)))
    assert 'data-verdict="pass"' in svg and 'class="measured ok"' in svg and 'class="measured bad"' not in svg
    assert 'class="bar context"' in svg and "allowed left in service: &lt;= 0" in svg
