"""Acceptance: a harness SIGKILLed in the middle of a fault leaves a ledger that the next run reverts,
and so does `python -m harness revert`."""

from __future__ import annotations

import signal

import pytest

from harness.faults import FaultRunner, Ledger

from .conftest import harness_revert, harness_with_hang, proc_state

pytestmark = pytest.mark.slow


def crash_mid_fault(state, victim_pid: int) -> None:
    """Run a harness that hangs the victim, then SIGKILL it: no handler, no finally can run."""
    with harness_with_hang(state, victim_pid) as harness:
        harness.send_signal(signal.SIGKILL)
        assert harness.wait(timeout=30) == -signal.SIGKILL
    assert proc_state(victim_pid) == "T", "the crashed harness should have left the victim stopped"


def test_next_run_reverts_what_a_sigkilled_harness_left(tmp_path, victim):
    proc = victim()
    crash_mid_fault(tmp_path, proc.pid)
    ledger = Ledger.for_cluster("local", tmp_path)
    (entry,) = ledger.outstanding()
    assert entry["status"] == "active" and entry["fault"]["pid"] == proc.pid
    with FaultRunner(ledger) as runner:  # recovery runs on entry, before any new fault
        assert proc_state(proc.pid) == "S"
        assert [r.action.value for r in runner.records] == ["revert", "verify_reverted"]
    assert ledger.outstanding() == [] and ledger.entries()[0]["status"] == "reverted"


def test_revert_command_reverts_what_a_sigkilled_harness_left(tmp_path, victim):
    proc = victim()
    crash_mid_fault(tmp_path, proc.pid)
    dry = harness_revert("--state-dir", str(tmp_path), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"localhost$ kill -s CONT {proc.pid}" in dry.stdout
    assert proc_state(proc.pid) == "T", "a dry run must change nothing"
    real = harness_revert("--state-dir", str(tmp_path))
    assert real.returncode == 0, real.stderr
    assert "reverting 1 fault(s)" in real.stdout and "verify_reverted succeeded" in real.stdout
    assert proc_state(proc.pid) == "S"
    again = harness_revert("--state-dir", str(tmp_path))
    assert again.returncode == 0 and "nothing to revert" in again.stdout
