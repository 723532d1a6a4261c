"""FaultRunner: LIFO reverts on every exit path, immediate revert of a fault that did not take
effect, failed reverts that do not stop the others, signals, and recovery from the ledger."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from harness.errors import FaultError, RevertError
from harness.faults import Fault, FaultRunner, Ledger, LedgerStatus, ProcessHang, Terminated, new_fault_id
from harness.hosts import ExecutorPool, describe_command

from .conftest import harness_with_hang, proc_state


@dataclass
class FileFault(Fault):
    """A real, observable effect for runner tests: a file that exists while the fault is active.
    Each revert appends the fault's name to order_log; a revert refuses while ``blocker`` exists."""

    kind: ClassVar[str] = "test_file"
    path: str = ""
    order_log: str = ""
    name: str = ""
    blocker: str = ""
    inject_noop: bool = False
    signal_self: int = 0
    host: str = "localhost"
    fault_id: str = field(default_factory=new_fault_id)

    @property
    def target(self) -> str:
        return f"file {self.path}"

    def _inject_argv(self) -> list[str]:
        return ["true"] if self.inject_noop else ["touch", self.path]

    def _revert_argv(self) -> list[str]:
        script = 'test ! -e "$3" || { echo "blocked by $3" >&2; exit 1; }; echo "$1" >> "$2"; rm -f "$0"'
        return ["sh", "-c", script, self.path, self.name, self.order_log, self.blocker]

    def inject(self, ex) -> str:
        if self.signal_self:
            os.kill(os.getpid(), self.signal_self)
        ex.run(self._inject_argv(), timeout=10)
        return "created"

    def verify(self, ex) -> str:
        if ex.run(["test", "-e", self.path], timeout=10, check=False).rc != 0:
            raise FaultError(f"{self.path} was not created")
        return "exists"

    def revert(self, ex) -> str:
        ex.run(self._revert_argv(), timeout=10)
        return "removed"

    def verify_reverted(self, ex) -> str:
        if ex.run(["test", "-e", self.path], timeout=10, check=False).rc == 0:
            raise FaultError(f"{self.path} still exists")
        return "gone"

    def plan(self) -> list[str]:
        return [f"inject: {describe_command(self.host, self._inject_argv())}",
                f"revert: {describe_command(self.host, self._revert_argv())}"]


@pytest.fixture
def files(tmp_path):
    def make(name: str, **kwargs) -> FileFault:
        return FileFault(path=str(tmp_path / name), order_log=str(tmp_path / "order"), name=name, **kwargs)
    return make


def order(tmp_path: Path) -> list[str]:
    return (tmp_path / "order").read_text().split()


def runner_for(tmp_path, **kwargs) -> FaultRunner:
    return FaultRunner(Ledger.for_cluster("local", tmp_path / "state"), handle_signals=False, **kwargs)


def test_reverts_run_last_in_first_out_on_normal_exit(tmp_path, files):
    with runner_for(tmp_path) as runner:
        for name in "abc":
            runner.inject(files(name))
        assert all((tmp_path / n).exists() for n in "abc")
    assert order(tmp_path) == ["c", "b", "a"]
    assert not any((tmp_path / n).exists() for n in "abc")
    assert [e["status"] for e in runner.ledger.entries()] == ["reverted"] * 3
    assert len(runner.records) == 12


def test_commands_are_audited_even_through_a_pool_built_without_an_audit_log(tmp_path, files):
    pool = ExecutorPool()
    with runner_for(tmp_path, executor_factory=pool) as runner:
        runner.inject(files("a"))
    assert [e["argv"][0] for e in runner.audit.entries()] == ["touch", "test", "sh", "test"]
    assert runner.audit.path == tmp_path / "state" / "audit.jsonl"


def test_reverts_run_when_the_block_raises(tmp_path, files):
    with pytest.raises(ZeroDivisionError):
        with runner_for(tmp_path) as runner:
            runner.inject(files("a"))
            runner.inject(files("b"))
            1 / 0
    assert order(tmp_path) == ["b", "a"]


def test_active_reverts_at_the_end_of_its_own_block(tmp_path, files):
    with runner_for(tmp_path) as runner:
        outer = runner.inject(files("outer"))
        with runner.active(files("inner")):
            assert (tmp_path / "inner").exists()
        assert order(tmp_path) == ["inner"] and runner.active_faults == [outer]
    assert order(tmp_path) == ["inner", "outer"]


def test_the_same_fault_cannot_be_injected_twice(tmp_path, files):
    with runner_for(tmp_path) as runner:
        fault = runner.inject(files("a"))
        with pytest.raises(FaultError, match="already active"):
            runner.inject(fault)
    assert order(tmp_path) == ["a"]


def test_a_fault_that_does_not_take_effect_is_reverted_at_once(tmp_path, files):
    with runner_for(tmp_path) as runner:
        with pytest.raises(FaultError, match="was not created"):
            runner.inject(files("ghost", inject_noop=True))
        assert runner.active_faults == []
        assert order(tmp_path) == ["ghost"]
        assert runner.ledger.entries()[0]["status"] == "reverted"
        assert [(r.action.value, r.status.value) for r in runner.records][:2] == [
            ("inject", "succeeded"), ("verify", "failed")]


def test_a_failed_revert_does_not_stop_the_others_and_is_retried_by_recovery(tmp_path, files):
    blocker = tmp_path / "blocker"
    blocker.touch()
    runner = runner_for(tmp_path)
    with pytest.raises(RevertError, match="1 revert.*blocked by") as err:
        with runner:
            runner.inject(files("a"))
            runner.inject(files("b", blocker=str(blocker)))
            runner.inject(files("c"))
    assert "python -m harness revert" in err.value.fix
    assert order(tmp_path) == ["c", "a"] and (tmp_path / "b").exists()
    assert [e["status"] for e in runner.ledger.entries()] == ["reverted", "revert_failed", "reverted"]
    blocker.unlink()
    records = runner_for(tmp_path).recover(include_live_owners=True)
    assert order(tmp_path) == ["c", "a", "b"] and not (tmp_path / "b").exists()
    assert [r.action.value for r in records] == ["revert", "verify_reverted"]
    assert runner.ledger.outstanding(include_live_owners=True) == []


def test_a_revert_that_fails_once_is_tried_again_and_the_cluster_ends_clean(tmp_path, files):
    """A revert command that fails (a host busy with a fan-out timed it out) is retried after a
    pause: the first attempt is recorded failed, the second reverts, the ledger says reverted."""
    blocker = tmp_path / "blocker"
    blocker.touch()
    runner = runner_for(tmp_path)

    def unblock_after_a_failed_revert(record):
        if record.action.value == "revert" and record.status.value == "failed":
            blocker.unlink(missing_ok=True)   # what a host does once it has caught up

    runner.listeners.append(unblock_after_a_failed_revert)
    with runner:
        runner.inject(files("a", blocker=str(blocker)))
    assert order(tmp_path) == ["a"] and not (tmp_path / "a").exists()
    reverts = [(r.action.value, r.status.value) for r in runner.records if r.action.value != "inject"
               and r.action.value != "verify"]
    assert reverts == [("revert", "failed"), ("revert", "succeeded"), ("verify_reverted", "succeeded")], reverts
    assert [e["status"] for e in runner.ledger.entries()] == ["reverted"]


def test_dry_run_prints_plans_in_lifo_order_and_changes_nothing(tmp_path, files, capsys):
    with runner_for(tmp_path, dry_run=True) as runner:
        a, b = runner.inject(files("a")), runner.inject(files("b"))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[dry-run] test_file {f.target}: {f.plan()[i]}" for f, i in ((a, 0), (b, 0), (b, 1), (a, 1))]
    assert not (tmp_path / "a").exists() and not (tmp_path / "order").exists()
    assert runner.ledger.entries() == []


def test_a_signal_during_an_injection_waits_for_it_then_unwinds_and_reverts(tmp_path, files):
    before = signal.getsignal(signal.SIGTERM)
    runner = FaultRunner(Ledger.for_cluster("local", tmp_path / "state"))
    with pytest.raises(Terminated) as exc:
        with runner:
            runner.inject(files("a"))
            b = files("b", signal_self=signal.SIGTERM)
            runner.inject(b)
            pytest.fail("SIGTERM did not interrupt the run")
    assert exc.value.exit_code == 143
    # b was injected and verified before the signal was acted on, then both were reverted
    assert [(r.action.value, r.status.value) for r in runner.records if r.fault_id == b.fault_id] == [
        ("inject", "succeeded"), ("verify", "succeeded"), ("revert", "succeeded"), ("verify_reverted", "succeeded")]
    assert order(tmp_path) == ["b", "a"]
    assert signal.getsignal(signal.SIGTERM) == before


def test_pending_entries_of_a_dead_run_are_reverted_safely(tmp_path, victim):
    """A run killed between writing the entry and injecting: the revert must be harmless."""
    proc = victim()
    ledger = Ledger.for_cluster("local", tmp_path)
    fault = ProcessHang(pid=proc.pid)
    fault.prepare(runner_for(tmp_path).executor_factory("localhost"))
    entry_id = ledger.add(fault.to_ledger(), {"kind": "local"})
    FaultRunner(ledger, handle_signals=False).recover(include_live_owners=True)
    assert proc_state(proc.pid) == "S"
    assert ledger.entries()[0]["id"] == entry_id and ledger.entries()[0]["status"] == LedgerStatus.REVERTED.value


@pytest.mark.slow
@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_revert_before_the_harness_exits(tmp_path, victim, sig, rc):
    proc = victim()
    with harness_with_hang(tmp_path, proc.pid) as harness:
        harness.send_signal(sig)
        assert harness.wait(timeout=60) == rc, harness.stderr.read()
    assert proc_state(proc.pid) == "S"
    assert [e["status"] for e in Ledger.for_cluster("local", tmp_path).entries()] == ["reverted"]
