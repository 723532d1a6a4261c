"""A foreign cluster's worker inventory made concrete with real processes: pids found by pgrep
pattern and pid file, clear errors when a pattern matches nothing or too much, and a supervised
worker killed by the process fault and seen healthy again after its supervisor restarted it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from harness.errors import ConfigError, FaultError
from harness.hosts import LocalExecutor
from harness.faults.process import ProcessKill
from harness.probes.workers.inventory import is_healthy, locate_pid, resolve, wait_healthy


@pytest.fixture
def sleepers():
    procs: list[subprocess.Popen] = []

    def start(marker: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_pgrep_pattern_and_pid_file_find_the_process(sleepers, tmp_path):
    marker = f"worker-marker-{uuid.uuid4().hex}"
    p = sleepers(marker)
    ex = LocalExecutor()
    assert locate_pid({"name": "w0", "process": {"pgrep": marker}}, ex) == p.pid
    pid_file = tmp_path / "w0.pid"
    pid_file.write_text(f"{p.pid}\n")
    assert locate_pid({"name": "w0", "process": {"pid_file": str(pid_file)}}, ex) == p.pid
    workers = resolve([{"name": "w0", "role": "decode", "host": "localhost", "api": "http://127.0.0.1:9",
                        "process": {"pgrep": marker}, "supervised": True}], lambda host: ex)
    assert workers[0].pid == p.pid and workers[0].health_url == "http://127.0.0.1:9/health"
    assert workers[0].as_target() == {"id": "w0", "role": "decode", "pid": p.pid, "host": "localhost"}


def test_a_pattern_matching_nothing_or_several_processes_is_refused(sleepers, tmp_path):
    marker = f"worker-marker-{uuid.uuid4().hex}"
    ex = LocalExecutor()
    with pytest.raises(FaultError, match="matched 0 processes .*is it running"):
        locate_pid({"name": "w0", "process": {"pgrep": marker}}, ex)
    sleepers(marker), sleepers(marker)
    with pytest.raises(FaultError, match="matched 2 processes") as err:
        locate_pid({"name": "w0", "process": {"pgrep": marker}}, ex)
    assert "exactly its one process" in str(err.value)
    with pytest.raises(FaultError, match="holds no pid"):
        locate_pid({"name": "w0", "process": {"pid_file": str(tmp_path / "missing.pid")}}, ex)
    with pytest.raises(ConfigError, match="no `process:` entry"):
        locate_pid({"name": "w0"}, ex)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_supervised_worker_killed_comes_back_healthy(tmp_path):
    """A real supervisor (a shell loop) restarts a real HTTP server; the kill fault finds it by
    pattern, kills it, and its revert waits until the health URL answers from the new process."""
    port = _free_port()
    (tmp_path / "health").write_text("ok")
    # anchored: the supervisor's own command line (bash -c "while ...") contains the same words
    pattern = f"^{sys.executable} -m http.server {port}"
    loop = f"while true; do {sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {tmp_path}; done"
    supervisor = subprocess.Popen(["bash", "-c", loop], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/health"
        assert wait_healthy(url, 30) is not None
        ex = LocalExecutor()
        worker = {"name": "w0", "role": "aggregated", "host": "localhost", "api": f"http://127.0.0.1:{port}",
                  "health": url, "process": {"pgrep": pattern}, "supervised": True}
        [w] = resolve([worker], lambda host: ex)
        kill = ProcessKill.from_worker(w.as_target(), supervised=True, healthy_url=url, healthy_timeout_s=30)
        kill.prepare(ex)
        kill.inject(ex)
        assert "gone" in kill.verify(ex)
        assert "supervised" in kill.revert(ex)
        assert "healthy again" in kill.verify_reverted(ex)
        assert is_healthy(url)
        assert locate_pid(worker, ex) != w.pid  # a new process answers
        assert any("supervised" in line for line in kill.plan())
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)  # the loop and the server it runs now
        supervisor.wait()


def test_hang_process_is_found_by_its_own_locator_else_by_process(sleepers, tmp_path):
    api, engine = f"api-{uuid.uuid4().hex}", f"engine-{uuid.uuid4().hex}"
    p_api, p_engine = sleepers(api), sleepers(engine)
    ex = LocalExecutor()
    both = {"name": "w0", "process": {"pgrep": api}, "hang_process": {"pgrep": engine}}
    assert locate_pid(both, ex) == p_api.pid
    assert locate_pid(both, ex, which="hang_process") == p_engine.pid
    assert locate_pid({"name": "w0", "process": {"pgrep": api}}, ex, which="hang_process") == p_api.pid
