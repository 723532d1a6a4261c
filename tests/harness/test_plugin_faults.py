"""The plugin with a real fault still held when a run ends (a local loopback cluster, run as a real
`pytest` subprocess): an interrupted run, and a revert in the faults fixture's teardown, both reach
the report. The rest of the plugin's end-to-end tests are in tests/harness/test_plugin.py."""

import subprocess
import sys

import pytest

from tests.harness.plugin_runs import results

pytestmark = pytest.mark.slow  # every test runs pytest as a subprocess


INTERRUPTED_SUITE = """
import os
import time
from pathlib import Path

import pytest

from harness.faults import ProcessHang

pytestmark = pytest.mark.conformance


def test_hang_then_wait(cluster, faults, timeline, conformance):
    victim = next(w for w in timeline.workers() if w["role"] == "decode")
    faults.inject(ProcessHang.from_worker(victim))
    Path(os.environ["HARNESS_TEST_MARK"]).write_text("injected")
    time.sleep(600)  # the SIGTERM lands here, the hang still active: the teardown reverts it
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_sigtermed_run_reports_the_faults_timeline_and_tests_it_did(tmp_path, signame):
    """SIGTERM (or SIGINT, Ctrl-C: pytest's KeyboardInterrupt path) while a fault is active: the run
    reverts it, exits 3, and its results.json holds the fault's inject and revert records, the fault
    on the timeline and the test that was stopped; its fault steps are on the terminal with -v only
    (planted: steps printed always, the old terminal: the -q run shows them).
    Planted defect it catches: the report written before pytest tears down an interrupted run's
    fixtures (harness/plugin.py's sessionfinish back to ``tryfirst``): faults, timeline and tests are
    empty (checked: it failed)."""
    import os
    import signal
    import time

    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_interrupted.py").write_text(INTERRUPTED_SUITE)
    mark = tmp_path / "mark"
    env = {**os.environ, "HARNESS_TEST_MARK": str(mark), "HARNESS_STATE_DIR": str(tmp_path / "state")}
    env.pop("HARNESS_RUN_ID", None)
    verbosity = "-v" if signame == "SIGINT" else "-q"   # fault steps are printed with -v only (issue 37)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "suites", "-p", "no:cacheprovider", verbosity, "--live=off",
                             "--cluster=local-loopback", f"--report-dir={tmp_path / 'reports'}"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # waiting for the suite to say its fault is injected
        assert mark.exists(), f"the suite never injected its fault (rc {proc.poll()})"
        proc.send_signal(getattr(signal, signame))
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, out[-4000:]
    # the fault's steps on the terminal with -v, not without (the report has them either way)
    assert ("  fault inject          process_hang" in out) == (verbosity == "-v"), out[-4000:]
    data = results(tmp_path)
    assert any("interrupted" in e for e in data["harness_errors"]), data["harness_errors"]
    actions = [(f["kind"], f["action"], f["status"]) for f in data["faults"]]
    assert ("process_hang", "inject", "succeeded") in actions and ("process_hang", "revert", "succeeded") in actions, actions
    assert any(e["source"] == "fault" and e["kind"] == "fault_revert" and "fault=process_hang" in e["detail"]
               for e in data["timeline"]), data["timeline"]
    assert [(t["nodeid"], t["outcome"]) for t in data["tests"]] == \
        [("suites/test_interrupted.py::test_hang_then_wait", "interrupted")], data["tests"]


TEARDOWN_REVERT_SUITE = """
import pytest

from harness.checklists import Checklist
from harness.checks.verdict import Measurement, judge
from harness.faults import ProcessHang
from harness.probes.client.timeline import merge_timeline

pytestmark = pytest.mark.conformance
ITEM = Checklist.load().item("6.1.4")


def test_timeline_then_teardown_revert(cluster, faults, timeline, conformance):
    victim = next(w for w in timeline.workers() if w["role"] == "decode")
    faults.inject(ProcessHang.from_worker(victim))
    # the suite's epilogue merges its timeline while the fault is still held ...
    conformance.add_timeline(merge_timeline(faults=faults.records, seen_events=conformance.seen_events))
    conformance.record(judge(ITEM, [Measurement(ITEM.thresholds["reschedule_p100_s"], 1.0, "p100")]))
    # ... and the faults fixture reverts it in its teardown
"""


@pytest.mark.timeout(300)
def test_a_revert_in_the_fixture_s_teardown_reaches_the_timeline(tmp_path):
    """Issue 37: the event timeline counted 24 injections and 23 reverts while the ledger held 40 and
    40: a fault reverted by the faults fixture's teardown, after the suite had merged its timeline,
    never reached it (the speculative-decoding revert of the main job). Every ledger step of the
    fault is on the timeline, each once. Planted defect: the fixture adding its records only when the
    suite added no timeline (the old rule): the revert and its check are missing."""
    import os

    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_teardown.py").write_text(TEARDOWN_REVERT_SUITE)
    env = {**os.environ, "HARNESS_STATE_DIR": str(tmp_path / "state")}
    env.pop("HARNESS_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites", "-p", "no:cacheprovider", "-q", "--live=off",
                           "--cluster=local-loopback", f"--report-dir={tmp_path / 'reports'}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = results(tmp_path)
    ledger = sorted(f"fault_{f['action']}" for f in data["faults"])
    on_timeline = sorted(e["kind"] for e in data["timeline"] if e["source"] == "fault")
    assert "fault_revert" in ledger and on_timeline == ledger, (ledger, on_timeline)
