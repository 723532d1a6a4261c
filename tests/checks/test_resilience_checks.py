"""Verdicts of items 6.1.2, 6.1.3 and ecc from hand-built events and records."""

from harness.checks.degradation import Step, degradation_verdict
from harness.checks.ecc import Poisoning, ecc_verdict, judge_outcomes
from harness.checks.migration import measure, migration_verdict
from harness.checklists import Checklist
from harness.probes.client.records import RequestRecord

CHECKLIST = Checklist.load()


def record(rid, gaps_ms, ok=True):
    t, chunk_ns = 0, []
    for g in [0.0, *gaps_ms]:
        t += int(g * 1e6)
        chunk_ns.append(t)
    return RequestRecord(request_id=rid, response_id=rid, status="ok" if ok else "timeout", chunk_ns=chunk_ns,
                         chunk_tokens=[1] * len(chunk_ns), token_ids=list(range(len(chunk_ns))))


def resumed(rid, seq, stall_s, gap_s, at):
    return {"seq": seq, "type": "migration_resumed", "request_id": rid, "from_worker": "decode-0",
            "to_worker": "decode-1", "stall_s": stall_s, "typical_gap_s": gap_s, "at_token": at}


def test_migration_excess_is_stall_minus_typical_gap_per_phase():
    """Catches an excess that is not stall minus the typical gap, and a fail on fewer migrations
    than the wrong-fail level allows (13 for a median at 0.015 % one-sided, issue 33)."""
    events = [resumed(f"i{n}", n, 0.030 + n / 1000, 0.005, 10) for n in range(8)]
    events += [resumed(f"l{n}", 20 + n, 0.250 + n / 1000, 0.020, 10) for n in range(16)]
    records = [record(f"i{n}", [5.0] * 9 + [30.0] + [5.0] * 5) for n in range(8)]
    phases = {**{f"i{n}": "idle" for n in range(8)}, **{f"l{n}": "loaded" for n in range(16)}}
    samples = measure(events, records, phases)
    assert samples[0].excess_ms == 25.0 and samples[0].client_stall_ms == 30.0 and samples[0].client_typical_gap_ms == 5.0
    v = migration_verdict(samples, [], CHECKLIST)
    # the median of 16 loaded deltas (230..245 ms) and its whole interval (the fail side at 0.015 %) are beyond 200 ms
    assert v.status.value == "fail" and "median hot-migration TTFT delta under full load" in v.reason
    assert v.measured == 237.0 and v.interval["lo"] == 230.0 and v.interval["hi"] == 243.0
    assert v.interval["alpha_lo"] < v.interval["alpha_hi"] and v.evidence["error_control"]["looks"] == 5
    assert v.evidence["within_limit"]["idle"].startswith("8 of 8 migrations added < 50 ms: with 95 % confidence at least 69 % of all migrations do")
    few = migration_verdict(measure(events[:8] + events[8:16], records, phases), [], CHECKLIST)
    assert few.status.value == "inconclusive", few.reason   # 8 loaded beyond: no lower bound at the fail level


def test_a_median_delta_near_the_limit_straddles_and_names_what_would_decide():
    events = [resumed(f"i{n}", n, 0.010, 0.005, 10) for n in range(8)]
    events += [resumed(f"l{n}", 10 + n, 0.020 + 0.030 * n, 0.0, 10) for n in range(8)]   # 20..230 ms
    phases = {**{f"i{n}": "idle" for n in range(8)}, **{f"l{n}": "loaded" for n in range(8)}}
    records = [record(rid, [5.0] * 12) for rid in phases]
    v = migration_verdict(measure(events, records, phases), [], CHECKLIST)
    assert v.status.value == "inconclusive" and (v.cause["code"], v.cause["threshold"]) == ("straddles", "< 200 ms")
    assert v.cause["noun"] == "migrations" and v.cause["more_to_decide"] is not None


def test_refused_migrations_fail_with_the_reason():
    v = migration_verdict([], ["migration from decode-0 refused with HTTP 409: live migration is disabled"], CHECKLIST)
    assert v.status.value == "fail" and "live migration is disabled" in v.reason


def test_too_few_migrations_are_inconclusive():
    samples = measure([resumed("a", 1, 0.01, 0.005, 3)], [record("a", [5.0] * 6)], {"a": "idle"})
    assert migration_verdict(samples, [], CHECKLIST).status.value == "inconclusive"


def level(seq, a, b, hbm):
    return {"seq": seq, "type": "degradation_level", "from_level": a, "to_level": b, "hbm": hbm, "reason": "r"}


def test_degradation_in_order_at_thresholds_passes():
    steps = [Step("s1", 0.8, 1, reached=1), Step("s2", 0.875, 2, reached=2), Step("s3", 0.925, 3, reached=3)]
    events = [level(1, 0, 1, 0.80), level(2, 1, 2, 0.876), level(3, 2, 3, 0.926), level(4, 3, 2, 0.1)]
    v = degradation_verdict(steps, events, 7.5, CHECKLIST)
    assert v.status.value == "pass", v.reason


def test_early_trigger_and_missing_level_fail():
    steps = [Step("s1", 0.8, 1, reached=2), Step("s2", 0.875, 2, reached=2), Step("s3", 0.925, 3, reached=2)]
    v = degradation_verdict(steps, [level(1, 0, 1, 0.8), level(2, 1, 2, 0.80)], 3.0, CHECKLIST)
    assert v.status.value == "fail" and "Level 2 was entered" in v.reason
    assert "Level 3 was never entered" in v.evidence["problems"]


def test_disabled_controller_fails_not_inconclusive():
    steps = [Step("s", 0.875, 2)]
    v = degradation_verdict(steps, [], 0.0, CHECKLIST, controller_enabled=False)
    assert v.status.value == "fail" and "degradation_enabled is false" in v.reason


def test_missing_action_fails():
    steps = [Step("s3", 0.925, 3, reached=3, actions_missing=["s3: decode-0 has KV offload off at Level 3"])]
    events = [level(1, 0, 1, 0.8), level(2, 1, 2, 0.87), level(3, 2, 3, 0.92)]
    v = degradation_verdict(steps, events, 5.0, CHECKLIST)
    assert v.status.value == "fail" and "offload off" in v.reason


def test_ecc_verdict_counts_wrong_outputs_and_escaped_blocks():
    good = Poisoning("decode-0", [1, 2], ["a#0"], min_quarantined=2)
    bad = Poisoning("decode-1", [3, 4], ["b#0"], min_quarantined=1)
    third = Poisoning("decode-0", [5, 6], ["c#0"], min_quarantined=2)
    recs = [record("a", [5.0]), record("b", [5.0]), record("c", [5.0])]
    judge_outcomes([good, bad, third], recs, lambda r: r.response_id != "b")
    assert bad.outcomes == {"b": "completed WRONG"}
    v = ecc_verdict([good, bad, third], CHECKLIST)
    assert v.status.value == "fail" and v.measured == 1  # one block left quarantine early
    assert any("WRONG" in line for line in v.evidence["not_recovered"])
    assert "decode-1 blocks [3, 4]: 1 of 2 quarantined" in v.reason  # names the escaped blocks
    assert "; also requests on poisoned blocks not recovered (of 3: 1 completed WRONG): 1 requests" in v.reason


def test_ecc_verdict_passes_when_every_block_stays_quarantined_and_outputs_are_exact():
    ps = [Poisoning(f"decode-{i % 2}", [2 * i, 2 * i + 1], [f"r{i}#0"], min_quarantined=2) for i in range(3)]
    judge_outcomes(ps, [record(f"r{i}", [5.0]) for i in range(3)], lambda r: True)
    v = ecc_verdict(ps, CHECKLIST)
    assert v.status.value == "pass" and v.measured == 0 and "quarantined)" not in v.reason
