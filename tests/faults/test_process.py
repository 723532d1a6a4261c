"""Process faults against real processes the test owns (and always reaps)."""

from __future__ import annotations

import io
import shlex
import subprocess
import sys

import pytest

from harness.errors import ConfigError, FaultError
from harness.faults import FaultRunner, Ledger, ProcessHang, ProcessKill, select_targets
from harness.hosts import AuditLog, LocalExecutor

from .conftest import proc_state

WORKERS = [{"id": f"prefill-{i}", "role": "prefill", "pid": 1000 + i} for i in range(4)] + \
          [{"id": f"decode-{i}", "role": "decode", "pid": 2000 + i, "host": "node-1"} for i in range(6)] + \
          [{"id": "decode-dead", "role": "decode", "pid": None}]


def test_select_one_n_and_percent_deterministically():
    one = select_targets(WORKERS, "decode", "one", seed=7)
    assert len(one) == 1 and one[0]["role"] == "decode"
    assert select_targets(WORKERS, "decode", "one", seed=7) == one
    three = select_targets(WORKERS, "decode", "n", 3, seed=1)
    assert len({w["id"] for w in three}) == 3 and all(w["role"] == "decode" for w in three)
    assert len(select_targets(WORKERS, "prefill", "percent", 50)) == 2
    assert len(select_targets(WORKERS, "decode", "percent", 10)) == 1   # at least one
    assert len(select_targets(WORKERS, "any", "percent", 100)) == 10    # never the dead one
    seeds = {tuple(w["id"] for w in select_targets(WORKERS, "decode", "n", 2, seed=s)) for s in range(20)}
    assert len(seeds) > 1


@pytest.mark.parametrize("role,mode,value,match", [
    ("decode", "half", None, "unknown target selection mode"),
    ("decode", "n", 7, r"1\.\.6"),
    ("decode", "n", 1.5, "whole number"),
    ("decode", "percent", 0, r"\(0, 100\]"),
    ("decode", "one", 2, "mode 'one' takes no value"),
])
def test_bad_selections_are_config_errors(role, mode, value, match):
    with pytest.raises(ConfigError, match=match):
        select_targets(WORKERS, role, mode, value)


def test_unknown_role_names_the_roles_present():
    with pytest.raises(FaultError, match=r"role 'router'.*\['decode', 'prefill'\]"):
        select_targets(WORKERS, "router")


def test_bad_fault_parameters_are_refused():
    with pytest.raises(ConfigError, match="pid must be an integer > 1"):
        ProcessHang(pid=1)
    with pytest.raises(ConfigError, match="use process_hang for STOP"):
        ProcessKill(pid=4242, signal="STOP")
    with pytest.raises(ConfigError, match="unknown placeholder"):
        ProcessKill.from_worker(WORKERS[0], restart_cmd=["restart", "{gpu}"])


def runner_for(tmp_path, **kwargs) -> FaultRunner:
    return FaultRunner(Ledger.for_cluster("local", tmp_path), handle_signals=False, **kwargs)


def test_hang_stops_the_process_and_revert_resumes_it(tmp_path, victim):
    proc = victim()
    with runner_for(tmp_path) as runner:
        fault = runner.inject(ProcessHang.from_worker({"id": "decode-0", "role": "decode", "pid": proc.pid}))
        assert proc_state(proc.pid) == "T"
        assert fault.target == f"decode-0 pid {proc.pid} @ localhost"
    assert proc_state(proc.pid) == "S"
    assert [(r.action.value, r.status.value) for r in runner.records] == [
        ("inject", "succeeded"), ("verify", "succeeded"), ("revert", "succeeded"), ("verify_reverted", "succeeded")]


def test_plan_is_exactly_what_runs(tmp_path, victim):
    """Every command the dry-run plan names is a command the real run executes, and vice versa."""
    proc = victim()
    fault = ProcessHang(pid=proc.pid)
    planned = {line.split("$ ", 1)[1].split("  #")[0] for line in fault.plan()}
    with runner_for(tmp_path) as runner:
        runner.inject(fault)
    ran = {shlex.join(e["argv"]) for e in runner.audit.entries() if not e["dry_run"]}
    assert planned == ran == {f"cat /proc/{proc.pid}/stat", f"kill -s STOP {proc.pid}", f"kill -s CONT {proc.pid}"}


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path, victim):
    proc, out = victim(), io.StringIO()
    fault = ProcessKill(pid=proc.pid)
    with runner_for(tmp_path, dry_run=True, out=out) as runner:
        runner.inject(fault)
    assert proc_state(proc.pid) == "S"
    printed = out.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in printed] == fault.plan()
    assert Ledger.for_cluster("local", tmp_path).entries() == []
    assert {r.status.value for r in runner.records} == {"dry_run"}
    assert all(e["dry_run"] for e in AuditLog(tmp_path / "audit.jsonl").entries())


@pytest.mark.parametrize("sig,rc", [("KILL", -9), ("TERM", -15)])
def test_kill_without_hooks_is_verified_and_its_revert_is_a_recorded_noop(tmp_path, victim, sig, rc):
    proc = victim()
    with runner_for(tmp_path) as runner:
        runner.inject(ProcessKill(pid=proc.pid, signal=sig))
        assert proc.wait(timeout=10) == rc
    revert = [r for r in runner.records if r.action.value == "revert"][0]
    assert revert.status.value == "succeeded" and "nothing to restore" in revert.output


def test_kill_revert_restarts_through_the_hooks(tmp_path, victim):
    proc, restarted = victim(), []

    def restart(worker_id: str) -> None:
        restarted.append((worker_id, victim()))

    def healthy(worker_id: str) -> bool:
        return bool(restarted) and proc_state(restarted[-1][1].pid) in ("S", "R")

    worker = {"id": "decode-3", "role": "decode", "pid": proc.pid}
    fault = ProcessKill.from_worker(worker, restart=restart, healthy=healthy)
    with runner_for(tmp_path) as runner:
        runner.inject(fault)
        proc.wait(timeout=10)
    assert [w for w, _ in restarted] == ["decode-3"]
    assert runner.records[-1].output == "decode-3 is healthy again"
    runner.revert(fault)  # idempotent: no second restart
    assert len(restarted) == 1


def test_kill_revert_reports_the_rejoin_hook_after_healthy_and_a_worker_kept_out_is_no_failed_revert(tmp_path,
                                                                                                     victim):
    """The rejoin hook runs once the worker is healthy; what it says (a cluster that keeps the worker
    out) goes into the revert's record, and the ledger entry is reverted, not failed."""
    proc, restarted, calls = victim(), [], []

    def restart(worker_id: str) -> None:
        restarted.append(victim())

    def healthy(worker_id: str) -> bool:
        return bool(restarted) and proc_state(restarted[-1].pid) in ("S", "R")

    def rejoined(worker_id: str) -> str:
        calls.append((worker_id, healthy(worker_id)))
        return f"vllm-router kept {worker_id} out for 60+ s after it was healthy"

    fault = ProcessKill.from_worker({"id": "vllm-1", "role": "aggregated", "pid": proc.pid}, restart=restart,
                                    healthy=healthy, rejoined=rejoined)
    assert any("rejoin hook" in line and "never a failed revert" in line for line in fault.plan())
    with runner_for(tmp_path) as runner:
        runner.inject(fault)
        proc.wait(timeout=10)
    assert calls == [("vllm-1", True)]
    assert runner.records[-1].output == ("vllm-1 is healthy again; vllm-router kept vllm-1 out for 60+ s after "
                                         "it was healthy")
    assert runner.records[-1].status.value == "succeeded"
    assert [e["status"] for e in runner.ledger.entries()] == ["reverted"]
    assert "rejoined" not in fault.to_ledger()


def test_after_a_crash_a_callable_restart_hook_is_named_not_pretended(tmp_path, victim):
    proc = victim()
    ledger = Ledger.for_cluster("local", tmp_path)
    abandoned = FaultRunner(ledger, handle_signals=False, recover_on_enter=False)
    abandoned.inject(ProcessKill(pid=proc.pid, worker_id="decode-1", restart=lambda worker_id: None))
    proc.wait(timeout=10)
    records = FaultRunner(ledger, handle_signals=False).recover(include_live_owners=True)
    assert "cannot restart" in records[0].output and "<lambda>" in records[0].output


def test_kill_revert_runs_the_cluster_restart_command_on_the_host(tmp_path, victim):
    proc, flag = victim(), tmp_path / "restarted"
    fault = ProcessKill.from_worker({"id": "prefill-2", "role": "prefill", "pid": proc.pid},
                                    restart_cmd=["sh", "-c", f"echo {{id}} {{role}} > {flag}"],
                                    healthy_cmd=["test", "-s", str(flag)])
    assert fault.restart_cmd == ["sh", "-c", f"echo prefill-2 prefill > {flag}"]
    with runner_for(tmp_path) as runner:
        runner.inject(fault)
        proc.wait(timeout=10)
    assert flag.read_text() == "prefill-2 prefill\n"
    assert runner.records[-1].status.value == "succeeded"


def test_kill_that_does_not_take_effect_fails_loudly(tmp_path):
    code = "import signal,sys,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        with runner_for(tmp_path) as runner:
            with pytest.raises(FaultError, match="still runs.*use signal KILL"):
                runner.inject(ProcessKill(pid=proc.pid, signal="TERM", timeout_s=0.5))
            assert runner.active_faults == []
        assert proc.poll() is None
        assert Ledger.for_cluster("local", tmp_path).entries()[0]["status"] == "reverted"
    finally:
        proc.kill()
        proc.wait()


def test_a_reused_pid_is_never_signalled(tmp_path, victim):
    proc = victim()
    start = LocalExecutor().run(["cat", f"/proc/{proc.pid}/stat"], timeout=5).stdout.rsplit(")", 1)[1].split()[19]
    stale = ProcessHang(pid=proc.pid, start_time=int(start) - 1)  # "the process that had this pid before"
    with pytest.raises(FaultError, match="different process"):
        stale.prepare(LocalExecutor())
    audit = AuditLog(tmp_path / "audit.jsonl")
    assert "nothing to resume" in stale.revert(LocalExecutor(audit=audit))
    assert [e["argv"][0] for e in audit.entries()] == ["cat"], "revert signalled a process that was not its target"
