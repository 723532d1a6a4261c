"""A run parses the checklist once (harness/plugin_state.py) and hands the model on: the suite
marker check, the cluster handle, crash rows, coverage and the report all read that one parse.
Counted in a real `pytest` subprocess run of a tiny suite against an external cluster file (a dry
run: nothing is contacted)."""

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

pytestmark = pytest.mark.slow  # runs pytest as a subprocess

# suites/conftest.py of the throwaway run: counts every parse of a checklist file
COUNTER = """
from pathlib import Path

from harness.checklists import models

PARSES = []
_load = models.Checklist.load.__func__


def _counted(cls, *args, **kwargs):
    PARSES.append(args)
    return _load(cls, *args, **kwargs)


models.Checklist.load = classmethod(_counted)


def pytest_unconfigure(config):
    Path(__file__).with_name("parses.txt").write_text(str(len(PARSES)))
"""

SUITE = """
import pytest

from harness.checks.verdict import Measurement, judge

pytestmark = pytest.mark.conformance


@pytest.mark.item("6.2.ttft")
def test_judged_against_the_clusters_thresholds(conformance, cluster):
    item = cluster.thresholds.item("6.2.ttft")
    conformance.record(judge(item, [Measurement(item.thresholds["ttft_p50_ms"], 180.0, "TTFT p50")]))


@pytest.mark.item("nothing-lost")
def test_crashes_before_judging(conformance):
    raise RuntimeError("boom")
"""


def test_a_run_parses_the_checklist_once_and_the_clusters_overrides_reach_the_verdict(tmp_path):
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "conftest.py").write_text(textwrap.dedent(COUNTER))
    (tmp_path / "suites" / "test_tiny.py").write_text(textwrap.dedent(SUITE))
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "mine.yaml").write_text(yaml.safe_dump({
        "name": "mine", "kind": "external", "endpoints": {"api": "http://127.0.0.1:9/v1"},
        "thresholds": {"6.2.ttft": {"ttft_p50_ms": 150}}}))
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites", "-p", "no:cacheprovider", "-q", "--dry-run",
                           "--cluster=mine", f"--report-dir={tmp_path / 'reports'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "suites" / "parses.txt").read_text() == "1", out[-3000:]
    results = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    judged = {v["item"]: v for v in results["verdicts"]}
    assert set(judged) == {"6.2.ttft", "nothing-lost"}, out[-3000:]
    measured = judged["6.2.ttft"]["evidence"]["measurements"][0]  # the cluster's override, not the shipped 200
    assert (measured["threshold"], measured["threshold_origin"]) == (150.0, str(tmp_path / "clusters" / "mine.yaml"))
    assert judged["6.2.ttft"]["status"] == "fail"  # 180 ms is not < 150 ms
    assert judged["nothing-lost"]["status"] == "error"  # its crash row: the title came from the run's checklist
    assert results["coverage"]["not_run"]  # coverage listed the checklist's other items
