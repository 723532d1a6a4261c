"""DCGM error injection (harness/faults/dcgm.py) through the real fault runner and local executor,
against a stand-in ``dcgmi`` the test writes (no DCGM on these machines): what it runs, how it is
verified and reverted, and the clear errors when DCGM is missing or refuses."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from harness.errors import FaultError
from harness.faults import DcgmInject, FaultRunner, Ledger
from harness.hosts import LocalExecutor

STAND_IN = """#!/bin/sh
# dcgmi stand-in: `discovery -l` lists one GPU; `test --inject --gpuid G -f F -v V` records "G F V"
case "$1" in
  discovery) echo "1 GPU found."; exit 0 ;;
  test) echo "$4 $6 $8" >> "{record}"; [ -e "{refuse}" ] && {{ echo "Error: field not injectable"; exit 1; }}
        echo "Successfully injected field info."; exit 0 ;;
esac
exit 2
"""


def stand_in(tmp_path: Path) -> tuple[Path, Path, Path]:
    record, refuse, path = tmp_path / "injections", tmp_path / "refuse", tmp_path / "dcgmi"
    path.write_text(STAND_IN.format(record=record, refuse=refuse))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path, record, refuse


def test_the_error_is_reinjected_until_reverted_then_the_healthy_value_goes_back(tmp_path):
    dcgmi, record, _ = stand_in(tmp_path)
    fault = DcgmInject(gpu=1, field_name="ecc_dbe_volatile", value=1, hold_s=30, interval_s=0.2, dcgmi=str(dcgmi),
                       worker="decode-1")
    with FaultRunner(Ledger(tmp_path / "ledger.json")) as runner:
        runner.inject(fault)
        time.sleep(1.0)  # several re-injections: a DCGM cache sample ages out
        runner.revert(fault)
    lines = record.read_text().splitlines()
    assert len([x for x in lines if x == "1 311 1"]) >= 3, lines
    assert lines[-1] == "1 311 0"  # the healthy value, last
    assert not list(Path("/tmp/pdh-faults").glob(f"{fault.fault_id}.*"))  # pid, stop and log files gone
    assert [r.action.value for r in runner.records] == ["inject", "verify", "revert", "verify_reverted"]
    assert all(r.status.value == "succeeded" for r in runner.records)
    assert "not the memory" in " ".join(fault.plan())


def test_a_harness_that_dies_leaves_the_loop_to_end_by_itself_with_the_healthy_value(tmp_path):
    dcgmi, record, _ = stand_in(tmp_path)
    fault = DcgmInject(gpu=0, hold_s=1, interval_s=0.2, dcgmi=str(dcgmi))
    ex = LocalExecutor()
    fault.inject(ex)  # no revert follows, as after a SIGKILL of the harness
    deadline = time.monotonic() + 15
    while not record.exists() or record.read_text().splitlines()[-1] != "0 311 0":
        assert time.monotonic() < deadline, record.read_text() if record.exists() else "nothing injected"
        time.sleep(0.1)
    fault.revert(ex)  # the ledger's revert later still works
    assert record.read_text().splitlines()[-1] == "0 311 0"


def test_missing_dcgm_and_a_refused_injection_are_clear_errors(tmp_path):
    with pytest.raises(FaultError, match="discovery -l` failed") as err:
        DcgmInject(dcgmi=str(tmp_path / "no-such-dcgmi")).prepare(LocalExecutor())
    assert "nv-hostengine" in err.value.fix
    dcgmi, _, refuse = stand_in(tmp_path)
    refuse.touch()
    fault = DcgmInject(hold_s=5, interval_s=0.2, dcgmi=str(dcgmi))
    with FaultRunner(Ledger(tmp_path / "ledger.json")) as runner, pytest.raises(FaultError, match="refused"):
        runner.inject(fault)
    assert runner.records[-1].action.value in ("revert", "verify_reverted")  # the runner reverted it anyway
    with pytest.raises(Exception, match="unknown field"):
        DcgmInject(field_name="ecc")
