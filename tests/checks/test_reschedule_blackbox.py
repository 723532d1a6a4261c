"""6.1.4 from the client's view: request records built here in the load generator's shape (anchor:
perf 0 == wall 0, so perf ns are wall ns), a fault time and its victim."""

import pytest

from harness.checks.reschedule_blackbox import (ClientFault, client_view_evidence, client_view_verdict,
                                                first_success_sent_after, longest_stall, measure_client_view)
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.probes.client.records import RequestRecord
from harness.probes.workers.rejoin import Rejoin

T0 = 1_000.0
NS = 1_000_000_000


def stream(rid, sent, chunks, end=None, served_by=("decode-0",), status="ok", error=None, finish="length"):
    """A streamed request: sent at ``sent`` s, one token per chunk at the given times (s)."""
    kw = {}
    if error is not None:
        kw = {"error_class": error[0], "error_message": error[1]}
    return RequestRecord(request_id=rid, sent_ns=int(sent * NS), first_token_ns=int(chunks[0] * NS) if chunks else None,
                         chunk_ns=[int(t * NS) for t in chunks], chunk_tokens=[1] * len(chunks),
                         end_ns=None if end is None else int(end * NS), served_by=list(served_by), status=status,
                         finish_reason=finish if status == "ok" else None, **kw)


def kill(victim="decode-1", role="decode", t=T0):
    return ClientFault(t, (victim,), role, f"kill {victim}")


def test_time_runs_until_the_victims_streams_ended_and_a_new_request_succeeded():
    records = [
        # on the victim at the fault, resumed on decode-0, completed 1.2 s after the fault
        stream("resumed", T0 - 0.5, [T0 - 0.4, T0 - 0.2, T0 + 1.1, T0 + 1.2], end=T0 + 1.2,
               served_by=("decode-1", "decode-0")),
        # on another worker: not affected, even though in flight
        stream("other", T0 - 0.5, [T0 - 0.4, T0 + 0.1], end=T0 + 0.1),
        # sent after the fault, first token at +0.4 s
        stream("new", T0 + 0.2, [T0 + 0.4, T0 + 0.5], end=T0 + 0.5),
        # ended before the fault: not in flight
        stream("old", T0 - 2, [T0 - 1.9], end=T0 - 1.8, served_by=("decode-1",)),
    ]
    [s] = measure_client_view([kill()], records)
    assert s.affected == ["resumed"] and s.completed == ["resumed"]
    assert s.first_new_success_s == pytest.approx(0.4) and s.affected_ended_s == pytest.approx(1.2)
    assert s.total_s == pytest.approx(1.2)
    assert s.longest_stall_s == pytest.approx(1.3) and s.stall_request == "resumed"   # -0.2 -> +1.1


def test_a_clear_error_ends_a_stream_and_a_silent_cut_is_named():
    records = [
        stream("clear", T0 - 0.5, [T0 - 0.4], end=T0 + 0.3, served_by=("decode-1",), status="stream_error",
               error=("server_error", "worker decode-1 died; request could not be resumed")),
        stream("cut", T0 - 0.5, [T0 - 0.4], end=T0 + 0.05, served_by=("decode-1",), status="stream_error",
               error=("IncompleteStream", "stream ended without [DONE]")),
        stream("new", T0 + 0.1, [T0 + 0.2], end=T0 + 0.3),
    ]
    [s] = measure_client_view([kill()], records)
    assert s.failed_clearly == ["clear"] and s.cut_without_error == ["cut"]
    assert s.total_s is None and "cut without an error" in s.problem and "cut" in s.problem
    ev = client_view_evidence([s])
    assert ev["cut_without_error"] == ["cut"] and ev["reschedule_s"] == {"n": 0}


def test_a_hang_is_judged_by_the_stall_clients_see():
    hang = ClientFault(T0, ("decode-1",), "decode", "hang decode-1")
    records = [  # the worker is frozen for 8 s and nobody notices: its stream waits, then goes on
        stream("frozen", T0 - 0.5, [T0 - 0.3, T0 + 8.0, T0 + 8.1], end=T0 + 8.1, served_by=("decode-1",)),
        stream("new", T0 + 0.1, [T0 + 0.2], end=T0 + 0.3),
    ]
    [s] = measure_client_view([hang], records)
    assert s.longest_stall_s == pytest.approx(8.3) and s.stall_request == "frozen"
    assert s.total_s == pytest.approx(8.1)
    v = client_view_verdict([s], Checklist.load())
    assert v.status is Status.FAIL and v.measured == pytest.approx(8.1)


def test_prefill_victims_and_engines_that_name_no_worker():
    records = [
        # waiting for its first token at the fault: may have been on the prefill victim
        stream("waiting", T0 - 0.1, [T0 + 0.6], end=T0 + 0.7, served_by=("decode-0",)),
        # already streaming from a decode worker: a prefill kill cannot touch it
        stream("decoding", T0 - 0.5, [T0 - 0.4, T0 + 0.1], end=T0 + 0.1, served_by=("decode-0",)),
        stream("new", T0 + 0.1, [T0 + 0.2], end=T0 + 0.3),
    ]
    [s] = measure_client_view([kill("prefill-0", "prefill")], records)
    assert s.affected == ["waiting"] and s.total_s == pytest.approx(0.7)
    [s] = measure_client_view([kill("decode-0", "decode")], records)   # a decode victim: both were on it
    assert s.affected == ["waiting", "decoding"]
    anonymous = [stream("a", T0 - 0.5, [T0 - 0.4, T0 + 0.9], end=T0 + 0.9, served_by=()),
                 stream("new", T0 + 0.1, [T0 + 0.2], end=T0 + 0.3, served_by=())]
    [s] = measure_client_view([kill()], anonymous)
    assert s.affected == ["a"] and s.total_s == pytest.approx(0.9)


def test_no_new_success_or_a_hung_stream_means_not_rescheduled():
    records = [stream("hung", T0 - 0.5, [T0 - 0.4], end=None, served_by=("decode-1",), status="timeout"),
               stream("new-failed", T0 + 0.1, [], end=T0 + 0.2, status="http_error",
                      error=("overloaded", "no decode worker"))]
    [s] = measure_client_view([kill()], records, window_s=5.0)
    assert s.never_ended == ["hung"] and s.total_s is None
    assert s.longest_stall_s == pytest.approx(5.4)        # the watchdog runs to the window's end
    [s] = measure_client_view([kill()], records[1:])
    assert s.problem == "no request sent after the fault succeeded"


def test_each_fault_window_ends_at_the_next_fault_and_the_distribution_is_nearest_rank():
    faults = [kill(t=T0), kill("decode-0", t=T0 + 10), kill(t=T0 + 20)]
    records = []
    for i, (f, took) in enumerate(zip(faults, (0.5, 1.0, 2.0))):
        records.append(stream(f"on{i}", f.wall - 0.2, [f.wall - 0.1, f.wall + took], end=f.wall + took,
                              served_by=f.victims))
        records.append(stream(f"new{i}", f.wall + 0.05, [f.wall + 0.1], end=f.wall + 0.2, served_by=("x",)))
    samples = measure_client_view(faults, records)
    assert [s.total_s for s in samples] == pytest.approx([0.5, 1.0, 2.0])
    ev = client_view_evidence(samples)
    assert ev["reschedule_s"]["p50"] == pytest.approx(1.0) and ev["reschedule_s"]["p100"] == pytest.approx(2.0)
    v = client_view_verdict(samples, Checklist.load())   # three kills and no hang: too little to pass
    assert v.status is Status.INCONCLUSIVE and v.cause["code"] == "thin"
    assert "hang decode x0 (need 3 of each kind per role)" in v.cause["because"]


def test_longest_stall_counts_only_gaps_that_overlap_the_window():
    r = stream("r", T0 - 10, [T0 - 5, T0 - 4.9, T0 + 0.5], end=T0 + 0.6)
    assert longest_stall(r, T0, T0 + 1) == pytest.approx(5.4)          # -4.9 -> +0.5 spans the fault
    assert longest_stall(r, T0 + 0.55, T0 + 1) == pytest.approx(0.1)   # only the last gap is in the window


def test_fault_marks_of_the_engine_measurement_convert():
    from harness.checks.reschedule import FaultMark
    from harness.checks.reschedule_blackbox import client_faults

    [f] = client_faults([FaultMark("f1", "process_hang", "prefill-1", "prefill", T0)])
    assert f == ClientFault(T0, ("prefill-1",), "prefill", "hang prefill-1")


def quick_faults(kinds=("kill", "hang"), n=3, role="aggregated", victim="vllm-1", stall_s=0.5):
    """n faults of each kind, 10 s apart, each recovered ``stall_s`` after it (records of both)."""
    faults, records = [], []
    for i, kind in enumerate(k for k in kinds for _ in range(n)):
        f = ClientFault(T0 + 10 * i, (victim,), role, f"{kind} {victim}")
        faults.append(f)
        records += [stream(f"on{i}", f.wall - 0.2, [f.wall - 0.1, f.wall + stall_s], end=f.wall + stall_s,
                           served_by=f.victims),
                    stream(f"new{i}", f.wall + 0.05, [f.wall + 0.1], end=f.wall + 0.2, served_by=("x",))]
    return measure_client_view(faults, records)


def rejoin(kept_out_s=None, *, worker="vllm-1", router="vllm-router", watched=("vllm:prompt_tokens on URL",),
           watched_s=0.0):
    return Rejoin(worker, 60.0, T0, list(watched), router, None if kept_out_s is None else T0 + kept_out_s,
                  watched_s=watched_s)


def test_enough_faults_of_each_kind_pass_and_too_few_never_do_but_still_fail():
    assert client_view_verdict(quick_faults(), Checklist.load()).status is Status.PASS
    v = client_view_verdict(quick_faults(n=1), Checklist.load())
    assert v.status is Status.INCONCLUSIVE
    assert "kill aggregated x1, hang aggregated x1 (need 3 of each kind per role)" in v.cause["because"]
    v = client_view_verdict(quick_faults(n=1, stall_s=8.0), Checklist.load())   # one 8 s stall is proof enough
    assert v.status is Status.FAIL


def test_a_cluster_that_keeps_a_healthy_worker_out_fails_naming_the_router_and_the_worker():
    took = [("kill vllm-1", rejoin(12.3))]
    v = client_view_verdict(quick_faults(), Checklist.load(), rejoins=took)
    assert v.status is Status.PASS
    [m] = [m for m in v.evidence["measurements"] if m["key"] == "rejoin_limit_s"]
    assert m["value"] == pytest.approx(12.3) and m["holds"]
    assert v.evidence["rejoin"][0]["sentence"] == "vllm-router took vllm-1 back 12.3 s after it was healthy"
    assert v.evidence["samples"][0]["note"].endswith("; vllm-router took vllm-1 back 12.3 s after it was healthy")

    kept = took + [("kill vllm-0", rejoin(104.4, worker="vllm-0"))]
    v = client_view_verdict(quick_faults(), Checklist.load(), rejoins=kept)
    assert v.status is Status.FAIL and v.measured == pytest.approx(104.4)
    assert v.cause["code"] == "missed" and v.cause["key"] == "rejoin_limit_s"
    assert "vllm-router kept vllm-0 out for 104 s after it was healthy" in v.cause["what"]

    never = [("kill vllm-1", rejoin(None, watched_s=300.2))]     # still out when the watch gave up
    v = client_view_verdict(quick_faults(stall_s=8.0), Checklist.load(), rejoins=never)
    assert v.status is Status.FAIL and v.cause["what"].startswith("p100 client-view rescheduling time")   # the headline ...
    assert "also: vllm-router kept vllm-1 out for 300+ s after it was healthy" in v.layer("note")["text"]   # ... and the rejoin


def test_a_rejoin_that_cannot_be_observed_keeps_the_item_from_passing_naming_why():
    """Planted defect: a worker taken as back by health alone (issue 33: a hung Dynamo mocker the frontend
    no longer listed passed as back): every sample within 3 s, yet the item is inconclusive, naming it."""
    blind = [("kill vllm-1", rejoin(None, router="the cluster", watched=()))]
    v = client_view_verdict(quick_faults(), Checklist.load(), rejoins=blind)
    assert v.status is Status.INCONCLUSIVE and v.cause["code"] == "thin"
    assert "rejoin not observed after kill vllm-1: vllm-1 answers" in v.cause["because"]
    assert not [m for m in v.evidence["measurements"] if m["key"] == "rejoin_limit_s"]
    assert "its rejoin was not observed, never taken as back by health alone" in v.evidence["rejoin"][0]["sentence"]
    v = client_view_verdict(quick_faults(stall_s=8.0), Checklist.load(), rejoins=blind)
    assert v.status is Status.FAIL   # a measured failure still fails


def test_a_role_without_a_survivor_is_named_and_a_stopped_plan_cannot_pass():
    lone = {"prefill": "only one prefill worker (prefill-0): nothing can take over"}
    v = client_view_verdict([], Checklist.load(), not_judged=lone)
    assert v.status is Status.INCONCLUSIVE and "only one prefill worker (prefill-0): nothing can take over" in v.cause["because"]
    decode = quick_faults(role="decode", victim="decode-1")
    v = client_view_verdict(decode, Checklist.load(), roles=["decode"], not_judged=lone)
    # a pass over the decode workers does not cover the prefill role: inconclusive, naming why
    assert v.status is Status.INCONCLUSIVE and "not judged: " + lone["prefill"] in v.cause["because"]
    assert v.evidence["not_judged"] == lone
    v = client_view_verdict(decode, Checklist.load(), stopped="stopped after kill decode-1: ...")
    assert v.status is Status.INCONCLUSIVE and "stopped after kill decode-1" in v.cause["because"]


def test_the_first_success_sent_after_a_time():
    records = [stream("before", T0 - 1, [T0 - 0.5], end=T0 - 0.4),
               stream("failed", T0 + 0.1, [], end=T0 + 0.2, status="http_error", error=("server_error", "x")),
               stream("later", T0 + 0.5, [T0 + 0.9], end=T0 + 1.0),
               stream("sooner", T0 + 0.3, [T0 + 0.6], end=T0 + 2.0)]
    assert first_success_sent_after(records, T0) == pytest.approx(T0 + 0.6)
    assert first_success_sent_after(records, T0 + 0.6) is None


def test_a_stall_the_next_fault_began_is_not_counted_on_the_fault_before_it():
    """Seen on Dynamo: a kill's last chunk came a few ms before the next fault (a hang), and the hang's
    8 s stall was counted as the kill's longest stall. A fault's window ends at the next fault."""
    frozen = stream("frozen", T0 - 0.05, [T0 + 0.1, T0 + 0.45, T0 + 8.8], end=T0 + 9)
    kill_s, hang_s = measure_client_view([kill(t=T0), ClientFault(T0 + 0.5, ("decode-0",), "decode", "hang decode-0")],
                                         [frozen, stream("new", T0 + 0.2, [T0 + 0.3], end=T0 + 0.4)])
    assert kill_s.longest_stall_s == pytest.approx(0.35)   # up to the hang: 0.1 -> 0.45
    assert hang_s.longest_stall_s == pytest.approx(8.35)   # the hang's own: 0.45 -> 8.8
    assert longest_stall(frozen, T0, T0 + 0.5) == pytest.approx(0.35)
