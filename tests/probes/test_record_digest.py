"""A soak judges its records in one pass from disk (harness/probes/client/record_digest.py): the digest's
figures must be exactly those the record-holding checks compute."""

from __future__ import annotations

import dataclasses
import random

import pandas as pd

from harness.checks.reschedule import FirstSuccess, _sent_and_first_token_wall, succeeded
from harness.checks.slo import client_samples
from harness.probes.client.analysis import windowed, windowed_frame
from harness.probes.client.record_digest import CHUNK, RecordDigest
from harness.probes.client.records import NOT_SENT, iter_records, write_records
from tests.checks.test_slo import rec


def mixed(n: int) -> list:
    """ok requests of varied latency, server errors, and open-loop arrivals never sent."""
    rng = random.Random(7)
    out = []
    for i in range(n):
        r = rec(i, ttft_ms=rng.uniform(5, 900), tpot_ms=rng.uniform(1, 40), n=rng.choice([1, 2, 16]))
        if i % 97 == 0:
            r = rec(i, 0, 0, status="http_error")
        elif i % 101 == 0:
            r = dataclasses.replace(r, error_class=NOT_SENT, status="cancelled", first_token_ns=None, chunk_ns=[],
                                    chunk_tokens=[], end_ns=None)
        out.append(r)
    rng.shuffle(out)   # files are read run by run, not in send order
    return out


def test_the_digest_passes_every_record_through_and_keeps_the_figures_the_checks_compute():
    records = mixed(2 * CHUNK + 123)   # more than one chunk, and a partial last one
    digest = RecordDigest()
    passed = list(digest.observe(iter(records)))
    assert passed == records and len(digest) == len(records)
    requests, ttft, tpot = digest.client_samples()
    want = client_samples(records)
    assert requests == want[0] and sorted(ttft) == sorted(want[1]) and sorted(tpot) == sorted(want[2])
    # in send order, as LoadRunner.records gives the checks (the dependence estimate reads the order;
    # planted: the digest's file order, the records shuffled here)
    in_order = client_samples(sorted(records, key=lambda r: r.start_wall_ns()))
    assert ttft == in_order[1] and tpot == in_order[2]
    assert [r.request_id for r in digest.failed] == [r.request_id for r in records if not r.ok]
    assert sorted(digest.successes()) == sorted(_sent_and_first_token_wall(r) for r in records if succeeded(r))
    # the report's charts: the same windows from the kept columns as from the records
    sent = [r for r in records if r.error_class != NOT_SENT]
    t0 = min(r.start_wall_ns() for r in sent)
    frame = digest.frame()
    frame["t_s"] = (frame["start_wall_ns"] - t0) / 1e9
    for metric in ("ttft_ms", "tpot_ms"):
        pd.testing.assert_frame_equal(windowed_frame(frame, window_s=60, metric=metric),
                                      windowed(sent, window_s=60, metric=metric, t0_wall_ns=t0), check_dtype=False)
    assert digest.nbytes() < 60 * len(records)


def test_a_window_takes_the_requests_sent_in_it():
    records = mixed(1000)
    digest = RecordDigest().add(records)
    t = lambda r: r.start_wall_ns() / 1e9   # noqa: E731
    times = sorted(t(r) for r in records)
    lo, hi = times[200], times[700]
    chosen = [r for r in records if lo <= t(r) < hi]
    requests, ttft, _ = digest.client_samples(lo, hi)
    assert (requests, sorted(ttft)) == (client_samples(chosen)[0], sorted(client_samples(chosen)[1]))


def test_first_success_after_is_the_earliest_first_token_of_a_request_sent_at_or_after():
    rng = random.Random(3)
    pairs = [(s, s + rng.uniform(0.01, 5)) for s in (rng.uniform(0, 100) for _ in range(3000))]
    first = FirstSuccess(pairs)
    for wall in [-1, 0, 17.5, 50, 99.9, 100.5, *(s for s, _ in pairs[:50])]:
        brute = min((f for s, f in pairs if s >= wall), default=None)
        assert first.after(wall) == brute
    assert FirstSuccess([]).after(0) is None and len(first) == 3000


def test_records_stream_from_a_file_a_line_at_a_time(tmp_path):
    path = tmp_path / "requests.jsonl"
    records = mixed(300)
    write_records(path, records)
    with open(path, "a") as fh:
        fh.write('{"request_id": "cut')   # a writer killed mid-line
    stream = iter_records(path)
    assert next(stream) == records[0]   # a generator: the file is read as it is consumed
    assert [records[0], *stream] == records
