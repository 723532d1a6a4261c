"""6.1.2 on an engine that migrates on worker loss, from the client: records built here in the load
generator's shape (anchor: perf 0 == wall 0, so perf ns are wall ns), kills at known times."""

import pytest

from harness.checks.migration import migration_verdict
from harness.checks.migration_blackbox import KillWindow, crossing, measure
from harness.checks.reschedule_blackbox import ClientFault
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.probes.client.records import RequestRecord

T0 = 1_000.0
NS = 1_000_000_000


def stream(rid, chunks, served_by=(), status="ok", end=None):
    """One token per chunk at the given wall times (s)."""
    err = {} if status == "ok" else {"error_class": "engine_error", "error_message": "worker lost"}
    return RequestRecord(request_id=rid, sent_ns=int((chunks[0] - 0.05) * NS), first_token_ns=int(chunks[0] * NS),
                         chunk_ns=[int(t * NS) for t in chunks], chunk_tokens=[1] * len(chunks),
                         end_ns=int((end or chunks[-1]) * NS), served_by=list(served_by), status=status, **err)


def steady(start, n, gap=0.01):
    return [start + i * gap for i in range(n)]


def kill(victim="decode-1", phase="idle", migrations=None):
    return KillWindow(phase, ClientFault(T0, (victim,), "decode", f"kill {victim}"), migrations)


def test_the_switch_is_the_longest_gap_after_the_kill_not_a_chunk_still_on_its_way():
    # 10 ms gaps; the kill at T0; one chunk the victim made before dying arrives at T0 + 0.005;
    # the stream resumes 150 ms later on the other worker
    rec = stream("s", steady(T0 - 0.1, 10) + [T0 + 0.005] + steady(T0 + 0.155, 5))
    stall, typical = crossing(rec, T0)
    assert stall == pytest.approx(150, abs=0.01) and typical == pytest.approx(10, abs=0.01)
    assert "before the kill" in crossing(stream("late", steady(T0 + 0.1, 5)), T0)
    assert "gap(s) before" in crossing(stream("short", [T0 - 0.02, T0 - 0.01, T0 + 0.2]), T0)


def test_streams_named_on_the_victim_are_the_crossings_and_a_failed_one_is_a_failed_migration():
    records = [
        stream("moved", steady(T0 - 0.1, 10) + steady(T0 + 0.09, 5), served_by=("decode-1", "decode-0")),
        stream("elsewhere", steady(T0 - 0.1, 20), served_by=("decode-0",)),
        stream("lost", steady(T0 - 0.1, 10), served_by=("decode-1",), status="stream_error", end=T0 + 0.5),
        stream("done-before", steady(T0 - 0.5, 10), served_by=("decode-1",)),
    ]
    out = measure([kill()], records)
    assert [(s.request_id, s.source, s.target) for s in out.samples] == [("moved", "decode-1", "decode-0")]
    assert out.samples[0].excess_ms == pytest.approx(90, abs=0.01)  # 100 ms stall - 10 ms typical
    assert len(out.failures) == 1 and "lost" in out.failures[0] and "instead of resuming" in out.failures[0]
    verdict = migration_verdict(out, checklist=Checklist.load())
    assert verdict.status == Status.FAIL and "lost" in verdict.reason


def test_without_worker_names_the_migration_counter_says_how_many_of_the_in_flight_streams_crossed():
    records = [stream("a", steady(T0 - 0.1, 10) + steady(T0 + 0.2, 3)),        # 210 ms stall: crossed
               stream("b", steady(T0 - 0.1, 10) + steady(T0 + 0.03, 3)),       # 40 ms: the kill's contention
               stream("c", steady(T0 - 0.1, 10) + steady(T0 + 0.12, 3))]       # 130 ms: crossed
    out = measure([kill(migrations=2.0)], records)
    assert sorted(s.request_id for s in out.samples) == ["a", "c"] and not out.failures
    # no names and no counter: which streams moved is unknown, so nothing is measured (never a failure)
    blind = measure([kill()], records)
    assert not blind.samples and not blind.failures and "no migration counter" in blind.unmeasured[0]


def test_kills_that_caught_no_stream_on_the_victim_are_unmeasured_with_the_reason():
    elsewhere = [stream("x", steady(T0 - 0.1, 20), served_by=("decode-0",))]
    out = measure([kill()], elsewhere)
    assert not out.samples and "ran on decode-0" in out.unmeasured[0]
    ended = measure([kill()], [stream("y", steady(T0 - 0.5, 10), served_by=("decode-1",))])
    assert "no stream was still decoding" in ended.unmeasured[0]


def test_enough_measured_crossings_under_the_budget_pass_and_phases_are_kept_apart():
    def moved(i, phase_gap):
        return stream(f"m{i}", steady(T0 - 0.1, 10) + steady(T0 + phase_gap, 3), served_by=("decode-1", "decode-0"))

    idle = [moved(i, 0.04) for i in range(8)]       # 50 ms stall - 10 ms typical: 40 ms excess each
    loaded = [moved(10 + i, 0.15) for i in range(8)]  # 150 ms excess each
    out = measure([kill()], idle)
    out2 = measure([kill(phase="loaded")], loaded)
    out.samples += out2.samples
    verdict = migration_verdict(out, checklist=Checklist.load())
    assert verdict.status == Status.PASS, verdict.reason
    assert verdict.evidence["distribution_ms"]["idle"]["p95"] == pytest.approx(40, abs=0.01)
    assert verdict.evidence["distribution_ms"]["loaded"]["p95"] == pytest.approx(150, abs=0.01)


def test_the_typical_gap_is_the_cadence_when_a_busy_client_reads_chunks_in_pairs():
    # two chunks per read: gaps alternate 0 and 12 ms (median 0 or 12), the token cadence is 6 ms
    before = [T0 - 0.12 + 0.012 * (i // 2) for i in range(20)]
    stall, typical = crossing(stream("pairs", before + steady(T0 + 0.09, 4)), T0)
    assert typical == pytest.approx(12 * 9 / 19, abs=0.01) and stall == pytest.approx(102, abs=0.01)
