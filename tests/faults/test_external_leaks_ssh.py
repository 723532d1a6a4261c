"""An external cluster's leak readings over SSH (a real loopback sshd, tests/faults/conftest.py): the
worker's pid file read and its /proc figures taken on its host through the SSH executor, one command
each, both in the audit log, the figures the same as this machine's own /proc read of that process."""

from __future__ import annotations

from harness.hosts import AuditLog, SSHExecutor
from harness.probes.workers.external_leaks import ExternalLeakReader
from harness.probes.workers.leaks import read_process
from tests.faults.test_ssh import target
from tests.probes.test_external_leaks import worker
from tests.probes.test_leak_sampler import settled, sleeper  # noqa: F401 -- the fixture


def test_a_remote_worker_s_process_is_found_and_read_through_its_ssh_executor(sshd, sleeper, tmp_path):  # noqa: F811
    settled(sleeper.pid)
    pid_file = tmp_path / "remote.pid"
    pid_file.write_text(f"{sleeper.pid}\n")
    spec = worker("remote-0", pid_file, "http://127.0.0.1:9", metrics=False).model_copy(update={"host": "gpu-7"})
    audit = AuditLog(tmp_path / "audit.jsonl")
    with SSHExecutor(target(sshd), audit=audit) as ex:
        hosts: list[str | None] = []
        reader = ExternalLeakReader([spec], lambda host: hosts.append(host) or ex, "dynamo")
        [row] = reader()
        [again] = reader()   # the pid is kept: only /proc is read this time
    assert hosts[0] == "gpu-7" and row.pid == sleeper.pid and row.process == read_process(sleeper.pid)
    assert again.process == read_process(sleeper.pid) and row.health == "unhealthy"   # nothing answers on :9
    argvs = [e["argv"] for e in audit.entries()]
    assert argvs[0] == ["cat", str(pid_file)] and all(a[:2] == ["sh", "-c"] for a in argvs[1:]) and len(argvs) == 3
    assert all(e["host"] == f"127.0.0.1:{sshd.port}" for e in audit.entries())
