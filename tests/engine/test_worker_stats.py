"""The worker's recent-window health inputs (TPOT p99, retransmission rate), with explicit clocks."""

import pytest

from harness.engine.control.worker_stats import RecentWindow


def test_tpot_p99_comes_from_gaps_between_a_requests_events_per_token():
    w = RecentWindow(window_s=10.0)
    w.on_tokens("a", 1, False, now=0.0)          # first token: TTFT, not a TPOT sample
    for i in range(1, 100):
        w.on_tokens("a", 1, False, now=i * 0.010)  # 10 ms per token
    w.on_tokens("a", 4, True, now=99 * 0.010 + 0.200)  # speculative: 4 tokens after 200 ms = 50 ms each
    assert w.tpot_p99_ms(now=1.2) == pytest.approx(10.0)
    w.on_tokens("b", 1, False, now=1.0)
    w.on_tokens("b", 1, False, now=1.5)           # 500 ms: the tail
    assert w.tpot_p99_ms(now=1.5) == pytest.approx(50.0)  # p99 of 101 samples is the second largest
    assert w.tpot_p99_ms(now=30.0) == 0.0          # everything left the window


def test_retransmission_rate_is_a_windowed_delta():
    w = RecentWindow(window_s=5.0)
    snap = lambda retries, frames, rejected=0: {"paths": {"fabric": {"retries": retries, "frames": frames}},  # noqa: E731
                                                "received": {"frames": 0}, "rejected": {"crc": rejected}}
    assert w.retrans_rate(snap(10, 1000), now=0.0) == 0.0      # history before the window counts nothing
    assert w.retrans_rate(snap(15, 1100, rejected=5), now=1.0) == pytest.approx(10 / 100)
    assert w.retrans_rate(snap(15, 1200, rejected=5), now=7.0) == pytest.approx(0.0)  # old samples dropped
