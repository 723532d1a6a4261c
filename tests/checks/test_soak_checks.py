"""soak.faults and soak.slo verdicts from synthetic outcomes and records (pure checks)."""

from __future__ import annotations

from harness.checklists import Checklist
from harness.checks.reschedule import RescheduleSample
from harness.checks.soak import faults_verdict, judge_fault, slo_windows_verdict, window_edges
from harness.probes.record_digest import RecordDigest
from harness.checks.verdict import Status
from harness.probes.rejoin import Rejoin
from harness.scenarios.fault_marks import FaultMark
from harness.scenarios.soak import SoakOutcome
from harness.scenarios.soak_schedule import ScheduledFault
from tests.checks.test_slo import rec

CHECKLIST = Checklist.load()


def outcome(i, kind="hbm_fill", target="decode-0", back_s=1.0, healthy=True, **kw):
    sf = ScheduledFault(i, 30.0 + i, kind, target, "decode", 5.0, 50.0 + i)
    o = SoakOutcome(sf, started_offset_s=30.0 + i, fault_id=f"f{i}", inject_wall=1000.0 + 60 * i, inject_s=0.01,
                    reverted_wall=1005.0 + 60 * i, **kw)
    if healthy:
        o.rejoin = Rejoin(target, 60.0, 1006.0 + 60 * i, watched=["kv_transfer events of the router"])
        if back_s is not None:
            o.rejoin.serving_wall = o.rejoin.healthy_wall + back_s
    return o


def sample(o, total_s):
    s = RescheduleSample(FaultMark(o.fault_id, o.fault.kind, o.fault.target, "decode", o.inject_wall, 0.01))
    s.detected_s, s.total_s = min(total_s, 1.0), total_s
    return s


def test_every_fault_recovered_by_its_rule_passes():
    outs = [outcome(i, kind=k) for i, k in enumerate(["hbm_fill", "process_kill", "ecc_poison", "process_hang",
                                                      "nic_flap", "pfc_storm"])]
    samples = [sample(o, 0.4) for o in outs if o.fault.kind.startswith("process")]
    v, judged = faults_verdict(CHECKLIST, outs, samples)
    assert v.status == Status.PASS, v.reason
    assert "6 of 6 scheduled faults injected (6 kinds" in v.reason
    assert v.evidence["by_kind"]["process_kill"] == {"scheduled": 1, "recovered": 1, "not recovered": 0,
                                                     "undecided": 0, "not injected": 0}
    assert [j.reschedule_s for j in judged if j.outcome.fault.kind == "process_kill"] == [0.4]


def test_a_slow_reschedule_or_a_worker_never_back_fails_naming_it():
    outs = [outcome(i) for i in range(5)] + [outcome(5, kind="process_kill", target="decode-1")]
    v, _ = faults_verdict(CHECKLIST, outs, [sample(outs[-1], 4.2)])
    assert v.status == Status.FAIL and "#6 process_kill decode-1: rescheduled in 4.20 s > 3 s" in v.reason, v.reason
    outs = [outcome(i) for i in range(5)] + [outcome(5, back_s=None)]
    v, _ = faults_verdict(CHECKLIST, outs, [])
    assert v.status == Status.FAIL and "decode-0 never carried traffic again" in v.reason, v.reason
    outs = [outcome(i) for i in range(5)] + [outcome(5, back_s=75.0)]
    v, _ = faults_verdict(CHECKLIST, outs, [])
    assert v.status == Status.FAIL and "75.0 s after it was healthy (> 60 s)" in v.reason, v.reason


def test_too_few_faults_or_a_stopped_schedule_is_inconclusive_never_a_pass():
    outs = [outcome(i) for i in range(3)] + [outcome(3, not_injected="decode-0 was not healthy and free within 120 s")]
    v, _ = faults_verdict(CHECKLIST, outs, [])
    assert v.status == Status.INCONCLUSIVE and "3 faults injected, 5 needed" in v.reason and "not healthy" in v.reason
    v, _ = faults_verdict(CHECKLIST, [outcome(i) for i in range(6)], [], stopped="stopped: a revert failed")
    assert v.status == Status.INCONCLUSIVE and "a revert failed" in v.reason


def test_judge_fault_straddling_reschedule_is_undecided():
    o = outcome(0, kind="process_hang")
    # the fault took effect somewhere in a 0.2 s inject step: 3.1 s measured is 2.9-3.1 s, across 3 s
    s = RescheduleSample(FaultMark("f0", "process_hang", "decode-0", "decode", o.inject_wall, 0.2))
    s.detected_s, s.total_s = 0.5, 3.1
    j = judge_fault(o, s, 3.0, 60.0)
    assert j.status == "undecided" and "straddles 3 s" in j.why, j.why


def test_windows_split_requests_by_send_time_and_a_slow_window_fails_soak_slo():
    # 400 requests a window: a p99 needs 368 for an upper bound
    fast = [rec(i, ttft_ms=50, tpot_ms=10) for i in range(0, 800)]
    slow = [rec(i, ttft_ms=900, tpot_ms=10) for i in range(800, 1200)]
    records = fast + slow
    t0 = min(r.start_wall_ns() for r in records) / 1e9
    t1 = max(r.start_wall_ns() for r in records) / 1e9 + 1
    digest = RecordDigest().add(records)
    assert [digest.client_samples(a, b)[0] for a, b in window_edges(t0, t1, 400)] == [400, 400, 400]
    v = slo_windows_verdict(CHECKLIST, records, t0, t1, 400)
    assert v.status == Status.FAIL and "window 3 (+800-1200 s)" in v.reason and "TTFT" in v.reason, v.reason
    assert [w["status"] for w in v.evidence["windows"]][:2] == ["pass", "pass"]
    v = slo_windows_verdict(CHECKLIST, fast, t0, t0 + 800, 400)
    assert v.status == Status.PASS and "each of 2 windows" in v.reason, v.reason


def test_on_a_starved_machine_a_slow_recovery_is_inconclusive_but_a_worker_never_back_still_fails():
    from harness.checks.machine import gate
    from tests.checks.test_machine_gate import STARVED

    outs = [outcome(i) for i in range(5)] + [outcome(5, kind="process_kill", target="decode-1")]
    slow, _ = faults_verdict(CHECKLIST, outs, [sample(outs[-1], 4.2)])
    assert slow.status == Status.FAIL
    gated = gate(slow, [STARVED])
    assert gated.status == Status.INCONCLUSIVE and "would have failed" in gated.reason, gated.reason
    never, _ = faults_verdict(CHECKLIST, [outcome(i) for i in range(5)] + [outcome(5, back_s=None)], [])
    assert {m["key"]: m["holds"] for m in never.evidence["measurements"]}["faults_not_recovered"] is False
    assert gate(never, [STARVED]).status == Status.FAIL
