"""Leak readings of an external cluster's workers: a real ``sleep`` child as the worker process (its pid
in a pid file), read through a real LocalExecutor's shell, and a real HTTP server as its health URL and
metrics page (the Dynamo profile's KV gauges)."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest

from harness.clusterfile.models import Worker
from harness.hosts import AuditLog, LocalExecutor
from harness.probes.workers.external_leaks import ExternalLeakReader, parse_proc_output, read_processes
from harness.probes.workers.leaks import read_process, take_sample
from tests.probes.conftest import QuietHandler
from tests.probes.test_leak_sampler import settled, sleeper  # noqa: F401 -- the fixture

PAGE = ("# TYPE dynamo_component_kvstats_active_blocks gauge\n"
        'dynamo_component_kvstats_active_blocks{dp_rank="0"} 7\n'
        'dynamo_component_kvstats_active_blocks{dp_rank="1"} 5\n'
        "dynamo_component_kvstats_total_blocks 16384\n")


class _Handler(QuietHandler):
    page = PAGE

    def do_GET(self) -> None:  # noqa: N802 -- the stdlib's name
        self.reply(self.page if self.path == "/metrics" else "ok")


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    thread.join()


def worker(name: str, pid_file: Path, base: str, metrics: bool = True) -> Worker:
    return Worker.model_validate({"name": name, "role": "aggregated", "host": "localhost", "api": base,
                                  "health": f"{base}/health", "metrics": f"{base}/metrics" if metrics else None,
                                  "process": {"pid_file": str(pid_file)}, "supervised": True})


def test_the_proc_script_s_output_parses_and_a_gone_pid_is_left_out():
    text = "@12\nVmRSS:\t  2048 kB\nThreads:\t3\nfds 9\n@13\nfds 0\n@x\n"
    readings = parse_proc_output(text)
    assert set(readings) == {12}
    assert readings[12].rss_bytes == 2048 * 1024 and readings[12].threads == 3 and readings[12].fds == 9


def test_read_processes_through_the_executor_matches_proc_read_here(sleeper, tmp_path):  # noqa: F811
    settled(sleeper.pid)
    audit = AuditLog(tmp_path / "audit.jsonl")
    read = read_processes(LocalExecutor(audit=audit), [sleeper.pid, 999_999_999])
    assert set(read) == {sleeper.pid}   # the second pid does not exist
    assert read[sleeper.pid] == read_process(sleeper.pid)
    [entry] = audit.entries()           # one command for every pid of the host, audited
    assert entry["argv"][:2] == ["sh", "-c"] and str(sleeper.pid) in entry["argv"]


def test_the_reader_finds_each_worker_by_its_pid_file_and_reads_its_kv_metric(sleeper, tmp_path, server):  # noqa: F811
    settled(sleeper.pid)
    pid_file = tmp_path / "w0.pid"
    pid_file.write_text(str(sleeper.pid))
    ex = LocalExecutor()
    reader = ExternalLeakReader([worker("w0", pid_file, server)], lambda host: ex, "dynamo")
    try:
        [row] = reader()
        assert (row.id, row.role, row.pid, row.health) == ("w0", "aggregated", sleeper.pid, "healthy")
        assert row.process == read_process(sleeper.pid)
        assert (row.kv_blocks_used, row.kv_blocks_total) == (12, 16384)   # summed over its series
        assert reader.kv_blocks() == {"w0": 12} and reader.kv_unmeasured is None
        sample = take_sample(reader(), local=False)   # the sampler keeps such readings as they are
        assert sample.workers[0].process is not None and sample.workers[0].kv_blocks_used == 12

        sleeper.kill()   # killed, and its supervisor's new process not there yet: no reading
        sleeper.wait()
        [row] = reader()
        assert row.process is None and row.pid is None
        again = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)   # the restarted worker
        try:
            pid_file.write_text(str(again.pid))
            settled(again.pid)
            [row] = reader()
            assert row.pid == again.pid and row.process is not None
        finally:
            again.kill()
            again.wait()
    finally:
        reader.close()


def test_kv_that_cannot_be_read_is_named_never_zero(sleeper, tmp_path, server):  # noqa: F811
    pid_file = tmp_path / "w.pid"
    pid_file.write_text(str(sleeper.pid))
    ex = LocalExecutor()
    no_url = ExternalLeakReader([worker("w1", pid_file, server, metrics=False)], lambda host: ex, "dynamo")
    [row] = no_url()
    assert row.kv_blocks_used is None and "w1" in (no_url.kv_unmeasured or "")
    assert "no `metrics:` URL" in (no_url.kv_unmeasured or "")
    no_profile = ExternalLeakReader([worker("w2", pid_file, server)], lambda host: ex, "openai-none")
    [row] = no_profile()
    assert row.kv_blocks_used is None and row.process is not None
    assert "names no KV-blocks-in-use metric" in (no_profile.kv_unmeasured or "")
    os.kill(sleeper.pid, 0)   # the process was only read, never signalled
