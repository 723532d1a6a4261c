"""A soak's kills and hangs on a cluster without router events, judged from the client's view
(6.1.4's black-box rule, harness/checks/reschedule_blackbox.py ``measure_client_view``) while the
run's records stream past once from disk (harness/scenarios/soak.py ``SoakRun.iter_records``).

``measure_client_view`` needs, per fault, the records that overlap its window (from the fault to the
next fault, at most ``window_s``): those in flight at the fault, those sent in the window, and the
chunk times of each across the window. :class:`ClientViewKeeper` keeps exactly those, slimmed: token
ids, text and prompt dropped, and only the chunk times that can bound a gap overlapping a window (each
chunk inside one, and its neighbours on either side; a gap between two dropped chunks lies outside every
window, so no stall a window sees changes). A record outside every window is not kept at all.

The window is shorter than 6.1.4's own 30 s (:data:`WINDOW_S`, 10 s): a fault judged against 3 s
needs no more (a new request not served within 10 s, or a stream on the victim ending later, fails it
either way: a stream's end is its record's, whatever the window), and what is kept grows with the time
the windows cover: at the default pace (a fault every 24 s) about 40 % of a run's records, each
without its tokens (measured in docs/soak.md). Not constant: a soak of many hours on an external
cluster holds these; the bundled cluster's soak (router events) keeps none.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from array import array
from typing import Iterable, Iterator, Sequence

from harness.checks.reschedule_blackbox import ClientRescheduleSample, measure_client_view
from harness.probes.client.records import NOT_SENT, RequestRecord
from harness.evidence.fault_marks import FaultMark, record_wall_s
from harness.evidence.records import ClientFault

WINDOW_S = 10.0   # a fault's client-view window in a soak: to the next fault, at most this long


def client_fault(mark: FaultMark) -> ClientFault:
    """The client-view fault of a soak fault's mark (its inject step's duration bounds its time)."""
    verb = "kill" if mark.kind == "process_kill" else "hang"
    return ClientFault(mark.wall, (mark.worker,), mark.role, f"{verb} {mark.worker}", inject_s=mark.inject_s)


class ClientViewKeeper:
    """Wrap the record stream with :meth:`observe`; after it ended, :meth:`samples` measures each fault."""

    def __init__(self, marks: Sequence[FaultMark], window_s: float = WINDOW_S) -> None:
        self.marks = sorted(marks, key=lambda m: m.wall)
        self.window_s = window_s
        walls = [m.wall for m in self.marks]
        # each fault's window as measure_client_view draws it: to the next fault, at most window_s
        self.windows = [(w, min(w + window_s, walls[i + 1] if i + 1 < len(walls) else math.inf))
                        for i, w in enumerate(walls)]
        self._starts = [a for a, _ in self.windows]
        self.kept: list[RequestRecord] = []
        self.chunks_dropped = 0

    def observe(self, records: Iterable[RequestRecord]) -> Iterator[RequestRecord]:
        """Yield every record unchanged, keeping a slim copy of each that overlaps a fault's window."""
        for rec in records:
            if self.windows and rec.error_class != NOT_SENT:
                slim = self._slim(rec)
                if slim is not None:
                    self.kept.append(slim)
            yield rec

    def samples(self) -> dict[str, ClientRescheduleSample]:
        """Fault id -> its client-view measurement."""
        if not self.marks:
            return {}
        measured = measure_client_view([client_fault(m) for m in self.marks], self.kept, window_s=self.window_s)
        return {m.fault_id: s for m, s in zip(self.marks, measured)}

    def _slim(self, rec: RequestRecord) -> RequestRecord | None:
        sent, end = record_wall_s(rec, rec.sent_ns), record_wall_s(rec, rec.end_ns)
        if sent is None:
            return None
        # windows are sorted and disjoint (each ends by the next fault): start at the one before the send
        j = max(0, bisect.bisect_right(self._starts, sent) - 1)
        spans = []
        while j < len(self.windows) and (end is None or self.windows[j][0] < end):
            if sent < self.windows[j][1]:
                spans.append(self.windows[j])
            j += 1
        if not spans:
            return None
        times = [record_wall_s(rec, t) or 0.0 for t in rec.chunk_ns]
        keep = [i for i, t in enumerate(times)
                if any(a <= t <= b
                       or (t < a and (i + 1 == len(times) or times[i + 1] >= a))      # the last chunk before
                       or (t > b and (i == 0 or times[i - 1] <= b)) for a, b in spans)]  # the first chunk after
        self.chunks_dropped += len(times) - len(keep)
        # arrays, not lists of ints: a 64-token record's chunk times take 0.5 KB instead of 2.5 KB
        return dataclasses.replace(rec, token_ids=[], text="", prompt="", error_message=rec.error_message,
                                   chunk_ns=array("q", (rec.chunk_ns[i] for i in keep)),    # type: ignore[arg-type]
                                   chunk_tokens=array("i", (rec.chunk_tokens[i] for i in keep)))  # type: ignore[arg-type]


__all__ = ["ClientViewKeeper", "WINDOW_S", "client_fault"]
