"""Round trips and flows put on the storm's side or the calm side (6.1.5's interleaved windows)."""

from __future__ import annotations

from harness.fabric.tcpprobe import class_sample, split_by_spans

SPANS = [(10.0, 13.0), (16.0, 19.0)]


def test_inside_a_span_outside_after_the_settle_and_edges_on_neither_side():
    items = [
        (10.5, 10.501, 1.0),   # inside the first group
        (12.9, 13.2, 2.0),     # answered after the group ended: crosses the edge, neither
        (13.2, 13.201, 3.0),   # the group's aftermath (settle 0.5 s): neither
        (13.6, 13.601, 4.0),   # calm
        (15.99, 16.01, 5.0),   # sent calm, answered in the next group: neither
        (9.0, 9.001, 6.0),     # before the first group: calm
        (18.0, 18.5, 7.0),     # inside the second group
        (25.0, 25.1, 8.0),     # after the last group's settle: calm
    ]
    inside, outside = split_by_spans(items, SPANS, settle_s=0.5)
    assert inside == [1.0, 7.0]
    assert outside == [4.0, 6.0, 8.0]


def test_a_group_still_under_way_has_no_end():
    inside, outside = split_by_spans([(30.0, 30.1, 1.0), (5.0, 5.1, 2.0)], [(20.0, float("inf"))], settle_s=0.5)
    assert (inside, outside) == ([1.0], [2.0])


def test_a_side_with_nothing_on_it_is_an_empty_sample():
    empty = class_sample("calm", [], [], 0.0, 1.0)
    assert empty.round_trips == 0 and empty.throughput_bps == 0.0
    full = class_sample("during", [1.0, 2.0, 3.0], [5e8, 6e8], 0.0, 1.0)
    assert (full.rtt_p50_ms, full.rtt_p99_ms, full.rtt_max_ms, full.round_trips) == (2.0, 3.0, 3.0, 3)
    assert full.throughputs_bps == (5e8, 6e8)
