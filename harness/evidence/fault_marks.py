"""An injected process fault as the checks need it, and the readings of request records that the
scenarios and the checks both make.

A scenario records each injected fault as a :class:`FaultMark` (the inject step's start and length,
taken from the fault runner's own record by harness/scenarios/fault_marks.py's ``injection``); the
6.1.4 checks (harness/checks/reschedule.py, reschedule_blackbox.py) judge those marks against the
router's events and the request records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from harness.probes.client.records import RequestRecord


@dataclass(frozen=True)
class FaultMark:
    """One injected process fault as the reschedule check needs it."""

    fault_id: str
    kind: str     # "process_kill" or "process_hang"
    worker: str   # worker id as the router names it
    role: str     # "prefill" or "decode"
    wall: float   # time.time() when injection started
    inject_s: float = 0.0   # how long the inject step took: the fault took effect somewhere inside it


def affected_request_id(attempt_id: str) -> str:
    """The router lists attempts (``<request id>#<n>``); events name requests."""
    return attempt_id.rsplit("#", 1)[0]


def record_wall_s(rec: RequestRecord, perf_ns: int | None) -> float | None:
    """A perf-counter reading of ``rec`` (sent_ns, first_token_ns, ...) as wall time in seconds."""
    return None if perf_ns is None else rec.anchor.perf_to_wall(perf_ns) / 1e9


def first_success_sent_after(records: Iterable[RequestRecord], wall: float) -> float | None:
    """Wall time of the first token of the earliest request sent at or after ``wall`` that completed
    ok (new work served after a fault); None when there is none yet."""
    firsts = [record_wall_s(r, r.first_token_ns) for r in records
              if r.ok and r.finish_reason != "error" and r.first_token_ns is not None
              and (record_wall_s(r, r.sent_ns) or 0.0) >= wall]
    return min((f for f in firsts if f is not None), default=None)


__all__ = ["FaultMark", "affected_request_id", "first_success_sent_after", "record_wall_s"]
