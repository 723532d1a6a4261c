"""SSHExecutor against a real loopback sshd: strict host keys, key auth, safe quoting, faults end to end."""

from __future__ import annotations

import time

import pytest

from harness import hosts
from harness.errors import ConfigError, ExecutorError
from harness.faults import FaultRunner, Ledger, ProcessHang
from harness.hosts import AuditLog, ExecutorPool, SSHExecutor, SSHTarget, executor_from_spec

from .conftest import free_port, keygen, proc_state

pytestmark = pytest.mark.slow


def target(sshd, known_hosts=None, key=None) -> SSHTarget:
    return SSHTarget(host="127.0.0.1", port=sshd.port, user=sshd.user, key_filename=str(key or sshd.user_key),
                     known_hosts_file=str(known_hosts or sshd.known_hosts))


def test_runs_commands_and_quotes_every_argument_literally(sshd, tmp_path):
    marker = tmp_path / "injected"
    tricky = ["a b", f"$(touch {marker})", f"; touch {marker}", "`id`", "it's", "*", ""]
    audit = AuditLog(tmp_path / "audit.jsonl")
    with SSHExecutor(target(sshd), audit=audit) as ex:
        res = ex.run(["printf", "%s|", *tricky], timeout=20)
        assert res.rc == 0
        assert res.stdout == "".join(f"{a}|" for a in tricky)
        assert not marker.exists(), "an argument was interpreted by the remote shell"
        failed = ex.run(["sh", "-c", "echo oops >&2; exit 3"], timeout=20, check=False)
        assert (failed.rc, failed.stderr) == (3, "oops\n")
        with pytest.raises(ExecutorError, match="rc=3"):
            ex.run(["sh", "-c", "exit 3"], timeout=20)
    lines = audit.entries()
    assert [e["argv"][0] for e in lines] == ["printf", "sh", "sh"]
    assert [e["rc"] for e in lines] == [0, 3, 3]
    assert all(e["host"] == f"127.0.0.1:{sshd.port}" and e["dry_run"] is False for e in lines)


def test_unknown_host_key_is_rejected(sshd):
    empty = sshd.known_hosts_with("", "known_hosts_empty")
    with SSHExecutor(target(sshd, known_hosts=empty)) as ex, pytest.raises(ExecutorError) as err:
        ex.run(["true"], timeout=20)
    assert "unknown" in str(err.value) and str(empty) in str(err.value)
    assert empty.read_text() == "", "a host key must never be learned"


def test_changed_host_key_is_rejected_naming_the_file_and_the_fix(sshd, tmp_path):
    impostor_pub = keygen(tmp_path / "impostor")
    stale = sshd.known_hosts_with(impostor_pub, "known_hosts_stale")
    with SSHExecutor(target(sshd, known_hosts=stale)) as ex, pytest.raises(ExecutorError) as err:
        ex.run(["true"], timeout=20)
    message = str(err.value)
    assert "CHANGED" in message and str(stale) in message and "ssh-keygen -R" in message


def test_key_not_authorized_is_a_clear_error(sshd, tmp_path):
    keygen(tmp_path / "stranger")
    with SSHExecutor(target(sshd, key=tmp_path / "stranger")) as ex, pytest.raises(ExecutorError, match="authentication"):
        ex.run(["true"], timeout=20)


def test_nothing_listening_is_a_clear_error(sshd):
    closed = SSHTarget(host="127.0.0.1", port=free_port(), user=sshd.user, key_filename=str(sshd.user_key),
                       known_hosts_file=str(sshd.known_hosts))
    with SSHExecutor(closed) as ex, pytest.raises(ExecutorError, match="cannot reach") as err:
        ex.run(["true"], timeout=20)
    assert "sshd is running" in err.value.fix


def test_target_requires_existing_key_and_known_hosts(sshd, tmp_path):
    with pytest.raises(ConfigError, match="known_hosts_file"):
        target(sshd, known_hosts=tmp_path / "missing")


def test_output_that_comes_after_the_exit_status_is_kept(sshd):
    """sshd sends the exit status when the command exits; a child it left writes later, on the
    same stdout, before the channel's EOF. Reading only until the status lost that line."""
    with SSHExecutor(target(sshd)) as ex:
        res = ex.run(["sh", "-c", "(sleep 0.3; echo late; echo late-err >&2) & echo early"], timeout=20)
    assert (res.rc, res.stdout, res.stderr) == (0, "early\nlate\n", "late-err\n")


def test_a_child_that_keeps_the_output_open_does_not_hold_the_command_past_the_grace(sshd, monkeypatch):
    """The command exits, a child it left keeps stdout open (no EOF for 3 s): the run returns
    EOF_GRACE_S after the exit status, with what came, instead of waiting for the child."""
    monkeypatch.setattr(hosts, "EOF_GRACE_S", 0.5)
    with SSHExecutor(target(sshd)) as ex:
        t0 = time.monotonic()
        res = ex.run(["sh", "-c", "sleep 3 & echo early"], timeout=20)
        took = time.monotonic() - t0
    assert (res.rc, res.stdout) == (0, "early\n")
    assert 0.5 <= took < 2.5, took


def test_timeout_is_enforced(sshd):
    with SSHExecutor(target(sshd)) as ex, pytest.raises(ExecutorError, match="timed out"):
        ex.run(["sleep", "30"], timeout=1)


def test_process_hang_over_ssh_end_to_end(sshd, tmp_path, victim):
    proc = victim()
    ledger = Ledger.for_cluster("ssh-test", tmp_path)
    pool = ExecutorPool({"node-1": target(sshd)}, audit=AuditLog(tmp_path / "audit.jsonl"))
    worker = {"id": "decode-0", "role": "decode", "pid": proc.pid, "host": "node-1"}
    with FaultRunner(ledger, pool, handle_signals=False) as runner:
        runner.inject(ProcessHang.from_worker(worker))
        assert proc_state(proc.pid) == "T"
    assert proc_state(proc.pid) == "S"
    assert [e["status"] for e in ledger.entries()] == ["reverted"]
    assert {e["host"] for e in AuditLog(tmp_path / "audit.jsonl").entries()} == {f"127.0.0.1:{sshd.port}"}


def test_a_fresh_runner_reverts_over_ssh_from_the_ledger_alone(sshd, tmp_path, victim):
    """The ledger stores how to reach the host, so recovery needs no cluster file."""
    proc = victim()
    ledger = Ledger.for_cluster("ssh-test", tmp_path)
    pool = ExecutorPool({"node-1": target(sshd)})
    abandoned = FaultRunner(ledger, pool, handle_signals=False, recover_on_enter=False)
    abandoned.inject(ProcessHang(pid=proc.pid, host="node-1"))  # never exited: as if the harness died here
    pool.close()
    (entry,) = ledger.entries()
    assert entry["status"] == "active" and entry["executor"]["kind"] == "ssh"
    assert executor_from_spec(entry["executor"]).spec() == entry["executor"]
    assert proc_state(proc.pid) == "T"
    fresh = FaultRunner(ledger, handle_signals=False, recover_on_enter=False)
    records = fresh.recover(include_live_owners=True)  # the "dead" owner is this test process
    assert [(r.action.value, r.status.value) for r in records] == [
        ("revert", "succeeded"), ("verify_reverted", "succeeded")]
    assert proc_state(proc.pid) == "S"
    assert {e["host"] for e in fresh.audit.entries()} == {f"127.0.0.1:{sshd.port}"}
