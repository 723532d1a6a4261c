"""Rescheduling time per fault from router events and request records (constructed here as
test input in the shapes the router's /admin/events and the load generator produce)."""

import pytest

from harness.checks.reschedule import FaultMark, measure, nearest_rank, reschedule_verdict
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.probes.client.records import RequestRecord

T0 = 1_000.0


def ok_record(sent, first_token, rid="c"):
    # anchor: perf 0 == wall 0, so perf ns are wall ns
    return RequestRecord(request_id=rid, sent_ns=int(sent * 1e9), first_token_ns=int(first_token * 1e9),
                         end_ns=int((first_token + 0.5) * 1e9), chunk_ns=[int(first_token * 1e9)], chunk_tokens=[1],
                         token_ids=[5], finish_reason="length")


def kill(worker, t, role="decode", kind="process_kill", fid=None):
    return FaultMark(fid or f"{worker}@{t}", kind, worker, role, t)


def down(worker, t, affected=()):
    return {"type": "worker_down", "worker": worker, "wall_time": t, "affected": [f"{a}#0" for a in affected]}


def replaced(rid, t):
    return {"type": "reschedule", "request_id": rid, "wall_time": t}


def test_time_is_the_latest_of_detection_replacement_and_new_success():
    events = [down("decode-1", T0 + 0.05, ["r1", "r2"]), replaced("r1", T0 + 0.2), replaced("r2", T0 + 0.9)]
    records = [ok_record(T0 - 1, T0 - 0.5), ok_record(T0 + 0.1, T0 + 0.4)]
    [s] = measure([kill("decode-1", T0)], events, records)
    assert s.detected_s == pytest.approx(0.05) and s.first_success_s == pytest.approx(0.4)
    assert s.affected == ["r1", "r2"] and s.total_s == pytest.approx(0.9)
    assert s.breakdown == "down +0.05 s, 2/2 re-placed by +0.90 s, new request +0.40 s"


def test_request_sent_before_the_fault_does_not_count_as_new_success():
    [s] = measure([kill("decode-1", T0)], [down("decode-1", T0 + 0.05)], [ok_record(T0 - 0.1, T0 + 0.3)])
    assert s.total_s is None and "no request sent after the fault succeeded" in s.problem


def test_unreplaced_or_failed_requests_mean_not_rescheduled():
    events = [down("prefill-0", T0 + 0.1, ["a", "b"]), replaced("a", T0 + 0.3),
              {"type": "reschedule_failed", "request_id": "b", "wall_time": T0 + 5.3}]
    [s] = measure([kill("prefill-0", T0, role="prefill")], events, [ok_record(T0 + 0.2, T0 + 0.5)])
    assert s.total_s is None and s.failed == ["b"]
    [s] = measure([kill("x", T0)], [], [ok_record(T0 + 0.2, T0 + 0.5)])
    assert "never declared x down" in s.problem


def test_events_are_attributed_to_the_right_fault_of_the_same_worker():
    faults = [kill("decode-0", T0), kill("decode-0", T0 + 10)]
    events = [down("decode-0", T0 + 0.1, ["a"]), replaced("a", T0 + 0.2),
              down("decode-0", T0 + 10.5, ["b"]), replaced("b", T0 + 12.0)]
    records = [ok_record(T0 + 0.1, T0 + 0.3), ok_record(T0 + 10.1, T0 + 10.2)]
    first, second = measure(faults, events, records)
    assert first.total_s == pytest.approx(0.3) and second.total_s == pytest.approx(2.0)


def test_nearest_rank_percentiles_are_observed_values():
    values = [0.1, 0.2, 0.3, 0.4, 2.9, 3.5]
    assert nearest_rank(values, 100) == 3.5 and nearest_rank(values, 95) == 3.5 and nearest_rank(values, 50) == 0.3


def _samples(times_by_fault):
    faults, events, records = [], [], []
    for i, (worker, role, kind, total) in enumerate(times_by_fault):
        t = T0 + 20 * i
        faults.append(kill(worker, t, role=role, kind=kind))
        events += [down(worker, t + 0.05, [f"q{i}"]), replaced(f"q{i}", t + total)]
        records.append(ok_record(t + 0.01, t + 0.02))
    return measure(faults, events, records)


def plan(p100):
    """Three kills and three hangs of each role (min_faults_per_kind), the last hang taking ``p100``."""
    return [(f"{role}-{k % 2}", role, kind, 0.5 + 0.1 * k) for kind in ("process_kill", "process_hang")
            for role in ("prefill", "decode") for k in range(3)][:-1] + [("decode-0", "decode", "process_hang", p100)]


def test_verdict_pass_fail_and_inconclusive():
    cl = Checklist.load()
    v = reschedule_verdict(_samples(plan(2.4)), cl)
    assert v.status is Status.PASS and v.measured == pytest.approx(2.4)
    assert [s["label"] for s in v.evidence["samples"]][-1] == "hang decode-0"
    v = reschedule_verdict(_samples(plan(4.2)), cl)
    assert v.status is Status.FAIL and v.measured == pytest.approx(4.2) and v.cause["threshold"] == "<= 3 s"
    v = reschedule_verdict(_samples(plan(1.0)[:2] + plan(1.0)[3:]), cl)
    assert v.status is Status.INCONCLUSIVE and v.cause["code"] == "thin" and "kill prefill x2" in v.cause["because"]
    v = reschedule_verdict(_samples(plan(1.0)[:-2]), cl)  # the minimum applies to hangs too
    assert v.status is Status.INCONCLUSIVE and "hang decode x1" in v.cause["because"], v.reason


def test_a_fault_never_rescheduled_fails_the_item():
    samples = _samples(plan(1.0))
    samples[0].total_s, samples[0].problem = None, "1 affected request(s) could not be re-placed"
    v = reschedule_verdict(samples, Checklist.load())
    assert v.status is Status.FAIL and "never completed" in v.reason
    assert v.evidence["not_rescheduled"][0].startswith("kill prefill-0")


def _with_inject(samples, inject_s):
    from dataclasses import replace
    for s in samples:
        s.fault = replace(s.fault, inject_s=inject_s)
    return samples


def test_each_time_is_known_within_its_inject_step_and_the_clock_resolution():
    cl = Checklist.load()
    # p100 2.95 s, inject step 0.2 s: the true time is in [2.749, 2.951]: every upper bound is within 3 s
    v = reschedule_verdict(_with_inject(_samples(plan(2.95)), 0.2), cl)
    assert v.status is Status.PASS and v.interval["hi"] == pytest.approx(2.951)
    assert v.interval["method"] == "measurement resolution" and v.cause["figure"].endswith("[2.75-2.95, bounds]")
    assert v.evidence["per_fault"][-1]["interval"]["lo"] == pytest.approx(2.749)
    # p100 3.1 s after a 0.2 s inject step: it may have been 2.9 s: not a fail, not a pass
    v = reschedule_verdict(_with_inject(_samples(plan(3.1)), 0.2), cl)
    assert v.status is Status.INCONCLUSIVE and (v.cause["code"], v.cause["threshold"]) == ("straddles", "<= 3 s")
    assert v.cause["resolution_bound"] and v.cause["more_to_decide"] is None
    # 3.3 s: even its lower bound (3.099 s) is beyond the budget
    v = reschedule_verdict(_with_inject(_samples(plan(3.3)), 0.2), cl)
    assert v.status is Status.FAIL


def test_the_evidence_states_the_share_of_faults_within_the_budget_with_confidence():
    v = reschedule_verdict(_samples(plan(2.4)), Checklist.load())
    assert v.evidence["within_budget"] == ("12 of 12 faults rescheduled <= 3 s (upper bounds): with 95 % confidence "
                                           "at least 78 % of all faults do")  # 0.05 ** (1/12)
