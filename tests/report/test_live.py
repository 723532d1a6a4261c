"""The live display in a real pytest run of a conformance test: plain status lines when stdout is
not a terminal, a rich panel on a terminal (a pty); in both, the test's own output is still
captured by pytest and the live output never lands in it."""

import os
import pty
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
    assert "[live] test_live_suite.py::test_storm | phase storm | fault none" in out
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
    assert "fault process_kill decode-0 (4 s)" in live.plain_line()
    live.fault_event(FaultRecord(fault_id="f1", kind="process_kill", target="decode-0", action=Action.REVERT,
                                 status=Status.SUCCEEDED, started_wall=104.0, started_mono=0.0))
    assert live.snapshot()["faults"] == []
    live.close()
