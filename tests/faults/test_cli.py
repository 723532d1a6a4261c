"""`python -m harness revert`: exit codes and what it refuses to touch."""

from __future__ import annotations

from harness.faults import Ledger

from .conftest import harness_revert


def test_nothing_to_revert_exits_zero(tmp_path):
    out = harness_revert("--state-dir", str(tmp_path))
    assert out.returncode == 0 and "nothing to revert" in out.stdout


def test_a_revert_that_fails_exits_4_and_stays_in_the_ledger(tmp_path):
    ledger = Ledger.for_cluster("prod-a", tmp_path)
    ledger.add({"kind": "nic_melt", "fault_id": "x"}, {"kind": "local"})
    # written by this (live) test process: left alone unless forced
    polite = harness_revert("--state-dir", str(tmp_path))
    assert polite.returncode == 0 and "still running" in polite.stdout
    forced = harness_revert("--state-dir", str(tmp_path), "--cluster", "prod-a", "--force")
    assert forced.returncode == 4
    assert "unknown fault kind 'nic_melt'" in forced.stderr and "may be dirty" in forced.stderr
    assert ledger.entries()[0]["status"] == "revert_failed"


def test_bad_cluster_name_is_a_harness_error(tmp_path):
    out = harness_revert("--state-dir", str(tmp_path), "--cluster", "../x")
    assert out.returncode == 3 and "cannot name a ledger file" in out.stderr
