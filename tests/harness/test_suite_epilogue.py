"""finish_suite: the nothing-lost verdict, latency evidence and timeline every suite ends with.

The request records are test input in the shapes the load generator writes; the conformance sink
records what the suite would put into the report (the real one is exercised by the suite runs)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from harness.suites.epilogue import expectation, finish_suite, run_links
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.probes.client.records import RequestRecord


def rec(rid, status="ok", tokens=(1, 2, 3), **kw):
    tokens = list(tokens)
    base = dict(request_id=rid, status=status, sent_ns=1, end_ns=2, prompt="hello", max_tokens=3,
                token_ids=tokens if status == "ok" else [], chunk_ns=[1] * len(tokens) if status == "ok" else [],
                chunk_tokens=[1] * len(tokens) if status == "ok" else [], finish_reason="length")
    base.update(kw)
    return RequestRecord(**base)


class Sink:
    """What Conformance receives, in order."""

    def __init__(self):
        self.calls = []

    def record(self, verdict):
        self.calls.append(("verdict", verdict))
        return verdict

    def add_latency(self, records):
        self.calls.append(("latency", list(records)))

    def add_timeline(self, entries):
        self.calls.append(("timeline", entries))


def cluster(oracle_calls=None):
    def oracle(prompt_ids, max_tokens, stop=None, ignore_eos=False):
        if oracle_calls is not None:
            oracle_calls.append(ignore_eos)
        return [1, 2, 3][:max_tokens]

    return SimpleNamespace(oracle=oracle, thresholds=Checklist.load())


def test_records_verdict_then_latency_then_timeline():
    sink, calls = Sink(), []
    now_wall, now_mono = time.time(), time.monotonic()
    fault = {"fault_id": "f1", "kind": "process_kill", "target": "decode-0", "action": "inject", "status": "ok",
             "started_wall": now_wall, "started_mono": now_mono, "ended_mono": now_mono + 0.1}
    events = [{"seq": 1, "type": "worker_down", "wall_time": now_wall + 1, "monotonic": now_mono + 1},
              {"seq": 2, "type": "heartbeat", "wall_time": now_wall + 2, "monotonic": now_mono + 2}]
    records = [rec("a"), rec("b", "stream_error", error_class="worker_lost", error_message="decode-0 died")]
    lost = finish_suite(sink, cluster(calls), records, ignore_eos=True, links=["artifacts/x/records.jsonl"],
                        faults=SimpleNamespace(records=[fault]), events=events,
                        event_filter=lambda e: e["type"] != "heartbeat")
    assert [kind for kind, _ in sink.calls] == ["verdict", "latency", "timeline"]
    assert sink.calls[0][1] is lost and lost.item == "nothing-lost" and lost.status is Status.PASS
    assert lost.evidence["links"] == ["artifacts/x/records.jsonl"]
    assert calls and set(calls) == {True}  # the oracle was asked, with the run's ignore_eos
    assert sink.calls[1][1] == records
    kinds = sorted(e["kind"] for e in sink.calls[2][1])
    assert kinds == ["fault_inject", "request_stream_error", "worker_down"]  # ok requests and filtered events left out


def test_wrong_tokens_fail_against_the_oracle_and_pass_without_one():
    records = [rec("a", tokens=(1, 9, 3))]
    assert finish_suite(Sink(), cluster(), records).status is Status.FAIL
    no_oracle = SimpleNamespace(oracle=None, thresholds=Checklist.load())
    assert expectation(no_oracle, ignore_eos=False) is None
    assert finish_suite(Sink(), no_oracle, records).status is Status.PASS


def test_an_expectation_built_by_the_suite_is_used_as_is():
    records = [rec("a", tokens=(1, 9, 3))]
    assert finish_suite(Sink(), cluster(), records, expected=lambda r: [1, 9, 3]).status is Status.PASS
    assert finish_suite(Sink(), cluster(), records, expected=None).status is Status.PASS  # no token check


def test_a_hung_request_fails_and_no_faults_or_events_still_give_a_timeline():
    sink = Sink()
    v = finish_suite(sink, cluster(), [rec("h", "timeout", end_ns=None, error_class="DeadlineExceeded")])
    assert v.status is Status.FAIL and "links" not in v.evidence
    assert [e["kind"] for e in sink.calls[2][1]] == ["request_timeout"]


def test_run_links_point_at_each_runs_records(tmp_path):
    runs = [SimpleNamespace(records_path=tmp_path / f"t-load{i}" / "records.jsonl") for i in range(2)]
    assert run_links(*runs) == ["artifacts/t-load0/records.jsonl", "artifacts/t-load1/records.jsonl"]
