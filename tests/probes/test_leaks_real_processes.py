"""soak.leaks on readings of real processes: small Python children, one leaking memory and fds as
the planted decode leak does (clusters/local-leaky-process.yaml), one flat, each restarted once
midway as the soak's kills restart workers; sampled by the real LeakSampler (its thread, its /proc
reader, its JSON-lines file) and judged by the real check with its time figures scaled from
minutes to seconds (Rules; the limits are the shipped checklist's). The leak is ~36x the RSS limit
per hour and more for fds, so a slow shared machine (even 10x slower) still shows it far beyond."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.checklists import Checklist
from harness.checks.leaks import Rules, leak_verdict
from harness.checks.verdict import Status
from harness.engine.admin.models import AdminWorker
from harness.probes.workers.leaks import LeakSample, LeakSampler, read_samples
from tests.probes.test_external_leaks import server  # noqa: F401 -- the fixture: health and metrics URLs

LEAKER = ("import os, time\nkept = []\nwhile True:\n"
          "    kept.append(bytearray(b'x') * (1 << 20)); kept.append(os.open(os.devnull, os.O_RDONLY))\n"
          "    time.sleep(0.1)\n")
FLAT = "import time\nwhile True:\n    time.sleep(0.1)\n"
SECONDS = Rules(warmup_s=1.0, bin_s=1.0, early_span_s=5.0)   # the shipped rules with minutes made seconds
IDLE = {"decode-0": 0, "prefill-0": 0}


class Worker:
    """A role's worker as a child process; :meth:`restart` replaces it (a new pid), as a kill's revert does."""

    def __init__(self, wid: str, role: str, code: str) -> None:
        self.id, self.role, self.code = wid, role, code
        self.pids: list[int] = []
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", self.code], stdin=subprocess.DEVNULL)
        self.pids.append(proc.pid)
        return proc

    def restart(self) -> None:
        self.stop()
        self.proc = self._spawn()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def row(self) -> AdminWorker:
        return AdminWorker.parse({"id": self.id, "role": self.role, "health": "healthy", "pid": self.proc.pid,
                                  "kv_blocks_used": 0, "kv_blocks_total": 100}, "GET /admin/workers")


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """16 s of real readings (every 0.25 s) of a leaking decode worker and a flat prefill worker,
    each restarted at 8 s; the samples file and the workers' pids."""
    workers = [Worker("decode-0", "decode", LEAKER), Worker("prefill-0", "prefill", FLAT)]
    path = tmp_path_factory.mktemp("leaks") / "leaks.jsonl"
    try:
        with LeakSampler(lambda: [w.row() for w in workers], path, interval_s=0.25, local=True):
            time.sleep(8.0)
            for w in workers:
                w.restart()
            time.sleep(8.0)
    finally:
        for w in workers:
            w.stop()
    return path, {w.id: w.pids for w in workers}


def test_a_role_leaking_across_a_restart_fails_early_naming_the_role_and_its_processes(sampled):
    """Catches the issue-33 defect on real processes: a decode leak 36x the limit passing as 'under
    10 min: evidence only', and its restart resetting the evidence (each process alone lives 8 s)."""
    path, pids = sampled
    v = leak_verdict(Checklist.load(), read_samples(path), idle_before=IDLE, idle_after=dict(IDLE), rules=SECONDS)
    assert v.status is Status.FAIL, v.reason
    first, second = pids["decode-0"]
    assert v.reason.startswith(f"RSS growth of role decode (2 processes: decode-0 (pid {first}), decode-0 (pid "
                               f"{second})), one slope across restarts"), v.reason
    assert "early fail: its lower bound is over 4x the limit" in v.reason and v.interval["lo"] > 4 * 256
    failing = {m["what"].split(",")[0] for m in v.evidence["measurements"] if m["holds"] is False}
    assert any("open file descriptors growth of role decode" in w for w in failing)
    assert not any("prefill" in w for w in failing)   # the flat role is not failed beside it
    role = next(r for r in v.evidence["roles"] if r["unit"] == "role decode")
    assert role["processes"] == [f"decode-0 (pid {first})", f"decode-0 (pid {second})"]


def test_a_flat_role_restarted_at_the_same_duration_never_fails(sampled):
    """Catches a growth rule that fails healthy processes on a short run (a restart's jump, or
    start-up growth, read as a leak): the flat prefill worker's readings alone must not fail."""
    path, _ = sampled
    only = [LeakSample(s.t, s.harness, tuple(w for w in s.workers if w.role == "prefill"), s.harness_py_blocks)
            for s in read_samples(path)]
    v = leak_verdict(Checklist.load(), only, idle_before={"prefill-0": 0}, idle_after={"prefill-0": 0},
                     rules=SECONDS)
    assert v.status in (Status.PASS, Status.INCONCLUSIVE), v.reason
    assert v.status is Status.PASS, v.reason   # its KV figures are given: nothing can leave it undecided
    role = next(r for r in v.evidence["roles"] if r["unit"] == "role prefill")
    assert len(role["processes"]) == 2 and role["medians"] >= 8
    assert role["rss_mb_per_h"]["interval"]["lo"] < 4 * 256


def test_an_external_cluster_is_judged_per_role_across_a_pid_file_change(tmp_path, server):
    """The same on a cluster the harness did not start (kind: external, no admin API; vLLM, Dynamo):
    each worker found by its pid file and read from /proc through a real LocalExecutor's shell
    (harness/probes/workers/external_leaks.py), the leaking decode worker restarted midway under a new pid
    written to its pid file, with a tick between the kill and the new file. Catches the external
    reader keeping the dead pid (the restarted process never read: its leak judged on the first
    process alone, or not at all), a crash on the tick with no process, and a role judged from
    another role's readings."""
    from harness.clusterfile.models import Worker as ClusterWorker
    from harness.hosts import LocalExecutor
    from harness.probes.workers.external_leaks import ExternalLeakReader

    def entry(name: str, role: str, pid_file) -> ClusterWorker:
        return ClusterWorker.model_validate({"name": name, "role": role, "host": "localhost", "api": server,
                                             "health": f"{server}/health", "metrics": f"{server}/metrics",
                                             "process": {"pid_file": str(pid_file)}, "supervised": True})

    workers = [Worker("decode-0", "decode", LEAKER), Worker("prefill-0", "prefill", FLAT)]
    files = {w.id: tmp_path / f"{w.id}.pid" for w in workers}
    for w in workers:
        files[w.id].write_text(str(w.proc.pid))
    ex = LocalExecutor()
    reader = ExternalLeakReader([entry(w.id, w.role, files[w.id]) for w in workers], lambda host: ex, "dynamo")
    path = tmp_path / "leaks.jsonl"
    try:
        with LeakSampler(reader, path, interval_s=0.25, local=False):
            time.sleep(8.0)
            workers[0].stop()          # killed; its supervisor's new process writes the pid file later
            time.sleep(0.6)
            workers[0].proc = workers[0]._spawn()
            files["decode-0"].write_text(str(workers[0].proc.pid))
            time.sleep(8.0)
    finally:
        reader.close()
        for w in workers:
            w.stop()
    samples = list(read_samples(path))
    assert any(r.id == "decode-0" and r.process is None for s in samples for r in s.workers)   # the gap was read
    v = leak_verdict(Checklist.load(), samples, idle_before={}, idle_after={}, rules=SECONDS,
                     kv_unmeasured="not judged here")
    first, second = workers[0].pids
    assert v.status is Status.FAIL, v.reason
    assert v.reason.startswith(f"RSS growth of role decode (2 processes: decode-0 (pid {first}), decode-0 (pid "
                               f"{second})), one slope across restarts"), v.reason
    failing = [m["what"] for m in v.evidence["measurements"] if m["holds"] is False]
    assert failing and not any("prefill" in w for w in failing), failing
