"""Throwaway suites run as a real ``pytest`` subprocess in a temporary folder, and the results.json
such a run writes: the helpers of tests/harness/test_plugin.py and test_plugin_faults.py."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

HEADER = """
import pytest
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, judge
from harness.errors import RevertError

pytestmark = pytest.mark.conformance
ITEM = Checklist.load().item("6.1.4")

def verdict(value):
    return judge(ITEM, [Measurement(ITEM.thresholds["reschedule_p100_s"], value, "p100 rescheduling time")])
"""


def run_suite(tmp_path: Path, body: str, *args: str, name: str = "test_suite.py") -> subprocess.CompletedProcess:
    suites = tmp_path / "suites"
    suites.mkdir(exist_ok=True)
    (suites / name).write_text(HEADER + textwrap.dedent(body))
    cmd = [sys.executable, "-m", "pytest", "suites", "-p", "no:cacheprovider", "-q",
           f"--report-dir={tmp_path / 'reports'}", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def results(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
