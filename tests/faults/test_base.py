from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from harness.errors import FaultError
from harness.faults import Action, Fault, FaultRecord, ProcessHang, ProcessKill, RecordStatus


def test_ledger_round_trip_rebuilds_each_kind_without_callables():
    hang = ProcessHang(pid=4242, host="node-1", worker_id="decode-0", role="decode", start_time=99)
    kill = ProcessKill(pid=4243, worker_id="prefill-1", signal="SIGTERM", restart=print,
                       restart_cmd=["systemctl", "restart", "worker@prefill-1"])
    for fault in (hang, kill):
        data = fault.to_ledger()
        assert data["kind"] == fault.kind and "restart" not in data and "healthy" not in data
        again = Fault.from_ledger(data)
        assert type(again) is type(fault) and again.to_ledger() == data
    assert Fault.from_ledger(kill.to_ledger()).restart is None
    assert kill.signal == "TERM"


def test_unknown_kind_and_unknown_fields_are_refused_with_a_fix():
    with pytest.raises(FaultError, match="unknown fault kind 'nic_melt'") as err:
        Fault.from_ledger({"kind": "nic_melt", "pid": 1})
    assert err.value.fix
    with pytest.raises(FaultError, match="unknown fields"):
        Fault.from_ledger({"kind": "process_hang", "pid": 4242, "colour": "red"})


def test_a_kind_cannot_be_registered_twice():
    with pytest.raises(TypeError, match="already registered"):
        @dataclass
        class Impostor(ProcessHang):  # noqa: F841 - the class statement itself must fail
            kind: ClassVar[str] = "process_kill"


def test_record_has_fixed_vocabulary_and_durations():
    fault = ProcessHang(pid=4242)
    rec = FaultRecord.start(fault, Action.VERIFY).finish(RecordStatus.FAILED, error="still running")
    d = rec.to_dict()
    assert d["action"] == "verify" and d["status"] == "failed" and d["error"] == "still running"
    assert d["duration_s"] >= 0 and d["ended_wall"] >= d["started_wall"]
    assert {s.value for s in RecordStatus} == {"succeeded", "failed", "dry_run"}
    assert {a.value for a in Action} == {"inject", "verify", "revert", "verify_reverted"}
