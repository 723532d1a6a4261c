"""Item 6.1.2's three outcomes kept apart: a migration that happened and was measured, one the
engine refused (a failure), one the harness could not observe (unmeasured, never a failure).

Unit tests sort hand-built attempts; the slow tests make each outcome happen on a real router
with real decode workers."""

from __future__ import annotations

import functools

import pytest

from harness.checks.migration import assess, measure, migration_verdict
from harness.checklists import Checklist
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.pd.topology import Topology
from harness.errors import ProbeError
from harness.evidence.migration import MigrationAttempt
from harness.scenarios.migration import migrate_observed_stream
from harness.probes.client.records import RequestRecord

CHECKLIST = Checklist.load()


def record(rid: str, n: int = 40, gap_ms: float = 5.0, status: str = "ok") -> RequestRecord:
    return RequestRecord(request_id=rid, response_id=rid, status=status, end_ns=int(n * gap_ms * 1e6),
                         chunk_ns=[int(i * gap_ms * 1e6) for i in range(n)], chunk_tokens=[1] * n,
                         token_ids=list(range(n)), error_message=None if status == "ok" else "cut")


def resumed(rid: str, seq: int, stall_s: float = 0.012, gap_s: float | None = 0.005) -> dict:
    return {"seq": seq, "type": "migration_resumed", "request_id": rid, "from_worker": "decode-0",
            "to_worker": "decode-1", "stall_s": stall_s, "typical_gap_s": gap_s, "at_token": 20}


def attempt(i: int, outcome: str, rid: str | None = None, detail: str = "", phase: str = "idle") -> MigrationAttempt:
    return MigrationAttempt(phase, i, outcome, detail, source="decode-0" if rid else None, request_id=rid)


def test_the_three_outcomes_are_sorted_apart():
    attempts = [attempt(0, "migrated", "a"), attempt(1, "refused", "b", "HTTP 409: live migration is disabled"),
                attempt(2, "unobservable", None, "the stream ended after 3 token(s)")]
    records = [record("a"), record("b"), record("c", n=3)]
    result = assess(attempts, measure([resumed("a", 1)], records, {"a": "idle"}), records)
    assert [s.request_id for s in result.samples] == ["a"] and result.samples[0].excess_ms == 7.0
    assert len(result.failures) == 1 and "live migration is disabled" in result.failures[0]
    assert len(result.unmeasured) == 1 and "ended after 3 token" in result.unmeasured[0]
    assert result.measured("idle") == 1 and result.measured("loaded") == 0


def test_unmeasured_attempts_are_not_failures_and_too_few_measured_is_inconclusive():
    """The failure of issue 16: streams the harness could not catch used to count as failed
    migrations and failed a healthy cluster; now they leave the item inconclusive, saying why."""
    attempts = [attempt(i, "unobservable", None, "the stream ended after 400 token(s), before the harness saw "
                        "it mid-decode") for i in range(3)]
    v = migration_verdict(assess(attempts, [], []), checklist=CHECKLIST)
    assert v.status.value == "inconclusive", v.reason
    assert "too few migrations measured" in v.reason and "3 attempt(s) could not be measured" in v.reason
    assert v.evidence["failed_migrations"] == 0 and v.evidence["unmeasured_migrations"] == 3


def test_enough_measured_migrations_pass_with_the_unmeasured_count_beside():
    rids = [f"i{k}" for k in range(8)] + [f"l{k}" for k in range(8)]  # min_migrations_idle 8 (a median's bounds)
    attempts = [attempt(k, "migrated", r, phase="idle" if r[0] == "i" else "loaded") for k, r in enumerate(rids)]
    attempts.append(attempt(99, "unobservable", None, "the stream had left decode-0: nothing to migrate"))
    records = [record(r) for r in rids]
    samples = measure([resumed(r, k) for k, r in enumerate(rids)], records,
                      {r: "idle" if r[0] == "i" else "loaded" for r in rids})
    v = migration_verdict(assess(attempts, samples, records), checklist=CHECKLIST)
    assert v.status.value == "pass", v.reason
    assert "1 attempt(s) unmeasured, not counted as failures" in v.reason
    assert v.evidence["unmeasured_migrations"] == 1 and v.evidence["failed_migrations"] == 0


def test_a_migrated_stream_that_then_failed_is_the_engines_failure():
    attempts = [attempt(0, "migrated", "a"), attempt(1, "migrated", "b")]
    records = [record("a", status="stream_error"), record("b", status="timeout")]
    # "a" has its resumed event (the request failed after it), "b" has none at all
    result = assess(attempts, measure([resumed("a", 1)], records, {"a": "idle", "b": "idle"}), records)
    assert not result.samples and not result.unmeasured
    assert len(result.failures) == 2 and all("the request ended" in f for f in result.failures)


def test_no_steady_gap_or_no_resumed_event_is_unmeasured():
    attempts = [attempt(0, "migrated", "a"), attempt(1, "migrated", "b")]
    records = [record("a"), record("b")]
    result = assess(attempts, measure([resumed("a", 1, gap_s=None)], records, {"a": "idle", "b": "idle"}), records)
    assert not result.failures and len(result.unmeasured) == 2
    assert "no steady inter-token gap" in result.unmeasured[0] and "no migration_resumed" in result.unmeasured[1]


def test_a_victim_must_have_tokens_left_after_the_migration():
    with pytest.raises(ProbeError, match="must exceed after_tokens"):
        migrate_observed_stream("http://127.0.0.1:9", "http://127.0.0.1:9", phase="idle", index=0, prompt="x",
                                max_tokens=8, after_tokens=8)


# ---- the same outcomes on a real cluster ----------------------------------------------------

PRESET = "tiny"


@functools.lru_cache(maxsize=None)
def oracle(prompt: str, max_tokens: int) -> list[int]:
    return greedy_reference(PRESET, ByteTokenizer().encode(prompt), max_tokens, ignore_eos=True)


@pytest.mark.slow
def test_real_migration_is_measured_and_a_stream_caught_too_late_is_unobservable():
    with Topology(prefill=1, decode=2, preset=PRESET, router_config={"auto_migrate": False}) as topo:
        done, rec = migrate_observed_stream(topo.api_url, topo.admin_url, phase="idle", index=0,
                                            prompt="migrate me", max_tokens=120, after_tokens=24)
        # 4 tokens left when it is asked for: the engine will not move a stream about to end
        late, late_rec = migrate_observed_stream(topo.api_url, topo.admin_url, phase="idle", index=1,
                                                 prompt="too late", max_tokens=28, after_tokens=24)
        events = topo.events()
    assert done.outcome == "migrated", done.detail
    assert done.source in ("decode-0", "decode-1") and done.done and done.done["target"] != done.source
    assert rec.ok and rec.token_ids == oracle("migrate me", 120) and len(rec.served_by) >= 2
    assert late.outcome == "unobservable" and late.source and "had left" in late.detail, late.detail
    assert late_rec.ok and late_rec.token_ids == oracle("too late", 28)
    result = assess([done, late], measure(events, [rec, late_rec], {done.request_id: "idle"}), [rec, late_rec])
    assert len(result.samples) == 1 and result.samples[0].excess_ms is not None
    assert not result.failures and len(result.unmeasured) == 1


@pytest.mark.slow
def test_a_migration_the_engine_refuses_is_a_failure():
    with Topology(prefill=1, decode=2, preset=PRESET,
                  router_config={"auto_migrate": False, "migration_enabled": False}) as topo:
        refused, rec = migrate_observed_stream(topo.api_url, topo.admin_url, phase="idle", index=0,
                                               prompt="stay here", max_tokens=80, after_tokens=24)
    assert refused.outcome == "refused" and "migration is disabled" in refused.detail, refused.detail
    assert rec.ok and rec.token_ids == oracle("stay here", 80)  # the refused stream still completes
    result = assess([refused], [], [rec])
    assert len(result.failures) == 1 and not result.samples and not result.unmeasured
