"""6.1.3 by load: requests attributed to the level in force when they were sent, each level's stated
actions judged on them. Records and KV samples built here (anchor: perf 0 == wall 0, so perf ns are
wall ns); the levels are the cluster file's models."""

from harness.checks.degradation_load import level_index_at, load_degradation_verdict, measure_levels
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.clusterfile.models import Degradation
from harness.probes.loadgen.kv_drive import DriveResult, KvSample
from harness.probes.client.records import RequestRecord

NS = 1_000_000_000
QUEUE = {"levels": [{"level": 2, "kv_use_above": 0.8, "expect": {"no_errors": True}},
                    {"level": 3, "kv_use_above": 0.9, "expect": {"queue": True, "no_errors": True}}]}
REJECT = {"levels": [{"level": 1, "kv_use_above": 0.7, "expect": {"no_errors": True}},
                     {"level": 5, "kv_use_above": 0.9,
                      "expect": {"reject": {"status": [429, 503], "retry_after": True}}}]}
CAP = {"levels": [{"level": 4, "kv_use_above": 0.8, "expect": {"max_tokens_cap": 32}}]}


def levels(data):
    return Degradation.model_validate(data).levels


def sample(t, kv, waiting=0.0, preemptions=0.0):
    return KvSample(int(t * NS), kv, 8, waiting=waiting, running=4.0, preemptions=preemptions)


def ok(rid, sent, tokens=200):
    return RequestRecord(request_id=rid, sent_ns=int(sent * NS), first_token_ns=int((sent + 0.1) * NS),
                         chunk_ns=[int((sent + 0.1) * NS)], chunk_tokens=[1], end_ns=int((sent + 1) * NS),
                         completion_tokens=tokens, finish_reason="length")


def refused(rid, sent, status=429, retry_after=True):
    msg = "overloaded" + (" (Retry-After: 1)" if retry_after else "")
    return RequestRecord(request_id=rid, sent_ns=int(sent * NS), end_ns=int((sent + 0.01) * NS), status="http_error",
                         http_status=status, error_class="Overloaded", error_message=msg)


def drive(samples, records, crossed, stopped=20.0, step_down=2.0):
    return DriveResult(samples, records, {i: int(t * NS) for i, t in crossed.items()}, int(stopped * NS),
                       int((stopped + 1) * NS), step_down, "every threshold crossed and held", 2.0, 8)


# KV use rises through 0.8 (t=2) and 0.9 (t=4), falls after the stop at t=20
RAMP = [sample(0, 0.1), sample(1, 0.5), sample(2, 0.85), sample(3, 0.86, waiting=0),
        sample(4, 0.95, waiting=2, preemptions=0), sample(5, 0.97, waiting=3, preemptions=2), sample(6, 0.96),
        sample(21, 0.2)]


def test_the_level_in_force_is_the_latest_sample_before_the_send():
    thresholds = [0.8, 0.9]
    assert level_index_at(RAMP, thresholds, int(0.5 * NS)) is None      # KV use 0.1
    assert level_index_at(RAMP, thresholds, int(2.5 * NS)) == 0         # 0.85: level 2
    assert level_index_at(RAMP, thresholds, int(4.0 * NS)) == 1         # 0.95 at exactly that time
    assert level_index_at(RAMP, thresholds, -1) is None                 # before the first sample


def test_a_queueing_engine_meets_queue_and_no_errors_levels():
    records = [ok("a", 0.5), ok("b", 2.5), ok("c", 3.5), ok("d", 4.5), ok("e", 5.5)]
    verdict = load_degradation_verdict(levels(QUEUE), drive(RAMP, records, {0: 2, 1: 4}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.PASS, verdict.reason
    assert "Levels: 2 (KV use above 0.80, up to 0.86): 2 requests in flight, no_errors held; 3 (" in verdict.reason
    l2, l3 = verdict.evidence["levels"]
    assert (l2["sent"], l3["sent"]) == (2, 2)  # "a" was sent below every threshold
    assert (l2["requests"], l3["requests"]) == (2, 3)  # "c" (sent at 3.5 s, ended at 4.5 s) was in flight in both
    assert l3["waiting_max"] == 3 and l3["preemptions"] == 2
    assert verdict.evidence["highest_kv_use"] == 0.97


def test_an_error_where_no_errors_was_stated_and_no_queueing_fail_naming_the_request():
    records = [ok("b", 2.5), refused("d", 4.5, status=503)]
    calm = [sample(s.t_wall_ns / NS, s.kv_use) for s in RAMP]  # no waiting, no preemption
    verdict = load_degradation_verdict(levels(QUEUE), drive(calm, records, {0: 2, 1: 4}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.FAIL
    problems = verdict.evidence["problems"]
    assert any("no request waited and none was preempted" in p for p in problems)
    assert any("ended with an error" in p and "d (http_error, HTTP 503" in p for p in problems)


def test_rejection_with_retry_after_passes_and_without_it_fails():
    good = [ok("a", 2.5), refused("r1", 4.5), refused("r2", 5.5, status=503)]
    verdict = load_degradation_verdict(levels(REJECT), drive(RAMP, good, {0: 2, 1: 4}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.PASS, verdict.evidence
    assert verdict.evidence["levels"][1]["refused"] == 2
    bare = [ok("a", 2.5), refused("r1", 4.5, retry_after=False)]
    verdict = load_degradation_verdict(levels(REJECT), drive(RAMP, bare, {0: 2, 1: 4}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.FAIL and "without a Retry-After header, e.g. r1" in verdict.reason


def test_a_level_that_refuses_nothing_or_with_another_status_fails():
    served = [ok("a", 2.5), ok("b", 4.5)]
    verdict = load_degradation_verdict(levels(REJECT), drive(RAMP, served, {0: 2, 1: 4}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.FAIL and "level 5: no new request was refused with HTTP 429/503" in verdict.reason
    other = [ok("a", 2.5), refused("r1", 4.5), refused("x", 5.5, status=500)]
    verdict = load_degradation_verdict(levels(REJECT), drive(RAMP, other, {0: 2, 1: 4}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.FAIL
    assert any("failed other than by a stated refusal, e.g. x" in p for p in verdict.evidence["problems"])


def test_completions_over_the_cap_fail_and_within_it_pass():
    over = load_degradation_verdict(levels(CAP), drive(RAMP, [ok("a", 2.5, tokens=64)], {0: 2}), Checklist.load(),
                                    step_down_timeout_s=60)
    assert over.status == Status.FAIL and "exceeded the cap of 32 tokens (e.g. a: 64 tokens)" in over.reason
    within = load_degradation_verdict(levels(CAP), drive(RAMP, [ok("a", 2.5, tokens=32)], {0: 2}), Checklist.load(),
                                      step_down_timeout_s=60)
    assert within.status == Status.PASS


def test_a_level_the_load_could_not_reach_is_inconclusive_with_the_highest_kv_use():
    low = [sample(0, 0.1), sample(1, 0.6), sample(2, 0.84), sample(21, 0.1)]
    verdict = load_degradation_verdict(levels(QUEUE), drive(low, [ok("a", 2.5)], {0: 2}), Checklist.load(),
                                       step_down_timeout_s=60)
    assert verdict.status == Status.INCONCLUSIVE
    assert "level 3 not reached: KV use stayed below 0.90 while the load ramped (highest 0.840" in verdict.reason


def test_kv_use_that_never_falls_back_after_the_load_fails_step_down():
    verdict = load_degradation_verdict(levels(QUEUE), drive(RAMP, [ok("b", 2.5), ok("d", 4.5)], {0: 2, 1: 4},
                                                            step_down=None), Checklist.load(), step_down_timeout_s=60)
    assert verdict.status == Status.FAIL and verdict.evidence["step_down_never"]
    assert "time from the end of the load until KV use fell below 0.80 was 60" in verdict.reason


def test_measure_levels_counts_errors_by_status_and_class():
    [res] = measure_levels(levels(CAP), drive(RAMP, [refused("r", 2.5), ok("a", 3.5, tokens=10)], {0: 2}))
    assert res.errors == {"429 Overloaded": 1} and res.completed == 1 and res.requests == 2


def test_an_error_of_a_request_in_flight_counts_at_the_level_it_overlapped():
    # sent at 1.5 s (below every threshold), still in flight when level 3 held (from 4 s), then failed
    cut = RequestRecord(request_id="cut", sent_ns=int(1.5 * NS), end_ns=int(4.5 * NS), status="stream_error",
                        error_class="EngineDeadError", error_message="EngineCore encountered an issue")
    verdict = load_degradation_verdict(levels(QUEUE), drive(RAMP, [cut, ok("d", 4.5)], {0: 2, 1: 4}),
                                       Checklist.load(), step_down_timeout_s=60)
    assert verdict.status == Status.FAIL
    assert "in flight while it held ended with an error, e.g. cut (stream_error, EngineDeadError" in verdict.reason
