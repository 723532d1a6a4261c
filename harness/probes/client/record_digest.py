"""A run's request records, judged in one pass from disk (issue 27: a 10-hour soak's harness must
not hold every record; about 2 KB each in memory, a million and more of them).

:meth:`RecordDigest.observe` wraps the stream of records read from the load runs' files: each record
passes through to whoever consumes the stream (the nothing-lost check, which needs every token id)
and the digest keeps only the figures the timing checks need, in columns of numbers: when it was
sent, when it ended (its last byte: a request in flight during a VM steal burst is left out of the
soak's windows as 6.2 leaves it out, harness/checks/slo.py ``outside_bursts``), whether it was sent
at all and completed, its TTFT and TPOT (as :func:`requests_frame` defines them: computed by that very
function, a chunk at a time), and, for a request that completed
with a first token, the wall times of its send and its first token (what a rescheduling measurement
asks). Failed requests are kept whole (the timeline shows them); they are few on a cluster worth
judging, and a cluster that fails them all is judged long before memory matters.

About 64 bytes a request: a 10-hour run at 40 requests a second keeps about 92 MB.
"""

from __future__ import annotations

import math
from array import array
from typing import Iterable, Iterator, Sequence

import numpy as np
import pandas as pd

from harness.probes.client.analysis import requests_frame
from harness.probes.client.records import NOT_SENT, RequestRecord

CHUNK = 2000   # records per requests_frame call


class RecordDigest:
    """The timing columns of every record that passed through :meth:`observe` (see the module doc)."""

    def __init__(self) -> None:
        self.start_wall_ns = array("q")
        self.end_wall = array("d")             # wall seconds of the last byte; inf while unfinished
        self.sent = array("b")
        self.ok = array("b")
        self.ttft_ms = array("d")
        self.ttft_sched_ms = array("d")
        self.tpot_ms = array("d")
        self.success_sent_wall = array("d")    # sent and first token, wall seconds, of requests that
        self.success_first_wall = array("d")   # completed with a first token
        self.failed: list[RequestRecord] = []
        self._pending: list[RequestRecord] = []

    def __len__(self) -> int:
        return len(self.start_wall_ns)

    def observe(self, records: Iterable[RequestRecord]) -> Iterator[RequestRecord]:
        """Yield every record unchanged, noting its figures; the last chunk is noted when the
        stream ends."""
        for rec in records:
            self._pending.append(rec)
            if len(self._pending) >= CHUNK:
                self._flush()
            yield rec
        self._flush()

    def add(self, records: Iterable[RequestRecord]) -> RecordDigest:
        """Note ``records`` without passing them on."""
        for _ in self.observe(records):
            pass
        return self

    def _flush(self) -> None:
        chunk, self._pending = self._pending, []
        if not chunk:
            return
        df = requests_frame(chunk)
        self.start_wall_ns.extend(int(v) for v in df["start_wall_ns"])
        self.sent.extend(int(r.error_class != NOT_SENT) for r in chunk)
        self.end_wall.extend(r.anchor.perf_to_wall(r.end_ns) / 1e9 if r.end_ns else math.inf for r in chunk)
        self.ok.extend(int(bool(v)) for v in df["ok"])
        for name in ("ttft_ms", "ttft_sched_ms", "tpot_ms"):
            getattr(self, name).extend(float(v) for v in df[name])
        for rec in chunk:
            if rec.ok and rec.finish_reason != "error" and rec.first_token_ns is not None:
                anchor = rec.anchor
                self.success_sent_wall.append(anchor.perf_to_wall(rec.sent_ns) / 1e9)  # type: ignore[arg-type]
                self.success_first_wall.append(anchor.perf_to_wall(rec.first_token_ns) / 1e9)
            elif not rec.ok or rec.finish_reason == "error":
                self.failed.append(rec)

    def frame(self) -> pd.DataFrame:
        """The kept columns (``start_wall_ns``, ``ok``, ``ttft_ms``, ``tpot_ms``, ``ttft_sched_ms``)
        of the requests that were sent: enough for :func:`harness.probes.client.analysis.windowed_frame`."""
        sent = np.frombuffer(self.sent, dtype=np.int8).astype(bool) if len(self) else np.zeros(0, bool)
        return pd.DataFrame({
            "start_wall_ns": np.frombuffer(self.start_wall_ns, dtype=np.int64)[sent] if len(self) else [],
            "ok": np.frombuffer(self.ok, dtype=np.int8).astype(bool)[sent] if len(self) else [],
            **{name: np.frombuffer(getattr(self, name), dtype=np.float64)[sent] if len(self) else []
               for name in ("ttft_ms", "tpot_ms", "ttft_sched_ms")}})

    def client_samples(self, start_wall: float = -math.inf, end_wall: float = math.inf,
                       leave_out: Sequence[tuple[float, float]] = ()) -> tuple[int, list[float], list[float]]:
        """As :func:`harness.checks.slo.client_samples` over the requests whose send falls in
        [start_wall, end_wall): (requests sent, TTFT of each ok one, TPOT of each ok one with >= 2 tokens).
        ``leave_out``: wall-clock spans (VM steal bursts): a request in flight during one (scheduled
        send to last byte; to the end of time while unfinished) is left out, as
        :func:`harness.checks.slo.outside_bursts` leaves it out of 6.2 (:meth:`left_out` counts them)."""
        if not len(self):
            return 0, [], []
        t = np.frombuffer(self.start_wall_ns, dtype=np.int64) / 1e9
        chosen = self._sent_in(t, start_wall, end_wall) & ~self._in_bursts(t, leave_out)
        ok = chosen & (np.frombuffer(self.ok, dtype=np.int8) == 1)
        # in send order (records arrive as they finish), as LoadRunner.records gives them: the order
        # the verdicts' serial-dependence estimate reads (harness/stats/dependence.py)
        idx = np.flatnonzero(ok)
        idx = idx[np.argsort(t[idx], kind="stable")]
        ttft = np.frombuffer(self.ttft_sched_ms, dtype=np.float64)[idx]
        tpot = np.frombuffer(self.tpot_ms, dtype=np.float64)[idx]
        return int(chosen.sum()), ttft[~np.isnan(ttft)].tolist(), tpot[~np.isnan(tpot)].tolist()

    def left_out(self, leave_out: Sequence[tuple[float, float]], start_wall: float = -math.inf,
                 end_wall: float = math.inf) -> int:
        """How many of the requests sent in [start_wall, end_wall) :meth:`client_samples` leaves out
        for ``leave_out``."""
        if not len(self) or not leave_out:
            return 0
        t = np.frombuffer(self.start_wall_ns, dtype=np.int64) / 1e9
        return int((self._sent_in(t, start_wall, end_wall) & self._in_bursts(t, leave_out)).sum())

    def _sent_in(self, t: np.ndarray, start_wall: float, end_wall: float) -> np.ndarray:
        return (np.frombuffer(self.sent, dtype=np.int8) == 1) & (t >= start_wall) & (t < end_wall)

    def _in_bursts(self, t: np.ndarray, spans: Sequence[tuple[float, float]]) -> np.ndarray:
        """In flight (send ``t`` to last byte) during any of ``spans``."""
        inside = np.zeros(len(t), dtype=bool)
        end = np.frombuffer(self.end_wall, dtype=np.float64)
        for a, b in spans:
            inside |= (t <= b) & (end >= a)
        return inside

    def successes(self) -> Iterator[tuple[float, float]]:
        """(sent wall s, first-token wall s) of every request that completed with a first token."""
        return zip(self.success_sent_wall, self.success_first_wall)

    def nbytes(self) -> int:
        """What the columns hold (the failed records aside)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in (
            self.start_wall_ns, self.end_wall, self.sent, self.ok, self.ttft_ms, self.ttft_sched_ms, self.tpot_ms,
            self.success_sent_wall, self.success_first_wall))


__all__ = ["RecordDigest"]
