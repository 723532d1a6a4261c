from __future__ import annotations

import io

import pytest

from harness.errors import ConfigError, ExecutorError
from harness.hosts import AuditLog, ExecutorPool, LocalExecutor, SSHTarget, executor_from_spec


def test_local_run_captures_output_rc_and_audits(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    ex = LocalExecutor(audit=audit)
    res = ex.run(["sh", "-c", 'printf "%s" "$0"; echo err >&2; exit 5', "a b"], timeout=10, check=False)
    assert (res.rc, res.stdout, res.stderr) == (5, "a b", "err\n")
    with pytest.raises(ExecutorError, match="rc=5.*err"):
        ex.run(["sh", "-c", "echo err >&2; exit 5"], timeout=10)
    entries = audit.entries()
    assert [e["rc"] for e in entries] == [5, 5]
    assert entries[0]["argv"] == ["sh", "-c", 'printf "%s" "$0"; echo err >&2; exit 5', "a b"]
    assert all(e["host"] == "localhost" and e["dry_run"] is False for e in entries)


def test_no_shell_is_involved(tmp_path):
    marker = tmp_path / "marker"
    res = LocalExecutor().run(["echo", f"$(touch {marker})"], timeout=10)
    assert res.stdout.strip() == f"$(touch {marker})" and not marker.exists()


def test_missing_command_and_timeout_are_clear_errors(tmp_path):
    audit = AuditLog(tmp_path / "audit.jsonl")
    ex = LocalExecutor(audit=audit)
    with pytest.raises(ExecutorError, match="command not found.*no-such-tool") as err:
        ex.run(["no-such-tool"], timeout=5)
    assert "PATH" in err.value.fix
    with pytest.raises(ExecutorError, match="timed out"):
        ex.run(["sleep", "30"], timeout=0.3)
    assert all(e["error"] for e in audit.entries())


@pytest.mark.parametrize("argv", ["kill -s STOP 1", [], ["kill", 9]])
def test_argv_must_be_a_list_of_strings(argv):
    with pytest.raises(ExecutorError, match="non-empty list of strings"):
        LocalExecutor().run(argv, timeout=5)


def test_dry_run_prints_and_audits_but_runs_nothing(tmp_path):
    out, marker = io.StringIO(), tmp_path / "marker"
    audit = AuditLog(tmp_path / "audit.jsonl")
    res = LocalExecutor(audit=audit, dry_run=True, out=out).run(["touch", str(marker)], timeout=5)
    assert res.rc == 0 and not marker.exists()
    assert out.getvalue() == f"[dry-run] localhost$ touch {marker}\n"
    (entry,) = audit.entries()
    assert entry["dry_run"] is True and entry["argv"] == ["touch", str(marker)] and entry["rc"] is None


def test_pool_reuses_one_executor_per_host_and_rejects_unknown_hosts(tmp_path):
    pool = ExecutorPool()
    assert pool("localhost") is pool(None) is pool("localhost")
    assert isinstance(pool("127.0.0.1"), LocalExecutor)
    with pytest.raises(ConfigError, match="no SSH settings for host 'gpu-node-7'") as err:
        pool("gpu-node-7")
    assert "without `ssh:` when it is this one" in str(err.value)   # the fix for a host on this machine too
    pool.close()


def test_a_host_named_anything_without_ssh_is_this_machine():
    """Issue 37: a cluster file's host `box` (address 127.0.0.1, no `ssh:`) is this machine, as the
    docs say; the pool runs its commands locally once it is told the name. Planted defect: the
    pool deciding by the name alone (only localhost, 127.0.0.1, ::1): `box` is refused."""
    pool = ExecutorPool(local={"box"})
    assert isinstance(pool("box"), LocalExecutor) and pool("box").run(["true"], timeout=5).rc == 0
    pool.close()


def test_specs_rebuild_executors_and_bad_specs_are_refused(tmp_path):
    assert executor_from_spec(LocalExecutor().spec()).spec() == {"kind": "local"}
    with pytest.raises(ConfigError, match="unknown executor kind 'telnet'"):
        executor_from_spec({"kind": "telnet"})
    with pytest.raises(ConfigError, match="key_filename"):
        SSHTarget(host="h", user="u", key_filename=str(tmp_path / "nope"), known_hosts_file=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="port"):
        SSHTarget(host="h", user="u", key_filename="k", known_hosts_file="k", port=70000)
