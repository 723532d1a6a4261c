"""Shared fixtures of the harness-level tests."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def up_cluster(tmp_path):
    """The bundled engine under ``python -m harness up --supervise`` (1 prefill, 2 decode) and a copy of
    clusters/up-foreign.yaml pointing at it: (port, cluster file, up's log, pid dir)."""
    port, pid_dir = _free_port(), tmp_path / "pids"
    log = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "up", "--supervise", "--pid-dir", str(pid_dir),
                             "--port", str(port), "--prefill", "1", "--decode", "2", "--log-dir", str(tmp_path / "logs")],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops everything" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        text = (ROOT / "clusters" / "up-foreign.yaml").read_text()
        cluster = tmp_path / "up-foreign.yaml"
        cluster.write_text(text.replace("127.0.0.1:8300", f"127.0.0.1:{port}")
                           .replace("/tmp/harness-up-foreign", str(pid_dir)))
        yield port, cluster, tmp_path / "up.log", pid_dir
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        log.close()
    assert not any(pid_dir.glob("*.pid")), "up left pid files behind"


