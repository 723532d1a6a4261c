"""A soak's kills and hangs judged from the client's view while the records stream past once: the slim
records kept give the very samples the whole record list gives, and a record outside every fault's
window is not kept at all. Records built as tests/checks/test_reschedule_blackbox.py builds them."""

from __future__ import annotations

import pytest

from harness.checklists import Checklist
from harness.checks.reschedule_blackbox import measure_client_view
from harness.checks.soak import faults_verdict
from harness.checks.soak_client_view import ClientViewKeeper, client_fault
from harness.checks.verdict import Status
from harness.probes.workers.rejoin import Rejoin
from harness.evidence.fault_marks import FaultMark
from harness.evidence.soak import ScheduledFault, SoakOutcome
from tests.checks.test_reschedule_blackbox import T0, stream

CHECKLIST = Checklist.load()


def marks() -> list[FaultMark]:
    return [FaultMark("f-hang", "process_hang", "dynamo-1", "aggregated", T0 + 100, 0.01),
            FaultMark("f-kill", "process_kill", "dynamo-0", "aggregated", T0, 0.01)]


def records() -> list:
    ticks = [T0 - 5 + 0.1 * i for i in range(60)]   # a long stream across the kill, 0.1 s a token
    return [
        stream("long", T0 - 5, ticks, end=ticks[-1], served_by=()),
        stream("new", T0 + 0.3, [T0 + 0.5, T0 + 0.6], end=T0 + 0.6, served_by=()),
        stream("far", T0 + 50, [T0 + 50.2], end=T0 + 50.3, served_by=()),            # in no window
        # stalled 5 s by the hang, then completed
        stream("stalled", T0 + 99, [T0 + 99.5, T0 + 105.2], end=T0 + 105.3, served_by=()),
        stream("after", T0 + 101, [T0 + 101.4], end=T0 + 101.5, served_by=()),
    ]


def test_the_slim_records_give_the_samples_the_whole_run_gives():
    keeper = ClientViewKeeper(marks())
    passed = list(keeper.observe(records()))
    assert [r.request_id for r in passed] == [r.request_id for r in records()]   # every record passes on
    assert passed[0].chunk_ns == records()[0].chunk_ns                            # unchanged
    assert "far" not in {r.request_id for r in keeper.kept}
    long = next(r for r in keeper.kept if r.request_id == "long")
    assert long.token_ids == [] and long.text == "" and len(long.chunk_ns) == 11 and keeper.chunks_dropped > 0
    got = keeper.samples()
    ordered = sorted(marks(), key=lambda m: m.wall)
    whole = measure_client_view([client_fault(m) for m in ordered], records())
    for m, expected in zip(ordered, whole):
        s = got[m.fault_id]
        assert (s.total_s, s.affected, s.longest_stall_s, s.first_new_success_s) == \
            (expected.total_s, expected.affected, expected.longest_stall_s, expected.first_new_success_s)
    assert got["f-kill"].total_s == pytest.approx(0.9)     # until "long" (the engine names no worker) ended
    assert got["f-hang"].total_s == pytest.approx(5.3)     # until the stalled stream ended


def test_a_hang_clients_stall_through_fails_soak_faults_from_the_client_view():
    keeper = ClientViewKeeper(marks())
    list(keeper.observe(records()))
    outcomes = []
    for i, m in enumerate(sorted(marks(), key=lambda m: m.wall)):
        sf = ScheduledFault(i, 30.0 + i, m.kind, m.worker, m.role, 4.0, 60.0 + i)
        o = SoakOutcome(sf, started_offset_s=30.0 + i, fault_id=m.fault_id, inject_wall=m.wall, inject_s=0.01,
                        reverted_wall=m.wall + 4)
        o.rejoin = Rejoin(m.worker, 60.0, m.wall + 5, watched=["dynamo_component_requests on http://w/metrics"])
        o.rejoin.serving_wall = m.wall + 6
        outcomes.append(o)
    v, judged = faults_verdict(CHECKLIST, outcomes, [], by_fault_id=keeper.samples(), judged_by="client view")
    assert v.status == Status.FAIL and "process_hang dynamo-1: rescheduled in 5.30 s > 3 s" in v.reason, v.reason
    assert [j.status for j in judged] == ["recovered", "not recovered"]
    assert v.evidence["kill_and_hang_judged_by"] == "client view"


def test_a_way_back_that_cannot_be_observed_is_undecided_never_passed():
    sf = ScheduledFault(0, 30.0, "process_kill", "w0", "aggregated", 4.0, 60.0)
    o = SoakOutcome(sf, started_offset_s=30.0, fault_id="f", inject_wall=T0, inject_s=0.01, reverted_wall=T0 + 4)
    o.rejoin = Rejoin("w0", 60.0, T0 + 5, watched=[])   # no metrics of it, no router view
    keeper = ClientViewKeeper([FaultMark("f", "process_kill", "w0", "aggregated", T0, 0.01)])
    list(keeper.observe(records()))
    v, judged = faults_verdict(CHECKLIST, [o] * 5, [], by_fault_id=keeper.samples())
    assert all(j.status == "undecided" and "cannot be observed" in j.why for j in judged)
    assert v.status == Status.INCONCLUSIVE, v.reason
