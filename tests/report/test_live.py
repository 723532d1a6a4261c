"""The live display in a real pytest run of a conformance test: plain status lines when stdout is
not a terminal, a rich panel on a terminal (a pty); in both, the test's own output is still
captured by pytest and the live output never lands in it."""

import io
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.faults.base import Action, FaultRecord, RecordStatus as Status
from harness.report.live import LiveStatus

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
import pytest
from harness.checks.verdict import Verdict
pytestmark = pytest.mark.conformance

def test_storm(conformance):
    print("output-of-the-test")
    conformance.phase("storm")
    conformance.record(Verdict(item="6.1.5", title="t", status="inconclusive", reason="nothing measured"))
'''


def _env(tmp_path):
    return {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_STATE_DIR": str(tmp_path / "state"),
            "COLUMNS": "200"}


def _args(tmp_path, *extra):
    (tmp_path / "test_live_suite.py").write_text(SUITE)
    return [sys.executable, "-m", "pytest", str(tmp_path / "test_live_suite.py"), "-p", "no:cacheprovider", "-rP",
            f"--report-dir={tmp_path / 'reports'}", *extra]


def _captured_section(out: str) -> str:
    return out.split("Captured stdout call")[1].split("=====")[0]


@pytest.mark.slow  # a pytest subprocess
def test_plain_lines_when_not_a_terminal(tmp_path):
    proc = subprocess.run(_args(tmp_path), cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout
    assert proc.returncode == 2, out[-3000:]  # inconclusive
    assert re.search(r"^\[live\] \d\d:\d\d:\d\dZ test_live_suite.py \| setup \(bringing the cluster up, "
                     r"starting load\) \d+ s \| no fault active \| "
                     r"this suite: ok 0 failed 0", out, re.M), out[-3000:]
    assert "\x1b[" not in out.split("[live]")[1]  # no terminal control codes in a log
    captured = _captured_section(out)
    assert "output-of-the-test" in captured and "[live]" not in captured


@pytest.mark.slow  # a pytest subprocess
def test_rich_panel_on_a_terminal_and_off_switch(tmp_path):
    main, child = pty.openpty()
    proc = subprocess.Popen(_args(tmp_path), cwd=tmp_path, env=_env(tmp_path), stdin=subprocess.DEVNULL,
                            stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=120) == 2
    out = b"".join(chunks).decode(errors="replace")
    assert "suite" in out and "storm" in out and "degradation" in out  # the panel's rows
    assert "\x1b[?25l" in out  # rich Live hides the cursor while it draws
    assert "[live]" not in out
    captured = _captured_section(out)
    assert "output-of-the-test" in captured and "degradation" not in captured

    off = subprocess.run(_args(tmp_path, "--live=off"), cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert off.returncode == 2 and "[live]" not in off.stdout


@pytest.mark.slow  # a pytest subprocess
def test_bad_live_mode_is_a_harness_error(tmp_path):
    proc = subprocess.run(_args(tmp_path, "--live=fancy"), cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3 and "--live: 'fancy' is not one of auto, rich, plain, off" in proc.stdout + proc.stderr


def test_status_counts_records_and_tracks_fault_age(tmp_path):
    class Runner:
        output_dir = tmp_path

    now = [100.0]
    live = LiveStatus(open(os.devnull, "w"), mode="plain", clock=lambda: now[0])
    live.add_load(Runner())
    ok = '{"status": "ok", "sent_ns": 0, "first_token_ns": 50000000, "end_ns": 150000000, "chunk_tokens": [1, 1, 1]}'
    (tmp_path / "requests.jsonl").write_text(ok + "\n" + '{"status": "error"}\n' + '{"status": "o')  # last line partial
    rec = FaultRecord(fault_id="f1", kind="process_kill", target="decode-0", action=Action.INJECT,
                      status=Status.SUCCEEDED, started_wall=100.0, started_mono=0.0)
    live.fault_event(rec)
    now[0] = 104.0
    live.tick()
    s = live.snapshot()
    assert (s["ok"], s["failed"], s["ttft_p99_ms"], s["tpot_p99_ms"]) == (1, 1, 50.0, 50.0)
    assert s["faults"] == [("process_kill decode-0", 4.0)]
    assert "| fault process_kill decode-0 (4 s) |" in live.plain_line()
    live.fault_event(FaultRecord(fault_id="f1", kind="process_kill", target="decode-0", action=Action.REVERT,
                                 status=Status.SUCCEEDED, started_wall=104.0, started_mono=0.0))
    assert live.snapshot()["faults"] == []
    live.close()


def _inject(fault_id: str, target: str) -> FaultRecord:
    return FaultRecord(fault_id=fault_id, kind="hbm_fill", target=target, action=Action.INJECT,
                       status=Status.SUCCEEDED, started_wall=0.0, started_mono=0.0)


def test_plain_lines_are_stamped_short_on_their_own_line_and_at_most_one_per_interval():
    out = io.StringIO()
    now = [1_800_000_000.0]  # 2027-01-15T08:00:00Z
    live = LiveStatus(out, mode="plain", interval_s=3600, plain_every_s=10, clock=lambda: now[0])
    out.write("suites/test_ecc_poisoning.py .")  # pytest's progress dot, its cursor left mid-line
    live.begin_line()
    live.set_phase("running", test="suites/test_item3_degradation.py::test_level2_then_level3_trigger_at_their_"
                                   "thresholds")
    live.start()  # the phase's first line
    for i in range(7):  # stacked faults, each label naming the admin URL it went through
        live.fault_event(_inject(f"f{i}", f"decode-{i % 2} via http://127.0.0.1:46735/admin"))
        now[0] += 1
    live.tick()  # 7 s after the first line: none
    now[0] += 3
    live.tick()  # 10 s: the second
    live.close()
    lines = out.getvalue().split("\n")
    assert lines[0] == "suites/test_ecc_poisoning.py ."  # never glued onto pytest's output
    shown = [line for line in lines if line]
    assert len(shown) == 3 and all(line.startswith("[live] ") for line in shown[1:])
    assert shown[1].startswith("[live] 08:00:00Z test_item3_degradation.py | running 0 s | no fault active |")
    assert shown[2].startswith("[live] 08:00:10Z test_item3_degradation.py | running 10 s | faults 7: "
                               "hbm_fill decode-0 x4, decode-1 x3 (10 s) | this suite: ok 0 failed 0 |")
    assert all(len(line) < 200 for line in shown) and "http://" not in out.getvalue()


def test_counts_restart_with_each_suite(tmp_path):
    live = LiveStatus(open(os.devnull, "w"), mode="plain")
    live.set_phase("running", test="suites/test_a.py::test_a")
    live.ok, live.failed = 5, 1
    live.set_phase("teardown", test="suites/test_a.py::test_a")
    assert (live.ok, live.failed) == (5, 1)
    live.set_phase("setup", test="suites/test_b.py::test_b")
    assert (live.ok, live.failed) == (0, 0) and "this suite: ok 0 failed 0" in live.plain_line()
    live.close()


def test_rich_panel_takes_the_terminal_width_of_its_stream():
    import fcntl
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column pane
    stream = os.fdopen(child, "w")
    live = LiveStatus(stream, mode="rich", interval_s=3600)
    name = "suites/test_item3_degradation.py::test_level2_then_level3_trigger_at_their_thresholds"
    live.set_phase("running", test=name)
    live.start()
    try:
        assert live._live.console.width == 160
        lines = live._live.console.render_lines(live.renderable(), live._live.console.options)
        assert any(name in "".join(seg.text for seg in line) for line in lines)  # not cut at ~70 columns
    finally:
        live.close()
        stream.close()
        os.close(main)


def test_cluster_gauges_stay_bounded_over_a_long_run_and_keep_their_peaks(monkeypatch):
    """A 10-hour soak samples the gauges 36,000 times: the kept rows halve past MAX_SAMPLES, each
    merged row holding the larger value, so a one-tick KV spike is still in the report."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import harness.report.live as live

    values = {"kv": 0.1}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            body = (f"pdengine_kv_cache_usage_ratio {values['kv']}\npdengine_degradation_level 0\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(live, "MAX_SAMPLES", 16)
    clock = iter(range(1000)).__next__
    status = LiveStatus(io.StringIO(), mode="off", clock=lambda: float(clock()))
    try:
        status.set_cluster(f"http://127.0.0.1:{server.server_address[1]}/metrics")
        for i in range(100):
            values["kv"] = 0.93 if i == 57 else 0.1 + i / 1000
            status.tick()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    rows = status.samples
    assert 8 <= len(rows) <= 16, len(rows)
    times = [r["t"] for r in rows]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert max(r["kv_usage"] for r in rows) == 0.93   # the one-tick spike survived every merge
    assert rows[-1]["kv_usage"] >= 0.19               # the latest figures are the newest reads
