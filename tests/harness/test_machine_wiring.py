"""The machine monitor end to end in a real `pytest` run (subprocess): started with the `cluster`
session, every Conformance.record gated over the test's window (or the windows given), the run's
samples in results.json and drawn in report.html. The cluster is an external one attached to a
throwaway HTTP server (attaching only needs its /health to answer)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs pytest as a subprocess

SUITE = """
import time
import pytest
import harness.checks.machine as machine
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, judge

pytestmark = pytest.mark.conformance
ITEM = Checklist.load().item("6.2.ttft")


def ttft(p50_ms):
    return judge(ITEM, [Measurement(ITEM.thresholds["ttft_p50_ms"], p50_ms, "client TTFT p50")])


def test_starved(cluster, conformance, monkeypatch):
    never = dict.fromkeys(machine.LIMITS.to_dict(), 1e9)
    monkeypatch.setattr(machine, "LIMITS", machine.MachineLimits(**{**never, "timer_lag_p99_ms": -1.0}))  # always over
    time.sleep(1.5)
    conformance.record(ttft(900.0))


def test_quiet(cluster, conformance, monkeypatch):
    monkeypatch.setattr(machine, "LIMITS", machine.MachineLimits(**dict.fromkeys(machine.LIMITS.to_dict(), 1e9)))  # never over
    t0 = time.time()
    time.sleep(1.5)
    t1 = time.time()
    time.sleep(1.5)
    conformance.record(ttft(900.0), windows=[(t0, t1), (t1, time.time())])
"""


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def api_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_verdicts_are_gated_by_the_machine_and_its_samples_reach_the_report(tmp_path: Path, api_url: str):
    (tmp_path / "suites").mkdir()
    (tmp_path / "suites" / "test_suite.py").write_text(textwrap.dedent(SUITE))
    cluster = tmp_path / "ext.yaml"
    cluster.write_text(f"version: 2\nkind: external\nengine: openai\nendpoints: {{api: {api_url}}}\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites", "-p", "no:cacheprovider", "-q",
                           f"--cluster={cluster}", f"--report-dir={tmp_path / 'reports'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the quiet test's fail stands
    run = tmp_path / "reports" / "latest"
    data = json.loads((run / "results.json").read_text())
    starved, quiet = data["verdicts"]
    assert starved["status"] == "inconclusive" and "test machine CPU-starved: timer lag p99" in starved["reason"]
    assert starved["evidence"]["machine"]["gated"]["from"] == "fail"
    [window] = starved["evidence"]["machine"]["windows"]
    assert window["samples"] >= 1 and window["harness_processes"] == 1 and window["engine_processes"] == 0
    assert quiet["status"] == "fail" and quiet["evidence"]["machine"]["starved"] is None
    first, second = quiet["evidence"]["machine"]["windows"]
    assert first["end"] == second["start"] and first["samples"] + second["samples"] >= 1
    machine = data["machine"]
    assert machine["interval_s"] == 0.5 and 4 <= len(machine["samples"]) <= 300
    assert set(machine["limits"]) >= {"psi_some_pct", "watched_wait_per_run_ms", "timer_lag_p99_ms"}
    html = (run / "report.html").read_text()
    assert 'data-plot="machine-cpu"' in html and 'data-plot="machine-lag"' in html
    assert 'class="small machine-figures" data-starved="yes"' in html
