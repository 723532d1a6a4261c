"""A harness that dies (SIGKILL) cannot stop its Locust child: Locust notices and stops by itself
within seconds, instead of sending to a dead cluster for the rest of its duration."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HARNESS = """
import sys, time
from harness.probes.loadgen.load import LoadRunner
from harness.probes.loadgen.workload import LoadProfile
run = LoadRunner("http://127.0.0.1:9", LoadProfile(users=1, duration_s=600), output_dir=sys.argv[1])
run.start()
print(run._proc.pid, flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.slow
def test_locust_stops_when_its_harness_is_killed(tmp_path):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the orphaned Locust is reaped here
    harness = subprocess.Popen([sys.executable, "-c", HARNESS, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    locust = None
    try:
        locust = int(harness.stdout.readline())
        deadline = time.monotonic() + 60
        while not _spawned(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.2)  # Locust imports and sends its first (failing) requests
        assert _spawned(tmp_path), (tmp_path / "locust.log").read_text(errors="replace")[-2000:]
        assert _state(locust) not in (None, "Z"), "Locust must be running when its harness dies"
        harness.send_signal(signal.SIGKILL)
        harness.wait()
        deadline = time.monotonic() + 30
        while _state(locust) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.1)  # waiting for Locust's parent watch (1 s) and its graceful stop
        assert _state(locust) in (None, "Z"), f"Locust (pid {locust}) still runs 30 s after its harness died"
    finally:
        if locust is not None and _state(locust) not in (None, "Z"):
            os.killpg(locust, signal.SIGKILL)
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        for _ in range(50):  # reap the orphan (and any forked worker)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.1)
            except ChildProcessError:
                break
        libc.prctl(36, 0, 0, 0, 0)


def _spawned(tmp: Path) -> bool:
    return (tmp / "requests.jsonl").exists() and (tmp / "requests.jsonl").stat().st_size > 0
