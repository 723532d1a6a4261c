"""The plugin end to end on small throwaway suites (run as a real `pytest` subprocess): exit codes,
reports, option and cluster-file errors. No cluster is brought up: these suites only record
verdicts or use the cluster spec (a run with a real fault held: tests/harness/test_plugin_faults.py)."""

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.harness.plugin_runs import HEADER, results, run_suite

pytestmark = pytest.mark.slow  # every test runs pytest as a subprocess


def test_all_pass_exits_0_and_writes_the_report(tmp_path):
    proc = run_suite(tmp_path, """
        def test_ok(conformance):
            conformance.record(verdict(1.2))
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = results(tmp_path)
    assert data["exit_code"] == 0 and data["verdicts"][0]["status"] == "pass"
    assert data["verdicts"][0]["test"] == "suites/test_suite.py::test_ok"
    assert data["cluster"]["name"] == "local"
    run_dir = (tmp_path / "reports" / "latest").resolve()
    assert {"report.html", "junit.xml", "results.json"} <= {p.name for p in run_dir.iterdir()}
    assert "exit 0: conformant" in proc.stdout and "report.html" in proc.stdout
    assert "PASS" in proc.stdout  # the progress line printed when the verdict was recorded


def test_a_failing_verdict_exits_1_and_fails_the_test(tmp_path):
    proc = run_suite(tmp_path, """
        def test_slow(conformance):
            conformance.record(verdict(4.5))

        def test_fast(conformance):
            conformance.record(verdict(0.5))
    """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed, 1 passed" in proc.stdout
    assert "p100 rescheduling time was 4.5 s, required <= 3 s" in proc.stdout
    data = results(tmp_path)
    assert [v["status"] for v in data["verdicts"]] == ["fail", "pass"] and not data["harness_errors"]
    suite = ET.parse(tmp_path / "reports" / "latest" / "junit.xml").getroot().find("testsuite")
    assert suite.get("failures") == "1"


def test_inconclusive_exits_2(tmp_path):
    proc = run_suite(tmp_path, """
        def test_unknown(conformance):
            conformance.record(verdict(None))
    """)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert results(tmp_path)["exit_meaning"] == "inconclusive"


def test_an_exception_outside_a_verdict_exits_3_even_with_a_failure(tmp_path):
    proc = run_suite(tmp_path, """
        def test_fail(conformance):
            conformance.record(verdict(9.0))

        def test_crash(conformance):
            raise RuntimeError("load generator vanished")
    """)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    errors = results(tmp_path)["harness_errors"]
    assert len(errors) == 1 and "RuntimeError: load generator vanished" in errors[0]


def test_a_harness_error_prints_its_message_not_the_libraries_traceback(tmp_path):
    """Issue 37: a cluster whose API is down printed ~150 lines of httpx traceback before the clear
    "is not reachable (fix: ...)". An error the harness raises on purpose (here a ProbeError raised
    from a library's ConnectionRefusedError inside a fixture) is shown as its message and fix; -vv
    still shows the traceback; a bare RuntimeError keeps its traceback. Planted defect: the report's
    longrepr left as pytest's (the library frames and "raise ... from" chain come back)."""
    body = """
        def _connect():
            raise ConnectionRefusedError(111, "Connection refused in a library frame")

        @pytest.fixture
        def api():
            from harness.errors import ProbeError
            try:
                _connect()
            except OSError as exc:
                raise ProbeError("API http://127.0.0.1:9 is not reachable", fix="check endpoints.api") from exc

        def test_needs_api(conformance, api):
            conformance.record(verdict(1.0))

        def test_crash(conformance):
            raise RuntimeError("load generator vanished")
    """
    proc = run_suite(tmp_path, body)
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr
    assert "ProbeError: API http://127.0.0.1:9 is not reachable (fix: check endpoints.api)" in out
    assert "in a library frame" not in out and "def _connect" not in out, out   # no chain, no frames
    assert 'raise RuntimeError("load generator vanished")' in out   # an unexpected error keeps its traceback
    verbose = run_suite(tmp_path, body, "-vvv")   # run_suite passes -q: -vvv is -vv
    assert "in a library frame" in verbose.stdout   # -vv: the whole story


def test_a_skipped_suite_s_message_is_its_reason_not_a_tuple(tmp_path):
    """Issue 37: the soak's skip reason showed in the report's test table as a raw Python tuple
    ``('suites/test_soak.py', 52, 'Skipped: ...')``. Planted defect: the message taken from
    pytest's longreprtext for a skip (the tuple's repr)."""
    run_suite(tmp_path, """
        def test_ok(conformance):
            conformance.record(verdict(1.0))

        def test_soak(conformance):
            pytest.skip("the soak runs only with --soak=DURATION")
    """)
    tests = {t["nodeid"].split("::")[1]: t for t in results(tmp_path)["tests"]}
    assert tests["test_soak"]["outcome"] == "skipped"
    assert tests["test_soak"]["message"] == "the soak runs only with --soak=DURATION", tests["test_soak"]


def test_a_crashed_suite_still_gives_its_items_an_error_row(tmp_path):
    proc = run_suite(tmp_path, """
        @pytest.mark.item("6.1.4", "nothing-lost")
        def test_crash(conformance):
            conformance.record(verdict(1.0))
            raise RuntimeError("load generator vanished")
    """)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    data = results(tmp_path)
    rows = {v["item"]: v for v in data["verdicts"]}
    assert rows["6.1.4"]["status"] == "pass"  # what the test judged before it crashed stays
    assert rows["nothing-lost"]["status"] == "error"
    assert rows["nothing-lost"]["reason"].startswith("error: ") and "load generator vanished" in rows["nothing-lost"]["reason"]
    assert "nothing-lost" not in data["coverage"]["not_run"]


def test_pytest_usage_errors_exit_3_not_4(tmp_path):
    """pytest's own usage error (4) would read as the harness's "a revert failed". Planted defect:
    without harness/plugin.py's trial parse (pytest_load_initial_conftests) an option typo exits 4
    (checked); without its pytest_cmdline_main wrapper a missing path does."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "nosuchdir/", "-p", "no:cacheprovider"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "file or directory not found: nosuchdir/" in proc.stderr
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "test_suite.py").write_text(HEADER + "\ndef test_ok(conformance):\n    conformance.record(verdict(1.0))\n")
    for typo in ("--clustr=x", "--dry-rn"):  # an option pytest cannot parse: found while reading the command line
        proc = subprocess.run([sys.executable, "-m", "pytest", "suites/", "-p", "no:cacheprovider", typo], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert f"error: unrecognized arguments: {typo}" in proc.stderr
        assert "harness: exit 3 (pytest usage error" in proc.stderr
        # issue 37: the option meant (planted: report_usage_error without the known options: no line)
        assert f"harness: {typo.split('=')[0]}: did you mean {'--cluster' if 'cl' in typo else '--dry-run'}?" \
            in proc.stderr, proc.stderr
        assert not (tmp_path / "reports").exists()  # refused before anything ran


def test_help_and_version_still_exit_0(tmp_path):
    """The trial parse of the command line (pytest_load_initial_conftests) must leave pytest's own
    --help and --version alone, with a typo beside them as pytest itself does. Planted defect: the
    trial parse run for --help too (the early return removed) makes `pytest --help --clustr=x`
    exit 3; a trial parse that replaced pytest's parse would lose the harness's options from --help."""
    for args in (["--help"], ["-h"], ["--version"], ["--help", "--clustr=x"]):
        proc = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
        assert "harness: exit" not in proc.stderr, (args, proc.stderr)
        if "--version" in args:
            assert proc.stdout.startswith("pytest ") or proc.stderr.startswith("pytest "), proc.stdout + proc.stderr
        else:
            assert "--cluster=" in proc.stdout and "--soak" in proc.stdout, proc.stdout[-2000:]
    assert not (tmp_path / "reports").exists()


def test_a_conformance_test_that_records_no_verdict_exits_3_naming_it(tmp_path):
    proc = run_suite(tmp_path, """
        def test_measures_nothing(conformance):
            pass

        def test_ok(conformance):
            conformance.record(verdict(1.0))
    """)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    errors = results(tmp_path)["harness_errors"]
    assert len(errors) == 1 and "test_measures_nothing recorded no verdict" in errors[0]
    assert "1 failed, 1 passed" in proc.stdout


def test_a_failed_revert_exits_4(tmp_path):
    proc = run_suite(tmp_path, """
        @pytest.fixture
        def dirty():
            yield
            raise RevertError("process_hang on decode-0: still stopped", fix="kill -CONT it")

        def test_with_fault(conformance, dirty):
            conformance.record(verdict(0.4))
    """)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "still stopped" in results(tmp_path)["revert_failures"][0]
    assert "revert failed" in proc.stdout


def test_a_broken_suite_file_exits_3(tmp_path):
    proc = run_suite(tmp_path, "def test_x(:\n")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "collection error" in results(tmp_path)["harness_errors"][0]


def test_malformed_cluster_file_exits_3_naming_file_field_and_fix(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("kind: bundled\nbundled: {decode: -1}\n")
    proc = run_suite(tmp_path, """
        def test_ok(conformance):
            conformance.record(verdict(1.0))
    """, f"--cluster={bad}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert str(bad) in out and "`bundled.decode`" in out and "fix:" in out
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("option", ["--load-users=0", "--kills=many", "--load-rate=-1", "--cluster=nope"])
def test_bad_options_exit_3(tmp_path, option):
    proc = run_suite(tmp_path, """
        def test_ok(conformance):
            conformance.record(verdict(1.0))
    """, option)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert option.split("=")[0] in proc.stdout + proc.stderr


def test_plain_tests_are_left_alone(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_plain.py").write_text("def test_a():\n    assert 1 == 2\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
                           f"--report-dir={tmp_path / 'reports'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and not (tmp_path / "reports").exists()


def test_latency_faults_and_timeline_reach_the_report(tmp_path):
    proc = run_suite(tmp_path, """
        from harness.faults import Action, FaultRecord, RecordStatus
        from harness.probes.client.records import RequestRecord, process_anchor
        from harness.probes.client.timeline import merge_timeline
        import time

        def test_data(conformance):
            a = process_anchor()
            now = time.perf_counter_ns()
            records = [RequestRecord(request_id=str(i), sent_ns=now + i * 10**8, scheduled_ns=now + i * 10**8,
                                     first_token_ns=now + i * 10**8 + 5 * 10**7, end_ns=now + i * 10**8 + 9 * 10**7,
                                     chunk_ns=[now + i * 10**8 + 5 * 10**7] * 2, chunk_tokens=[1, 1],
                                     anchor_wall_ns=a.wall_ns, anchor_mono_ns=a.mono_ns, anchor_perf_ns=a.perf_ns)
                       for i in range(20)]
            t = time.time()
            faults = [FaultRecord("f1", "process_kill", "decode-0", Action.INJECT, t, time.monotonic(), t + 0.01,
                                  time.monotonic() + 0.01),
                      FaultRecord("f1", "process_kill", "decode-0", Action.REVERT, t + 1, time.monotonic() + 1,
                                  t + 2, time.monotonic() + 2)]
            conformance.add_latency(records, window_s=0.5)
            conformance.add_fault_records(faults)
            conformance.add_timeline(merge_timeline(faults=faults, events=[
                {"seq": 1, "type": "worker_down", "wall_time": t + 0.05, "worker": "decode-0"}]))
            conformance.record(verdict(0.5))
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = results(tmp_path)
    assert {row["metric"] for row in data["latency"]} == {"ttft_ms", "tpot_ms"}
    ttft = [row for row in data["latency"] if row["metric"] == "ttft_ms"]
    assert sum(row["n"] for row in ttft) == 20 and all(abs(row["p50"] - 50.0) < 1.0 for row in ttft)
    [window] = data["fault_windows"]
    assert window["end"] - window["start"] == pytest.approx(2.0) and "decode-0" in window["label"]
    assert [e["kind"] for e in data["timeline"]] == ["fault_inject", "worker_down", "fault_revert"]
    html = (tmp_path / "reports" / "latest" / "report.html").read_text()
    assert html.count('class="fault-window"') == 2 and "worker_down" in html

