import json

import pytest

from harness.errors import ProbeError
from harness.probes.client.records import ClockAnchor, RecordWriter, RequestRecord, process_anchor, read_records


def _record(i: int, **kw) -> RequestRecord:
    base = dict(request_id=f"r{i}", scheduled_ns=1_000, sent_ns=2_000, first_byte_ns=3_000, first_token_ns=4_000,
                chunk_ns=[4_000, 5_000], chunk_tokens=[1, 2], end_ns=6_000, token_ids=[7, 8, 9],
                served_by=["decode-0"], anchor_wall_ns=10**18, anchor_mono_ns=10**9, anchor_perf_ns=0)
    base.update(kw)
    return RequestRecord(**base)


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    records = [_record(i) for i in range(3)] + [_record(9, status="http_error", http_status=429,
                                                        error_class="rate_limit_error")]
    path = tmp_path / "sub" / "requests.jsonl"
    with RecordWriter(path) as writer:
        for r in records:
            writer.write(r)
    assert read_records(path) == records
    assert len(path.read_text().splitlines()) == 4


def test_truncated_last_line_is_skipped_but_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    good = json.dumps(_record(1).to_dict())
    path.write_text(good + "\n" + good[:20])
    assert [r.request_id for r in read_records(path)] == ["r1"]
    path.write_text(good[:20] + "\n" + good + "\n")
    with pytest.raises(ProbeError, match=":1 is not valid JSON"):
        read_records(path)


def test_bad_status_and_missing_file_name_the_problem(tmp_path):
    with pytest.raises(ProbeError, match="unknown request status 'lost'"):
        _record(1, status="lost")
    with pytest.raises(ProbeError, match="does not exist"):
        read_records(tmp_path / "nope.jsonl")
    with pytest.raises(ProbeError, match="unknown fields"):
        RequestRecord.from_dict({**_record(1).to_dict(), "bogus": 1})


def test_token_times_and_counts_prefer_usage():
    r = _record(1)
    assert r.token_ns == [4_000, 5_000, 5_000]
    assert r.num_output_tokens == 3
    assert _record(1, completion_tokens=5).num_output_tokens == 5


def test_anchor_converts_perf_counter_to_wall_and_monotonic():
    anchor = process_anchor()
    assert process_anchor() is anchor
    a = ClockAnchor(wall_ns=5_000, mono_ns=700, perf_ns=100)
    assert a.perf_to_wall(150) == 5_050 and a.perf_to_mono(150) == 750
    assert _record(1).start_wall_ns() == 10**18 + 1_000
