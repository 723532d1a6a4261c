"""Checklist item 6.1.4 from the client's view: the same measurement on any engine, needing only
the client's request records (every chunk's arrival, status, error, the workers named by the
stream when the engine names any), the fault's time and the victim worker(s).

Rescheduling time of one fault = from the fault until BOTH

(a) a request SENT after the fault succeeded (its first token counts: from then on new work is
    served; it must also complete ok), and
(b) every stream that was in flight on the victim at the fault has ended: resumed and completed,
    or failed with a clear error from the server.

Which streams were "on the victim": streams whose chunks named it (``served_by``), and streams
still waiting for their first token at the fault (the victim may have held them in prefill, or
been chosen to decode them; the client cannot tell). An engine that names no worker in its stream
makes every in-flight stream count. Counting too many only makes the time longer, never shorter.

A hang is judged by the stall clients see: the **stall watchdog** is the longest gap between
consecutive events (send, each chunk, end) of any stream in flight across the fault window. A
stream that ended without a final state, or was cut with no error from the server, is a
nothing-lost failure and is named.

A worker the harness restarted or resumed must also be taken back: the longest time the cluster
kept a healthy worker out of its traffic (harness/probes/workers/rejoin.py) is judged against the item's
``rejoin_limit_s``; the one-line reason names it ("vllm-router kept vllm-1 out for 104 s after it
was healthy") whether or not it is the headline.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from harness.checks.invariants import failed_with_clear_error
from harness.stats.intervals import RESOLUTION, Interval, across, measured_within
from harness.checks.reschedule import EVENT_CLOCK_RESOLUTION_S, ITEM, time_measurements
from harness.stats import DEFINITION, nearest_rank
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Verdict, judge
from harness.probes.client.records import NOT_SENT, RequestRecord
from harness.probes.workers.rejoin import POLL_S, Rejoin, not_observed
from harness.evidence.records import ClientFault
from harness.evidence.fault_marks import first_success_sent_after, record_wall_s as _wall

DEFAULT_WINDOW_S = 30.0   # a fault's window ends at the next fault, or this long after it


@dataclass
class ClientRescheduleSample:
    fault: ClientFault
    affected: list[str] = field(default_factory=list)          # request ids in flight on the victim
    completed: list[str] = field(default_factory=list)         # affected, resumed and completed ok
    failed_clearly: list[str] = field(default_factory=list)    # affected, failed with the server's error
    cut_without_error: list[str] = field(default_factory=list) # nothing-lost failures
    never_ended: list[str] = field(default_factory=list)       # timed out / cancelled / no end
    first_new_success_s: float | None = None
    first_new_request: str | None = None   # its request id ("newreq-...": the scenario's open-loop probe)
    affected_ended_s: float | None = None     # when the last affected stream ended, after the fault
    longest_stall_s: float = 0.0
    stall_request: str | None = None
    total_s: float | None = None
    problem: str | None = None

    @property
    def interval(self) -> Interval | None:
        """The time's resolution bounds (as item 6.1.4's router-event view, harness/checks/reschedule.py):
        the fault took effect inside its inject step; client timestamps are good to the clock's resolution."""
        if self.total_s is None:
            return None
        return measured_within(self.total_s, below=self.fault.inject_s + EVENT_CLOCK_RESOLUTION_S,
                               above=EVENT_CLOCK_RESOLUTION_S, noun="faults")

    @property
    def breakdown(self) -> str:
        parts = [f"{len(self.affected)} stream(s) on the victim"]
        if self.affected:
            parts.append(f"{len(self.completed)} completed, {len(self.failed_clearly)} failed clearly"
                         + (f", all ended by +{self.affected_ended_s:.2f} s" if self.affected_ended_s is not None
                            and not self.never_ended and not self.cut_without_error else ""))
        parts.append("no new request succeeded" if self.first_new_success_s is None
                     else f"new request +{self.first_new_success_s:.2f} s")
        parts.append(f"longest stall {self.longest_stall_s:.2f} s"
                     + (f" ({self.stall_request})" if self.stall_request else ""))
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["breakdown"] = self.breakdown
        return d


def client_faults(marks: Iterable[Any]) -> list[ClientFault]:
    """ClientFaults of the engine-event measurement's FaultMarks (harness.checks.reschedule)."""
    return [ClientFault(m.wall, (m.worker,), m.role, f"{'kill' if m.kind == 'process_kill' else 'hang'} {m.worker}")
            for m in marks]


def _in_flight_at(rec: RequestRecord, t: float) -> bool:
    sent, end = _wall(rec, rec.sent_ns), _wall(rec, rec.end_ns)
    return sent is not None and sent < t and (end is None or end > t)


def _on_victim(rec: RequestRecord, fault: ClientFault) -> bool:
    if not rec.served_by:
        return True  # the engine names no worker: the client cannot rule the stream out
    if any(v in rec.served_by for v in fault.victims):
        return True
    first = _wall(rec, rec.first_token_ns)
    return first is None or first > fault.wall  # not streaming yet: it may have been placed on the victim


def longest_stall(rec: RequestRecord, start: float, end: float) -> float:
    """The longest gap between consecutive events (send, chunks, end) of ``rec`` that overlaps
    [start, end], counted up to ``end``: a stall that the next fault began belongs to that fault,
    not to this one (a hang's 8 s stall, starting a few ms after a kill's last chunk, was once
    counted as the kill's). A stream with no end stalls until ``end``."""
    times = [_wall(rec, rec.sent_ns)] + [_wall(rec, t) for t in rec.chunk_ns]
    last = _wall(rec, rec.end_ns)
    times.append(end if last is None else last)
    worst = 0.0
    for a, b in zip(times, times[1:]):
        if a is not None and b is not None and b > start and a < end:
            worst = max(worst, min(b, end) - a)
    return worst


def measure_client_view(faults: Sequence[ClientFault], records: Iterable[RequestRecord], *,
                        window_s: float = DEFAULT_WINDOW_S) -> list[ClientRescheduleSample]:
    """One sample per fault (see the module doc); a fault's window ends at the next fault."""
    records = [r for r in records if r.error_class != NOT_SENT]
    ordered = sorted(faults, key=lambda f: f.wall)
    out = []
    for i, fault in enumerate(ordered):
        until = min(fault.wall + window_s, ordered[i + 1].wall if i + 1 < len(ordered) else math.inf)
        out.append(_measure_one(fault, records, until))
    return out


BASELINE_SHARE = 0.5  # outside the faults, clients' longest gap under this share of the limit: the machine is fine


def same_run_baseline(faults: Sequence[ClientFault], records: Iterable[RequestRecord], limit_s: float, *,
                      window_s: float = DEFAULT_WINDOW_S) -> dict[str, Any] | None:
    """The longest gap any stream saw *outside* every fault's window, in the same run on the same
    machine: what the machine's own slowness does to a stream. Far inside the limit, a stall beyond
    it during a fault is the fault's (harness/checks/machine.py keeps such a fail standing)."""
    spans = [(f.wall, f.wall + window_s) for f in faults]
    worst, rid = None, None
    for rec in records:
        if rec.error_class == NOT_SENT:
            continue
        times = [t for t in [_wall(rec, rec.sent_ns)] + [_wall(rec, t) for t in rec.chunk_ns] + [_wall(rec, rec.end_ns)]
                 if t is not None]
        for a, b in zip(times, times[1:]):
            if not any(a < hi and b > lo for lo, hi in spans) and (worst is None or b - a > worst):
                worst, rid = b - a, rec.request_id
    if worst is None:
        return None
    explains = worst >= BASELINE_SHARE * limit_s
    return {"what": "longest gap a stream saw outside every fault window (same run)", "value_s": round(worst, 4),
            "request": rid, "explains_failure": explains,
            "sentence": (f"outside the faults, in the same run, clients' longest gap was {worst:.2f} s "
                         f"({'not ' if explains else ''}far inside the {limit_s:g} s limit)")}


def _measure_one(fault: ClientFault, records: list[RequestRecord], until: float) -> ClientRescheduleSample:
    s = ClientRescheduleSample(fault)
    for rec in records:  # the watchdog: every stream open at any time in the window, old or new
        sent, end = _wall(rec, rec.sent_ns), _wall(rec, rec.end_ns)
        if sent is not None and sent < until and (end is None or end > fault.wall):
            stall = longest_stall(rec, fault.wall, until)
            if stall > s.longest_stall_s:
                s.longest_stall_s, s.stall_request = stall, rec.request_id
    ends: list[float] = []
    for rec in (r for r in records if _in_flight_at(r, fault.wall)):
        if not _on_victim(rec, fault):
            continue
        s.affected.append(rec.request_id)
        end = _wall(rec, rec.end_ns)
        if rec.status in ("timeout", "cancelled") or end is None:
            s.never_ended.append(rec.request_id)
            continue
        ends.append(end - fault.wall)
        if rec.ok and rec.finish_reason != "error":
            s.completed.append(rec.request_id)
        elif failed_with_clear_error(rec):
            s.failed_clearly.append(rec.request_id)
        else:
            s.cut_without_error.append(rec.request_id)
    s.affected_ended_s = max(ends, default=0.0 if not s.affected else None)
    first = first_success_sent_after(records, fault.wall)
    s.first_new_success_s = None if first is None else first - fault.wall
    s.first_new_request = next((r.request_id for r in records if first is not None and r.first_token_ns is not None
                                and _wall(r, r.first_token_ns) == first), None)
    if s.never_ended or s.cut_without_error:
        s.problem = (f"{len(s.never_ended)} stream(s) on the victim never ended, {len(s.cut_without_error)} were cut "
                     f"without an error from the server: " + ", ".join((s.never_ended + s.cut_without_error)[:10]))
    elif s.first_new_success_s is None:
        s.problem = "no request sent after the fault succeeded"
    else:
        s.total_s = max(s.first_new_success_s, s.affected_ended_s or 0.0)
    return s


def client_view_evidence(samples: Sequence[ClientRescheduleSample]) -> dict[str, Any]:
    """The client-view distribution for a verdict's evidence: nearest-rank p50/p95/p100 of the
    rescheduling times and of the stalls, each fault's breakdown, and every stream lost."""
    done = [s.total_s for s in samples if s.total_s is not None]
    stalls = [s.longest_stall_s for s in samples]

    def dist(values: list[float]) -> dict[str, Any]:
        if not values:
            return {"n": 0}
        return {"n": len(values), **{f"p{q}": round(nearest_rank(values, q), 4) for q in (50, 95, 100)}}

    return {
        "definition": "from the fault until a request sent after it has its first token (and completes ok) and "
                      "every stream in flight on the victim has ended (completed, or failed with a clear error); "
                      "stall: the longest gap between consecutive events of any stream in flight across the fault; "
                      "new requests: the load's and, where the scenario runs it, an open-loop probe's (one short "
                      "request every 0.15 s from the fault on, ids newreq-..., never queued behind the load's "
                      "blocked users)",
        "percentile": DEFINITION,
        "reschedule_s": dist(done),
        "longest_stall_s": dist(stalls),
        "not_rescheduled": [f"{s.fault.label}: {s.problem}" for s in samples if s.total_s is None],
        "cut_without_error": sorted({r for s in samples for r in s.cut_without_error}),
        "samples": [{"label": s.fault.label, "value": None if s.total_s is None else round(s.total_s, 4),
                     "note": s.breakdown, "wall": s.fault.wall, "role": s.fault.role,
                     "new_request_s": None if s.first_new_success_s is None else round(s.first_new_success_s, 4),
                     "new_request": s.first_new_request,
                     "longest_stall_s": round(s.longest_stall_s, 4)} for s in samples],
    }


def client_view_verdict(samples: Sequence[ClientRescheduleSample], checklist: Checklist, *,
                        rejoins: Sequence[tuple[str, Rejoin]] = (), roles: Sequence[str] | None = None,
                        not_judged: Mapping[str, str] | None = None, stopped: str | None = None) -> Verdict:
    """6.1.4 judged from the client's view alone (a cluster without router events): the
    rescheduling times and the longest stall against the item's 3 s, every fault completed, and
    each restarted or resumed worker taken back by the cluster within ``rejoin_limit_s`` (a rejoin
    that could not be observed keeps it from passing).

    Too little evidence never passes: fewer than ``min_faults_per_kind`` kills or hangs of a judged
    role (``roles``, default: those faulted), a plan that stopped early (``stopped``), or no role
    with a survivor (``not_judged``: role -> why) make it inconclusive unless a measurement fails."""
    item = checklist.item(ITEM)
    stalls = [s.longest_stall_s for s in samples]
    measurements = time_measurements(item, [s.total_s for s in samples], "client-view rescheduling time",
                                     intervals=[s.interval for s in samples])
    stall_bounds = [measured_within(v, below=EVENT_CLOCK_RESOLUTION_S, above=EVENT_CLOCK_RESOLUTION_S, noun="faults")
                    for v in stalls]
    measurements.insert(2, Measurement(item.thresholds["reschedule_p100_s"], max(stalls) if stalls else None,
                                       "longest stall a client saw across a fault",
                                       across(stall_bounds, 100, noun="faults") if stall_bounds else None))
    rejoin = rejoin_measurement(item, [r for _, r in rejoins])
    if rejoin is not None:
        measurements.append(rejoin)
    thin = _too_thin(samples, int(item.thresholds["min_faults_per_kind"].value), roles, not_judged or {}, stopped)
    thin = "; ".join(x for x in (thin, not_observed(rejoins)) if x) or None   # never back by health alone
    evidence = client_view_evidence(samples)
    evidence["rejoin"] = [{"fault": label, **r.to_dict()} for label, r in rejoins]
    for sample, (label, r) in zip(evidence["samples"], rejoins):  # both in injection order
        if sample["label"] == label:
            sample["note"] += f"; {r.sentence()}"
    evidence["rejoin_definition"] = REJOIN_DEFINITION
    if not_judged:
        evidence["not_judged"] = dict(not_judged)
    if stopped:
        evidence["stopped"] = stopped
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=thin)
    # the one line names the worst fault, every way the cluster was not whole, every role left unjudged
    extra = []
    slowest = max((s for s in samples if s.total_s is not None), key=lambda s: s.total_s or 0.0, default=None)
    budget = item.thresholds["reschedule_p100_s"]
    if verdict.status.value == "fail" and slowest is not None and slowest.total_s > budget.value:
        extra.append(f"worst: {slowest.fault.label} ({slowest.breakdown})")
    worst = _worst(rejoins)
    if rejoin is not None and worst is not None and not rejoin.threshold.holds(rejoin.value) \
            and worst.sentence() not in verdict.reason:
        extra.append(f"also: {worst.sentence()}")
    if not_judged and samples and verdict.status.value == "fail":
        extra.append("not judged: " + "; ".join(not_judged.values()))
    if extra:
        verdict.add("note", text="; ".join(extra), strip=True)
    return verdict


REJOIN_DEFINITION = ("a restarted or resumed worker is back when it serves: from its health URL answering 200 until "
                     "a request sent after the revert got a token from it (the watch's own request sent straight to "
                     "its API; a restarted process: a rise of its own counters) and then the cluster's traffic reached "
                     "it (a counter of new work on its own metrics or in the router's view of it, read from that "
                     "moment on; the router's circuit breaker closed where exported), never a counter that work "
                     "queued during the fault can move; a resumed worker with no API of its own, or a worker with "
                     "nothing to read, is not observed (never back by health alone): the item cannot pass, its "
                     "entry says why; judged with the watch's poll period as the measurement's resolution")


def rejoin_interval(r: Rejoin) -> Interval | None:
    """Where the time ``r`` kept a healthy worker out lies, from the watch's resolution: taken back,
    the rise happened after the previous poll began (``resolution_s``, else one ``POLL_S``), so the
    true time is up to that much shorter; still out when the watch gave up, at least ``watched_s``
    (no upper bound). None when it cannot be observed."""
    value = r.kept_out_s
    if value is None:
        return None
    if not r.back:
        return Interval(max(0.0, value - EVENT_CLOCK_RESOLUTION_S), None, 1.0, RESOLUTION, 1, noun="rejoins")
    late = r.resolution_s if r.resolution_s is not None else POLL_S
    return measured_within(value, below=min(value, late + EVENT_CLOCK_RESOLUTION_S), above=EVENT_CLOCK_RESOLUTION_S,
                           noun="rejoins")


def rejoin_measurement(item: Any, rejoins: Sequence[Rejoin]) -> Measurement | None:
    """The longest time the cluster kept a healthy worker out after its revert, against
    ``rejoin_limit_s``, with the watch's resolution (:func:`rejoin_interval`): judged by ``judge()``,
    it fails only when the whole interval is beyond the limit, passes only when all of it holds.
    None when no rejoin could be observed (each entry of the evidence says why)."""
    seen = [(r, i) for r in rejoins if (i := rejoin_interval(r)) is not None]
    if not seen:
        return None
    worst, _ = max(seen, key=lambda x: x[0].kept_out_s or 0.0)
    los = [i.lo for _, i in seen if i.lo is not None]
    his = [i.hi for _, i in seen]
    bound = Interval(max(los) if los else None, None if any(h is None for h in his) else max(his),  # type: ignore[type-var]
                     1.0, RESOLUTION, len(seen), noun="rejoins")
    return Measurement(item.thresholds["rejoin_limit_s"], worst.kept_out_s,
                       f"longest time a healthy worker was kept out of the cluster's traffic, over {len(seen)} "
                       f"restart(s) or resume(s) ({worst.sentence()})", bound)


def _worst(rejoins: Sequence[tuple[str, Rejoin]]) -> Rejoin | None:
    seen = [r for _, r in rejoins if r.kept_out_s is not None]
    return max(seen, key=lambda r: r.kept_out_s or 0.0, default=None)


def _too_thin(samples: Sequence[ClientRescheduleSample], need: int, roles: Sequence[str] | None,
              not_judged: Mapping[str, str], stopped: str | None) -> str | None:
    """Why the evidence cannot support a pass, or None."""
    if not samples:
        return "; ".join(not_judged.values()) if not_judged else "no fault was injected"
    counts: dict[str, int] = {}
    for s in samples:
        key = f"{s.fault.label.split()[0]} {s.fault.role}"
        counts[key] = counts.get(key, 0) + 1
    judged = list(roles) if roles is not None else list(dict.fromkeys(str(s.fault.role) for s in samples))
    short = [f"{kind} {role} x{counts.get(f'{kind} {role}', 0)}" for role in judged for kind in ("kill", "hang")
             if counts.get(f"{kind} {role}", 0) < need]
    why = []
    if stopped:
        why.append(stopped)
    if short:
        why.append(f"too few faults for a distribution: {', '.join(short)} (need {need} of each kind per role)")
    # a pass must cover every role: one with no survivor was never faulted (a fail elsewhere still fails)
    why.extend(f"not judged: {reason}" for reason in not_judged.values())
    return "; ".join(why) or None
