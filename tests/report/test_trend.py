"""The report's trend (issue 36 item 4): each item's headline figure over the last runs of the same
cluster, read from the reports folder the run is written to. Built on a recorded run (nic-flap's
recovered fraction, 6.1.3's trigger, ECC and nothing-lost counts) copied as earlier runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.report import write_reports
from harness.report.jsonout import read_json
from harness.report.trend import past_runs, trends

DATA = Path(__file__).parent / "data" / "real_run_results.json"


def _earlier(reports: Path, k: int, *, cluster: str = "local", flap: float) -> str:
    """An earlier run of the recorded one: ``k`` hours before it, nic-flap's headline figure ``flap``."""
    data = json.loads(DATA.read_text())
    data["run_id"] = f"20261201T0{k}0000Z-{k}"
    data["started"] -= 3600 * (10 - k)
    data["cluster"]["name"] = cluster
    data["options"] = {**(data.get("options") or {}), "label": f"build-{k}"}
    for v in data["verdicts"]:
        if v["item"] == "nic-flap":
            v["evidence"]["measurements"][0]["value"] = flap
    (reports / data["run_id"]).mkdir(parents=True)
    (reports / data["run_id"] / "results.json").write_text(json.dumps(data))
    return data["run_id"]


def test_the_report_draws_each_figure_over_the_last_runs_of_its_cluster_oldest_first(tmp_path):
    """Planted defects: another cluster's runs in the trend; the runs newest first (this run must
    be last, beside the one before it); this run listed twice (its own results.json is in the folder
    when the report is drawn); an unreadable results.json breaking the report."""
    reports = tmp_path / "reports"
    ids = [_earlier(reports, k, flap=0.90 + k / 100) for k in (1, 2, 3)]
    _earlier(reports, 4, cluster="prod-a", flap=0.5)                 # another cluster: not in the trend
    (reports / "broken").mkdir()
    (reports / "broken" / "results.json").write_text("{not json")
    result = read_json(DATA)
    run_dir = write_reports(result, reports)

    past = past_runs(reports, "local", result.run_id)
    assert [e.run_id for e in past] == ids                            # oldest first, this run and prod-a out
    flap = next(t for t in trends(result.verdicts, past) if t.item == "nic-flap")
    assert [p.value for p in flap.points[:-1]] == [0.91, 0.92, 0.93]
    assert flap.points[-1].run == "this run" and flap.key == "kv_bandwidth_recovered_fraction"
    assert flap.threshold == 0.95 and flap.op == ">="

    html = (run_dir / "report.html").read_text()
    boxes = dict(re.findall(r'data-trend="([^"]+)" data-runs="(\d+)"', html))
    assert boxes["nic-flap.kv_bandwidth_recovered_fraction"] == "4"   # 3 earlier + this one
    assert "Trend: this run beside the last 3 of cluster local" in html
    assert "build-1" in html and "prod-a" not in html.split('id="trend"')[1].split("</section>")[0]


def test_a_first_run_has_no_trend_section(tmp_path):
    """Planted defect: an empty trend section (or a crash) when the folder holds no earlier run."""
    run_dir = write_reports(read_json(DATA), tmp_path / "reports")
    assert 'id="trend"' not in (run_dir / "report.html").read_text()
    assert past_runs(tmp_path / "missing", "local", "x") == []
