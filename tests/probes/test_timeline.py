import pytest

from harness.errors import ProbeError
from harness.faults.base import Action, FaultRecord, RecordStatus
from harness.probes.client.records import ClockAnchor, RequestRecord
from harness.probes.client.timeline import merge_timeline

S = 1_000_000_000
# this process's clocks: wall 1e18 ns when monotonic was 5_000 s
ANCHOR = ClockAnchor(wall_ns=10**18, mono_ns=5_000 * S, perf_ns=0)


def _fault(action: Action, mono_s: float, wall_skew_s: float = 0.0) -> FaultRecord:
    wall_s = 10**9 + (mono_s - 5_000) + wall_skew_s
    return FaultRecord("kill-1", "process_kill", "decode-0", action, started_wall=wall_s, started_mono=mono_s,
                       ended_wall=wall_s + 0.01, ended_mono=mono_s + 0.01, status=RecordStatus.SUCCEEDED)


def _request(rid: str, mono_s: float, status: str = "ok") -> RequestRecord:
    # a load process whose perf counter read 0 at monotonic 4_990 s
    perf = int((mono_s - 4_990) * S)
    return RequestRecord(request_id=rid, scheduled_ns=perf, sent_ns=perf, end_ns=perf + S // 10, status=status,
                         anchor_wall_ns=10**18 - 10 * S, anchor_mono_ns=4_990 * S, anchor_perf_ns=0)


def test_sources_interleave_in_monotonic_order():
    faults = [_fault(Action.INJECT, 5_010.0), _fault(Action.REVERT, 5_020.0)]
    events = [{"kind": "worker_down", "worker": "decode-0", "wall": 10**9 + 10.5, "mono": 5_010.5},
              {"kind": "reschedule", "request_id": "load-7", "wall_ns": 10**18 + int(11.0 * S),
               "mono_ns": 5_011 * S}]
    records = [_request("load-1", 5_009.0), _request("load-7", 5_010.2, status="ok"),
               _request("load-9", 5_021.0, status="http_error")]
    tl = merge_timeline(faults=faults, events=events, records=records, anchor=ANCHOR)
    assert [e["kind"] for e in tl] == ["request_ok", "fault_inject", "request_ok", "worker_down", "reschedule",
                                       "fault_revert", "request_http_error"]
    assert [e["t_s"] for e in tl] == pytest.approx([0.0, 1.0, 1.2, 1.5, 2.0, 11.0, 12.0])
    down = tl[3]
    assert down["source"] == "engine" and down["detail"] == {"worker": "decode-0"}
    assert tl[1]["detail"]["fault"] == "process_kill" and tl[1]["detail"]["status"] == "succeeded"
    assert tl[-1]["detail"]["request_id"] == "load-9"


def test_monotonic_order_survives_a_wall_clock_step_and_wall_mode_shows_it():
    # the wall clock stepped back 100 s between the two activities: monotonic order is still right
    faults = [_fault(Action.INJECT, 5_010.0), _fault(Action.REVERT, 5_020.0, wall_skew_s=-100.0)]
    assert [e["kind"] for e in merge_timeline(faults=faults, anchor=ANCHOR)] == ["fault_inject", "fault_revert"]
    assert [e["kind"] for e in merge_timeline(faults=faults, anchor=ANCHOR, clock="wall")] == \
        ["fault_revert", "fault_inject"]


def test_failed_only_filter_and_bad_inputs():
    records = [_request("a", 5_001.0), _request("b", 5_002.0, status="timeout")]
    assert [e["detail"]["request_id"] for e in merge_timeline(records=records, failed_requests_only=True,
                                                             anchor=ANCHOR)] == ["b"]
    with pytest.raises(ProbeError, match="neither a wall nor a monotonic time"):
        merge_timeline(events=[{"kind": "worker_up"}], anchor=ANCHOR)
    with pytest.raises(ProbeError, match="unknown timeline clock"):
        merge_timeline(clock="tsc")
    assert merge_timeline() == []


def test_engine_events_are_recorded_once_across_suites():
    # the admin API returns the router's whole log each time: the second suite reads the first's events again
    log = [{"seq": 1, "type": "worker_down", "wall_time": 10**9 + 10.0, "monotonic": 5_010.0},
           {"seq": 2, "type": "reschedule", "wall_time": 10**9 + 11.0, "monotonic": 5_011.0}]
    seen: set[str] = set()
    first = merge_timeline(events=log, anchor=ANCHOR, seen_events=seen)
    later = [{"seq": 3, "type": "worker_up", "wall_time": 10**9 + 20.0, "monotonic": 5_020.0}]
    second = merge_timeline(events=log + later + log[:1], anchor=ANCHOR, seen_events=seen)
    assert [e["kind"] for e in first] == ["worker_down", "reschedule"]
    assert [e["kind"] for e in second] == ["worker_up"]
    assert second[0]["detail"] == {"seq": 3} and second[0]["event_id"] == f"engine:3@{(10**9 + 20) * S}"
    # a restarted router numbers from 1 again: the same number at another time is another event
    restarted = [{"seq": 1, "type": "worker_down", "wall_time": 10**9 + 30.0, "monotonic": 5_030.0}]
    assert [e["kind"] for e in merge_timeline(events=restarted, anchor=ANCHOR, seen_events=seen)] == ["worker_down"]
    # events without a number cannot be told apart: all are kept
    plain = [{"kind": "x", "wall": 10**9 + 1.0}] * 2
    assert len(merge_timeline(events=plain, anchor=ANCHOR, clock="wall")) == 2
