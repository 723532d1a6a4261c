"""The report of a real suite run (ECC, NIC flap and 6.1.3 on the bundled cluster with its emulated
fabric; tests/report/data/real_run_results.json, trimmed from the run's results.json), rendered and
opened in headless Chromium: each chart answers its question in its threshold's units, with the
threshold line drawn and the judged figure coloured as the verdict says; events appear once; every
verdict row names its suite; the counts at the top cover every checklist item.

The recorded run predates the dedupe: its timeline holds the ECC suite's engine events three times
(each later suite read the router's whole log), as a user's old results.json would."""

import copy
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from harness.report import RunResult, write_reports
from harness.report.jsonout import read_json

DATA = Path(__file__).parent / "data" / "real_run_results.json"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")]


def _dom(tmp_path: Path, result: RunResult) -> str:
    report = write_reports(result, tmp_path / "reports") / "report.html"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", report.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


def _plots(dom: str) -> dict[str, str]:
    """Each drawn plot's whole <svg> element, by its data-plot name."""
    return {m.group(1): m.group(0) for m in re.finditer(r'<svg class="plot" data-plot="([\w-]+)".*?</svg>', dom, re.S)}


def _judged(svg: str) -> tuple[str, Counter]:
    verdict = re.search(r'data-verdict="(\w+)"', svg).group(1)
    return verdict, Counter(re.findall(r'class="measured (\w+)"', svg))


def _check_judged_plot(svg: str, status: str) -> None:
    assert 'class="threshold"' in svg  # the line the figure is judged against
    verdict, marks = _judged(svg)
    assert verdict == status and marks, (verdict, marks)
    assert (marks["bad"] == 0) if status == "pass" else (marks["bad"] > 0)


def test_each_chart_of_a_real_run_answers_its_question(tmp_path):
    raw = json.loads(DATA.read_text())
    engine = [(e["kind"], e["detail"]) for e in raw["timeline"] if e["source"] == "engine"]
    assert len(engine) > len(set(engine))  # the recorded duplicates this report must not show
    dom = _dom(tmp_path, read_json(DATA))
    plots = _plots(dom)

    status = {v["item"]: v["status"] for v in raw["verdicts"]}
    # ECC: blocks left in service against 0, quarantined only as grey context
    ecc = plots["ecc-left-in-service"]
    _check_judged_plot(ecc, status["ecc"])
    assert "allowed left in service: &lt;= 0" in ecc and ecc.count('class="bar context"') == 4
    # 6.1.3: KV use over time against the Level 2/3 triggers, the level as steps below
    _check_judged_plot(plots["item3-kv-use"], status["6.1.3"])
    assert "Level 2 trigger &gt;= 85%" in plots["item3-kv-use"] and "Level 3 trigger &gt;= 90%" in plots["item3-kv-use"]
    assert int(re.search(r'data-points="(\d+)"', plots["item3-level"]).group(1)) > 0
    # NIC flap: every probe transfer before and after, the median before and its 95 %, and the
    # engine's own transfers during the flaps
    flap = plots["nic-flap"]
    _check_judged_plot(flap, status["nic-flap"])
    assert "95% of before (required)" in flap and "before the flaps (8, in order)" in flap
    assert "after the flaps (22)" in flap and plots["nic-flap-engine"].count('class="point"') >= 40
    # the 6.1.3 level bars and the ECC request counts are no longer drawn against a threshold
    assert 'class="distribution"' not in dom

    # latency: readable titles, SLO lines, numbered fault bands keyed by suite, gaps left open
    for metric, title in (("ttft_ms", "TTFT: time to first token"), ("tpot_ms", "TPOT: time per output token")):
        chart = plots[f"latency-{metric}"]
        assert title in chart and "SLO p50" in chart and "SLO p99" in chart
        assert chart.count('class="fault-window"') == 3  # ECC x4, the flap, 6.1.3's fill steps
        assert chart.count('data-series="p50"') >= 3  # no line across the gaps between suites
    key = re.search(r'<ol class="band-key.*?</ol>', dom, re.S).group(0)
    assert "test_ecc_poisoning.py</code>: ecc_poison decode-1 x3, ecc_poison decode-0" in key
    assert "test_nic_flap.py</code>: nic_flap fab0 in pdh-h2" in key and "http://" not in key

    # events once; counted per kind and suite; kv_transfer as rates, not listed
    ids = re.findall(r'data-event-id="([^"]+)"', dom)
    assert ids and len(ids) == len(set(ids))
    assert re.search(r'<tr class="event-kind" data-kind="fault_state" data-count="20"', dom)  # 8 + 12, not 36
    assert 'data-kind="kv_transfer"' in dom and "/s)" in dom
    assert '<details class="event-group" data-kind="kv_transfer"' not in dom

    # every verdict row names its suite; the three nothing-lost rows differ by it
    rows = re.findall(r'<tr class="verdict" data-item="([\w.-]+)" data-status="\w+" data-suite="([^"]+)"', dom)
    assert len(rows) == 6 and all(suite.endswith(".py") for _, suite in rows)
    assert len({suite for item, suite in rows if item == "nothing-lost"}) == 3
    # the counts cover every checklist item: 4 judged, 6 not run
    counts = re.search(r'id="item-counts" data-items="(\d+)">Checklist items \(\d+\):\s+(\d+) pass, (\d+) fail, '
                       r'(\d+) inconclusive, (\d+) error,\s+(\d+) not run', dom)
    assert counts and int(counts.group(1)) == sum(map(int, counts.groups()[1:])) == 10
    assert counts.groups()[1:] == ("4", "0", "0", "0", "6")


def test_a_failing_item_draws_its_figure_red(tmp_path):
    result = read_json(DATA)
    ecc = next(v for v in result.verdicts if v.item == "ecc")
    ecc.evidence = copy.deepcopy(ecc.evidence)
    ecc.evidence["poisonings"][1]["min_quarantined"] = 1  # one of its two blocks stayed in service
    judged = next(m for m in ecc.evidence["measurements"] if m["key"] == "poisoned_blocks_reused")
    judged.update(value=1, holds=False)
    ecc.status, ecc.measured = type(ecc.status)("fail"), 1
    plots = _plots(_dom(tmp_path, result))
    _check_judged_plot(plots["ecc-left-in-service"], "fail")
    assert _judged(plots["ecc-left-in-service"])[1] == Counter({"ok": 3, "bad": 1})
