import math

import pandas as pd
import pytest

from harness.errors import ProbeError
from harness.probes.client.analysis import (SLO, itl_frame, mark_fault_windows, percentiles, requests_frame, summarize,
                                     windowed)
from harness.probes.client.records import RequestRecord

MS = 1_000_000


def ok_record(i: int, *, start_ms: float, delay_ms: float = 0, ttft_ms: float = 10, gaps_ms=(5, 5, 5),
              tokens=None) -> RequestRecord:
    """A completed request: scheduled at start_ms, sent delay_ms later, chunks after ttft_ms then each gap."""
    sched = int(start_ms * MS)
    sent = sched + int(delay_ms * MS)
    chunks = [sent + int(ttft_ms * MS)]
    for g in gaps_ms:
        chunks.append(chunks[-1] + int(g * MS))
    tokens = tokens or [1] * len(chunks)
    return RequestRecord(request_id=f"r{i}", scheduled_ns=sched, sent_ns=sent, first_byte_ns=chunks[0],
                         first_token_ns=chunks[0], chunk_ns=chunks, chunk_tokens=list(tokens), end_ns=chunks[-1],
                         completion_tokens=sum(tokens), anchor_wall_ns=10**18, anchor_perf_ns=0)


def failed_record(i: int, *, start_ms: float, status: str = "http_error", e2e_ms: float = 1.0) -> RequestRecord:
    t = int(start_ms * MS)
    return RequestRecord(request_id=f"f{i}", scheduled_ns=t, sent_ns=t, end_ns=t + int(e2e_ms * MS), status=status,
                         http_status=429 if status == "http_error" else None, error_class="rate_limit_error",
                         anchor_wall_ns=10**18, anchor_perf_ns=0)


def test_per_request_metrics_follow_the_definitions():
    r = ok_record(0, start_ms=0, delay_ms=4, ttft_ms=20, gaps_ms=(10, 30), tokens=[1, 2, 1])
    row = requests_frame([r]).iloc[0]
    assert row["ttft_ms"] == pytest.approx(20)
    assert row["e2e_ms"] == pytest.approx(60)
    assert row["n_tokens"] == 4
    assert row["tpot_ms"] == pytest.approx((60 - 20) / 3)         # (E2E - TTFT) / (n - 1)
    assert row["ttft_sched_ms"] == pytest.approx(24) and row["e2e_sched_ms"] == pytest.approx(64)
    assert row["sched_delay_ms"] == pytest.approx(4)
    assert list(itl_frame([r])["itl_ms"]) == pytest.approx([10, 30])  # per chunk, not per token
    one = requests_frame([ok_record(1, start_ms=0, gaps_ms=())]).iloc[0]
    assert math.isnan(one["tpot_ms"])                              # undefined for a single token


def test_failures_are_counted_apart_and_never_enter_percentiles():
    oks = [ok_record(i, start_ms=i * 100, ttft_ms=10 + i) for i in range(10)]   # TTFT 10..19 ms
    fails = [failed_record(i, start_ms=i * 100, e2e_ms=0.5) for i in range(5)] + \
            [failed_record(9, start_ms=50, status="timeout", e2e_ms=60_000)]
    s = summarize(oks + fails)
    assert (s["requests"], s["ok"], s["failed"]) == (16, 10, 6)
    assert s["by_status"]["http_error"] == 5 and s["by_status"]["timeout"] == 1 and s["by_status"]["ok"] == 10
    assert s["error_classes"] == {"rate_limit_error": 6}
    ttft = s["latency_ms"]["sent"]["ttft_ms"]
    assert ttft["n"] == 10 and ttft["max"] == pytest.approx(19) and ttft["p50"] == pytest.approx(14)  # nearest rank: an observed value
    assert s["latency_ms"]["sent"]["e2e_ms"]["max"] < 100          # the 60 s timeout is not in there
    assert s["itl_ms"]["n"] == 30


def test_open_loop_reports_latency_from_the_scheduled_send():
    # the generator was late by 500 ms on every request (a stall): sent-basis hides it, scheduled shows it
    recs = [ok_record(i, start_ms=i * 10, delay_ms=500, ttft_ms=10) for i in range(20)]
    s = summarize(recs)
    assert s["latency_ms"]["sent"]["ttft_ms"]["p99"] == pytest.approx(10)
    assert s["latency_ms"]["scheduled"]["ttft_ms"]["p99"] == pytest.approx(510)
    assert s["latency_ms"]["scheduled"]["tpot_ms"] == s["latency_ms"]["sent"]["tpot_ms"]
    assert s["sched_delay_ms"]["p50"] == pytest.approx(500)


def test_goodput_counts_ok_requests_within_the_slo():
    recs = [ok_record(i, start_ms=i * 100, ttft_ms=ttft) for i, ttft in enumerate([10, 20, 300, 40])]
    recs.append(failed_record(0, start_ms=50))
    s = summarize(recs, slo=SLO(ttft_ms=100, tpot_ms=50))
    assert s["slo_attainment"] == pytest.approx(3 / 5)
    assert s["goodput_rps"] == pytest.approx(3 / s["duration_s"])
    with pytest.raises(ProbeError, match="SLO ttft_ms must be > 0"):
        SLO(ttft_ms=0)


def test_windowed_percentiles_show_latency_over_time():
    recs = [ok_record(i, start_ms=i * 100, ttft_ms=10) for i in range(10)]            # window 0: 0..900 ms
    recs += [ok_record(10 + i, start_ms=1000 + i * 100, ttft_ms=200) for i in range(10)]  # window 1: slow
    recs += [failed_record(i, start_ms=1500) for i in range(3)]
    w = windowed(recs, window_s=1.0, metric="ttft_ms")
    assert list(w["window_start_s"]) == [0.0, 1.0]
    assert list(w["ok"]) == [10, 10] and list(w["failed"]) == [0, 3]
    assert w["p99"].tolist() == pytest.approx([10, 200])
    with pytest.raises(ProbeError, match="latency metric 'ttfb' is unknown"):
        windowed(recs, metric="ttfb")
    with pytest.raises(ProbeError, match="basis 'actual' is unknown"):
        windowed(recs, basis="actual")


def test_fault_windows_mark_requests_in_flight_during_a_fault():
    recs = [ok_record(i, start_ms=i * 100, ttft_ms=10, gaps_ms=()) for i in range(10)]
    df = requests_frame(recs)
    base = 10**18
    marked = mark_fault_windows(df, [(base + 305 * MS, base + 505 * MS)])
    # request 3 (300..310 ms) overlaps the window start, 4 and 5 are inside, 6 starts after it ends
    assert marked.loc[marked["in_fault"], "request_id"].tolist() == ["r3", "r4", "r5"]


def test_percentiles_of_nothing_are_nan_not_zero():
    p = percentiles(pd.Series([], dtype=float))
    assert p["n"] == 0 and math.isnan(p["p99"])
    empty = summarize([])
    assert empty["requests"] == 0 and math.isnan(empty["latency_ms"]["sent"]["ttft_ms"]["p50"])


def test_never_sent_arrivals_count_as_cancelled_not_as_generator_lateness():
    recs = [ok_record(i, start_ms=i * 100, delay_ms=2) for i in range(5)]
    t = int(900 * MS)
    recs.append(RequestRecord(request_id="n1", scheduled_ns=int(600 * MS), sent_ns=t, end_ns=t, status="cancelled",
                              error_class="NotSent", anchor_wall_ns=10**18, anchor_perf_ns=0))
    s = summarize(recs)
    assert s["by_status"]["cancelled"] == 1 and s["error_classes"] == {"NotSent": 1}
    assert s["sched_delay_ms"]["max"] == pytest.approx(2) and s["sched_delay_ms"]["n"] == 5
