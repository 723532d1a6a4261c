"""One timeline of a run: fault activities, engine events and requests, in time order.

Each entry is a plain dict ``{"t_wall_ns", "t_s", "source", "kind", "detail"}``. Sources
on this host are ordered by their monotonic clock (immune to wall-clock steps) and placed
on the wall clock through one anchor read here; sources with only a wall time (a remote
host's events) keep it. ``clock="wall"`` orders everything by wall time instead.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

from harness.errors import ProbeError
from harness.probes.client.records import ClockAnchor, RequestRecord

log = logging.getLogger(__name__)

CLOCKS = ("monotonic", "wall")

# keys an engine event may carry its times under; values in ns (int) or seconds (float)
_WALL_KEYS = ("wall_ns", "t_wall_ns", "time_ns", "wall", "wall_time", "time", "ts", "timestamp")
_MONO_KEYS = ("mono_ns", "t_mono_ns", "monotonic_ns", "mono", "monotonic", "monotonic_time")
_KIND_KEYS = ("kind", "type", "event", "name")
_ID_KEYS = ("seq", "id", "event_id")  # an event's number in its source's log


def _to_ns(value: Any, key: str) -> int:
    # ``*_ns`` keys hold integer nanoseconds; the others seconds (time.time(), time.monotonic())
    if key.endswith("_ns"):
        return int(value)
    return int(round(float(value) * 1e9))


class _Clock:
    def __init__(self, clock: str, anchor: ClockAnchor | None) -> None:
        if clock not in CLOCKS:
            raise ProbeError(f"unknown timeline clock {clock!r}", fix=f"use one of {', '.join(CLOCKS)}")
        self.clock = clock
        self.anchor = anchor or ClockAnchor.now()

    def place(self, wall_ns: int | None, mono_ns: int | None) -> int:
        """Wall-clock position of an entry with these times."""
        if self.clock == "monotonic" and mono_ns is not None:
            return self.anchor.wall_ns + (mono_ns - self.anchor.mono_ns)
        if wall_ns is None:
            raise ProbeError("a timeline entry has neither a wall nor a monotonic time",
                             fix="events must carry wall-clock or monotonic timestamps")
        return wall_ns


def fault_entries(records: Iterable[Any], clock: _Clock) -> list[dict]:
    """Entries of fault activities (FaultRecord objects or their to_dict() form)."""
    out = []
    for rec in records:
        d = rec.to_dict() if hasattr(rec, "to_dict") else dict(rec)
        t = clock.place(_to_ns(d["started_wall"], "started_wall"), _to_ns(d["started_mono"], "started_mono"))
        action = getattr(d.get("action"), "value", d.get("action"))
        status = getattr(d.get("status"), "value", d.get("status"))
        out.append({"t_wall_ns": t, "source": "fault", "kind": f"fault_{action}",
                    "detail": {"fault_id": d.get("fault_id"), "fault": d.get("kind"), "target": d.get("target"),
                               "status": status, "duration_s": max(0.0, d.get("ended_mono", 0) - d["started_mono"]),
                               "error": d.get("error")}})
    return out


def event_id(ev: Mapping[str, Any], source: str = "engine") -> str | None:
    """Identity of an engine event: its number in the source's log and its wall time (a restarted
    router numbers from 1 again), or None for an event that carries no number."""
    key = next((k for k in _ID_KEYS if ev.get(k) is not None), None)
    if key is None:
        return None
    wall_key = next((k for k in _WALL_KEYS if ev.get(k) is not None), None)
    wall = _to_ns(ev[wall_key], wall_key) if wall_key else None
    return f"{source}:{ev[key]}@{wall}"


def event_entries(events: Iterable[Mapping[str, Any]], clock: _Clock, source: str = "engine",
                  seen: set[str] | None = None) -> list[dict]:
    """Entries of engine/router events (as /admin/events returns them), each once: an event whose
    :func:`event_id` is in ``seen`` (or came earlier in ``events``) is skipped, and the ids of the
    ones returned are added to ``seen``. The admin API returns the router's whole log on every
    call, so without this each suite would record again every event of the suites before it."""
    seen = set() if seen is None else seen
    out = []
    for ev in events:
        ident = event_id(ev, source)
        if ident is not None:
            if ident in seen:
                continue
            seen.add(ident)
        wall_key = next((k for k in _WALL_KEYS if ev.get(k) is not None), None)
        mono_key = next((k for k in _MONO_KEYS if ev.get(k) is not None), None)
        kind_key = next((k for k in _KIND_KEYS if ev.get(k) is not None), None)
        t = clock.place(_to_ns(ev[wall_key], wall_key) if wall_key else None,
                        _to_ns(ev[mono_key], mono_key) if mono_key else None)
        detail = {k: v for k, v in ev.items() if k not in (wall_key, mono_key, kind_key)}
        out.append({"t_wall_ns": t, "source": source, "kind": str(ev[kind_key]) if kind_key else "event",
                    "detail": detail, "event_id": ident})
    return out


def request_entries(records: Iterable[RequestRecord], clock: _Clock, *, failed_only: bool = False) -> list[dict]:
    """One entry per request at its scheduled send, with its outcome and latencies."""
    out = []
    for r in records:
        if failed_only and r.ok:
            continue
        start = r.scheduled_or_sent_ns
        t = clock.place(r.anchor.perf_to_wall(start), r.anchor.perf_to_mono(start))
        ttft = (r.first_token_ns - r.sent_ns) / 1e6 if r.first_token_ns is not None else None
        e2e = (r.end_ns - start) / 1e6 if r.end_ns is not None else None
        out.append({"t_wall_ns": t, "source": "request", "kind": f"request_{r.status}",
                    "detail": {"request_id": r.request_id, "response_id": r.response_id, "status": r.status,
                               "ttft_ms": ttft, "e2e_sched_ms": e2e, "tokens": r.num_output_tokens,
                               "served_by": list(r.served_by), "error_class": r.error_class,
                               "error": r.error_message}})
    return out


def merge_timeline(*, faults: Iterable[Any] = (), events: Iterable[Mapping[str, Any]] = (),
                   records: Iterable[RequestRecord] = (), failed_requests_only: bool = False,
                   clock: str = "monotonic", anchor: ClockAnchor | None = None,
                   t0_wall_ns: int | None = None, seen_events: set[str] | None = None) -> list[dict]:
    """Fault records, engine events and request records as one list sorted by time.

    ``t_s`` is seconds after ``t0_wall_ns`` (default: the first entry). Ties keep the order
    faults, engine events, requests: a fault is shown before the events it caused. Engine events
    appear once: pass the run's ``seen_events`` set to every call so a later suite does not record
    again the events an earlier one did (:func:`event_entries`)."""
    c = _Clock(clock, anchor)
    entries = fault_entries(faults, c) + event_entries(events, c, seen=seen_events) + \
        request_entries(records, c, failed_only=failed_requests_only)
    entries.sort(key=lambda e: e["t_wall_ns"])  # stable: ties keep the source order above
    if entries:
        t0 = entries[0]["t_wall_ns"] if t0_wall_ns is None else t0_wall_ns
        for e in entries:
            e["t_s"] = (e["t_wall_ns"] - t0) / 1e9
    return entries
