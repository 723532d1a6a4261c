"""The report's Soak section (issue 27 item 6), rendered for real: the fault timeline with each
fault's verdict, faults by kind, 6.2 per window, the leak charts and every fault; none without a
soak; a dry run's plan; partial or odd dicts still render."""

import copy
import re

import pytest

from harness.report import RunResult
from harness.report.html import render_html
from harness.report.soak_section import duration, leak_lines, soak_view

T0 = 1_800_000_000.0
INVENTORY = [["decode-0", "decode"], ["decode-1", "decode"], ["prefill-0", "prefill"], ["prefill-1", "prefill"]]
PLAN = [(22.6, "pfc_storm", "prefill-1", "prefill", 5.8), (41.0, "process_kill", "decode-0", "decode", 3.0),
        (75.5, "pfc_storm", "prefill-0", "prefill", 6.2), (120.2, "process_hang", "decode-1", "decode", 4.4),
        (150.0, "process_kill", "decode-0", "decode", 2.0)]
RESULTS = [("recovered", "served through again 0.3 s after healthy", 0.41),
           ("not recovered", "never served again within 30 s of healthy <b>", None),
           ("recovered", "served through again 0.2 s after healthy", None),
           ("undecided", "rescheduling interval straddles the 3 s limit", 2.9),
           ("not injected", "decode role at its share of faults", None)]


def _schedule() -> dict:
    return {"seed": 11, "duration_s": 180.0, "faults_per_min": 2.5, "max_role_share": 0.5,
            "kinds": ["pfc_storm", "process_hang", "process_kill"], "inventory": INVENTORY,
            "faults": [{"index": i, "offset_s": off, "kind": kind, "target": target, "role": role, "hold_s": hold,
                        "planned_until_s": off + hold + 8.0} for i, (off, kind, target, role, hold) in enumerate(PLAN)]}


def _rows(n: int, rss0: float, growth: float) -> list:
    return [[i * 0.5, rss0 + growth * i, 40 + i % 3, 12, None if i % 50 == 0 else i % 7] for i in range(n)]


def _window(w, a: float, b: float, n: int, status: str, p99: float) -> dict:
    return {"window": w, "start_s": a, "end_s": b, "requests": n, "status": status,
            "ttft": {"status": status, "reason": f"TTFT p99 {p99} ms", "p50_ms": 80.1, "p99_ms": p99},
            "tpot": {"status": "pass", "reason": "TPOT within", "p50_ms": 12.0, "p99_ms": 40.2}}


def soak_dict() -> dict:
    outcomes = []
    for i, ((off, kind, target, _, hold), (status, why, resched)) in enumerate(zip(PLAN, RESULTS)):
        injected = status != "not injected"
        outcomes.append({"index": i + 1, "kind": kind, "target": target, "planned_offset_s": off,
                         "offset_s": off + 0.3 if injected else None, "hold_s": hold, "status": status, "why": why,
                         "reschedule_s": resched, "inject_wall": T0 + off if injected else None,
                         "reverted_wall": T0 + off + hold if injected else None,
                         "back_after_healthy_s": 0.3 if status == "recovered" else None, "detail": ""})
    return {"schedule": _schedule(), "outcomes": outcomes,
            "by_kind": {"pfc_storm": {"scheduled": 2, "recovered": 2, "not recovered": 0, "undecided": 0,
                                      "not injected": 0},
                        "process_kill": {"scheduled": 2, "recovered": 0, "not recovered": 1, "undecided": 0,
                                         "not injected": 1},
                        "process_hang": {"scheduled": 1, "recovered": 0, "not recovered": 0, "undecided": 1,
                                         "not injected": 0}},
            "windows": [_window(1, 0.0, 60.0, 812, "pass", 310.0), _window(2, 60.0, 120.0, 790, "fail", 2400.0),
                        _window(3, 120.0, 180.0, 805, "inconclusive", 1000.0),
                        _window("whole run", 0.0, 180.0, 2407, "fail", 1200.0)],
            "leaks": {"samples_taken": 720, "duration_s": 359.5, "series_columns": ["t_rel_s", "rss_mb", "fds", "threads",
                                                                               "kv_blocks_used"],
                      "series": {"decode-0": _rows(720, 900.0, 0.05), "decode-1": _rows(400, 880.0, 0.0),
                                 "prefill-0": _rows(720, 700.0, 0.01)},
                      "harness_rss_mb": [[i * 0.5, 120.0 + i * 0.01] for i in range(720)],
                      "growth_note": "decode-0 grows"},
            "requests": 2407, "started": T0, "load_ended": T0 + 180.0, "leak_samples": "/tmp/run/leaks.jsonl",
            "kinds": ["pfc_storm", "process_hang", "process_kill"]}


def _render(soak: dict) -> str:
    return render_html(RunResult(run_id="20270115T080000Z-1", started=T0, finished=T0 + 200, exit_code=1,
                                 cluster={"name": "local", "kind": "bundled"}, soak=soak))


def _section(html: str) -> str:
    start = html.index('<h2 id="soak">')
    return html[start:html.index("<h2>", start)]


def test_soak_section_draws_timeline_counts_windows_leaks_and_faults():
    html = _render(soak_dict())
    sec = _section(html)
    summary = " ".join(re.search(r'<p class="meta" id="soak-summary".*?</p>', sec, re.S).group(0).split())
    assert "Soak of 180 s (load ran 180 s from" in summary
    assert "seed 11: replay with <code>--soak-seed=11 --soak=3m</code>" in summary
    assert "2407 requests" in summary and "5 faults scheduled, 4 injected" in summary
    assert "dry run" not in sec
    # the timeline: a lane per worker, a bar per fault coloured by its verdict, with a tooltip
    assert re.findall(r'class="tick lane" data-lane="([\w-]+)"', sec) == [w for w, _ in INVENTORY]
    bars = re.findall(r'<rect class="fault-bar" data-index="(\d+)" data-status="([\w ]+)" data-target="([\w-]+)"'
                      r'[^>]*fill="(#\w+)"[^>]*><title>([^<]*)</title>', sec)
    assert [(int(i), s, t) for i, s, t, _, _ in bars] == [
        (1, "recovered", "prefill-1"), (2, "not recovered", "decode-0"), (3, "recovered", "prefill-0"),
        (4, "undecided", "decode-1"), (5, "not injected", "decode-0")]
    assert [c for *_, c, _ in bars] == ["#16a34a", "#dc2626", "#16a34a", "#d97706", "#9ca3af"]
    assert bars[0][4] == ("#1 pfc_storm on prefill-1, +22.9 s for 5.8 s: recovered: served through again 0.3 s "
                          "after healthy")
    assert "within 30 s of healthy &lt;b&gt;" in bars[1][4]   # escaped, never markup
    assert 'data-plot="soak-timeline" data-points="5"' in sec
    assert re.findall(r'class="soak-window" data-status="(\w+)"', sec) == ["pass", "fail", "inconclusive"]
    # faults by kind
    kinds = {m.group(1): dict(re.findall(r'data-count="([\w ]+)">(\d+)<', m.group(2)))
             for m in re.finditer(r'<tr class="soak-kind" data-kind="(\w+)">(.*?)</tr>', sec, re.S)}
    assert kinds["process_kill"] == {"scheduled": "2", "recovered": "0", "not recovered": "1", "undecided": "0",
                                     "not injected": "1"}
    assert set(kinds) == {"pfc_storm", "process_kill", "process_hang"}
    assert re.search(r'class="soak-kind-total"><td><b>all</b></td>\s*<td class="num"><b>5</b></td>', sec)
    # the windows
    rows = re.findall(r'<tr class="soak-window-row" data-window="([\w ]+)" data-status="(\w+)">(.*?)</tr>', sec, re.S)
    assert [(w, s) for w, s, _ in rows] == [("1", "pass"), ("2", "fail"), ("3", "inconclusive"), ("whole run", "fail")]
    assert "+60–120 s" in rows[1][2] and ">2400</td>" in rows[1][2] and 'badge fail' in rows[1][2]
    assert "TTFT: TTFT p99 2400.0 ms" in rows[1][2]
    # leak small multiples: a line per worker in each panel, downsampled, and the harness's RSS
    for name in ("rss-mb", "fds", "threads", "kv-blocks-used", "harness-rss-mb"):
        assert f'data-plot="soak-leak-{name}"' in sec
    rss = re.search(r'<svg class="plot" data-plot="soak-leak-rss-mb".*?</svg>', sec, re.S).group(0)
    lines = re.findall(r'<polyline class="series" data-series="([\w-]+)" points="([^"]*)"', rss)
    assert [w for w, _ in lines] == ["decode-0", "decode-1", "prefill-0"]
    assert all(len(p.split()) <= 300 for _, p in lines)
    kv = re.search(r'data-plot="soak-leak-kv-blocks-used".*?</svg>', sec, re.S).group(0)
    assert kv.count('data-series="decode-0"') > 1   # a missing KV reading breaks the line
    assert 'id="soak-leak-legend"' in sec and "harness (its own panel)" in sec and "decode-0 grows" in sec
    # every fault, folded
    faults = re.search(r'<details id="soak-faults">.*?</details>', sec, re.S).group(0)
    assert "Every fault (5)" in faults
    assert re.findall(r'class="soak-fault" data-index="(\d)" data-status="([\w ]+)"', faults)[1] == ("2", "not recovered")
    assert "0.41 s" in faults and '<span class="badge not-run">not injected</span>' in faults


def test_no_soak_no_section():
    html = _render({})
    assert 'id="soak"' not in html and "soak-timeline" not in html


def test_dry_run_shows_the_plan():
    html = _render({"schedule": _schedule()})
    sec = _section(html)
    assert 'id="soak-dry-run"' in sec and "dry run: nothing injected" in sec
    assert "Soak schedule (dry run: planned, nothing injected)" in sec
    assert set(re.findall(r'class="fault-bar" data-index="\d" data-status="([\w ]+)"', sec)) == {"planned"}
    assert len(re.findall(r'class="fault-bar"', sec)) == 5
    summary = " ".join(re.search(r'<p class="meta" id="soak-summary".*?</p>', sec, re.S).group(0).split())
    assert "A planned soak of 180 s" in summary and "5 faults scheduled (" in summary
    assert "requests" not in summary and ", 0 injected" not in summary
    kinds = dict(re.findall(r'data-kind="(\w+)"><td>\w+</td>\s*<td class="num" data-count="scheduled">(\d+)<', sec))
    assert kinds == {"pfc_storm": "2", "process_kill": "2", "process_hang": "1"}
    assert "soak-windows" not in sec and "soak-leaks" not in sec and "Every fault (5)" in sec


@pytest.mark.parametrize("mutate", [
    lambda s: s.pop("by_kind"),                                     # counted from the outcomes instead
    lambda s: s.pop("schedule"),                                    # outcomes alone
    lambda s: s.update(leaks={"series": {}, "harness_rss_mb": []}),  # no readings
    lambda s: s.update(windows=[{"window": 1}], outcomes=[{"index": 9, "status": "odd"}]),
    lambda s: s["leaks"].update(series={"decode-0": {"1234": _rows(10, 1, 1), "5678": _rows(10, 2, 1)}}),
])
def test_partial_or_older_dicts_still_render(mutate):
    soak = soak_dict()
    mutate(soak)
    sec = _section(_render(soak))
    assert 'id="soak-timeline"' in sec and 'id="soak-error"' not in sec


def test_counts_without_by_kind_come_from_outcomes_and_per_process_series_draw_each_process():
    soak = soak_dict()
    soak.pop("by_kind")
    view = soak_view(soak)
    kill = next(r for r in view.by_kind if r["kind"] == "process_kill")
    assert (kill["scheduled"], kill["not recovered"], kill["not injected"]) == (2, 1, 1)
    labels = [label for label, _ in leak_lines({"decode-0": {"1234": [[0, 1, 2, 3, 4]], "5678": [[1, 1, 2, 3, 4]]}},
                                               ["t_rel_s", "rss_mb", "fds", "threads", "kv_blocks_used"])]
    assert labels == ["decode-0 (pid 1234)", "decode-0 (pid 5678)"]
    assert duration(180.0) == "3m" and duration(5400.0) == "1h30m" and duration(95.0) == "1m35s"


def test_a_broken_soak_dict_says_so_instead_of_failing_the_report():
    soak = copy.deepcopy(soak_dict())
    soak["schedule"]["faults"][0]["offset_s"] = "soon"
    soak["windows"] = [{"window": 1, "start_s": "x", "end_s": None}]
    html = _render(soak)
    assert 'id="soak"' in html   # drawn, or its error shown: never a crashed report
    assert soak_view({"schedule": {"faults": 3}, "outcomes": 7}) is not None


def test_a_window_with_requests_left_out_in_a_steal_burst_says_how_many():
    """soak.slo leaves out the requests in flight during a VM steal burst (harness/checks/soak.py):
    the window's row and its strip's tooltip say how many beside the requests judged; a row with
    none says nothing. Planted defect it fails on: ``left_out`` dropped from the rows the template
    reads (the count would vanish from the report while the verdict's reason still gives it)."""
    soak = soak_dict()
    soak["windows"][1]["left_out"] = 121
    sec = _section(_render(soak))
    rows = re.findall(r'<tr class="soak-window-row" data-window="([\w ]+)" data-status="(\w+)">(.*?)</tr>', sec, re.S)
    assert 'data-left-out="121"' in rows[1][2] and "(+121 left out)" in rows[1][2]
    assert "left out" not in rows[0][2] and "left out" not in rows[2][2]
    assert "790 requests, 121 left out (VM steal bursts)" in sec
