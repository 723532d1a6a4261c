"""Checklist item 6.1.4: the global scheduler finishes rescheduling within 3 s of a worker kill.

Rescheduling time of one fault, from the moment the fault was injected (the start of the
inject step, so signal delivery is included), until all of these hold:

1. the router declared the worker down (``worker_down`` event);
2. every request the router listed as affected was re-placed on a live worker (``reschedule``
   event) -- an affected request that ended with ``reschedule_failed`` instead, or was never
   re-placed, makes the fault *not rescheduled*;
3. a new request succeeds: a request sent after the fault whose first token arrived and that
   completed ``ok`` (the time counted is its first token: from then on new work is served).

Events carry the router's wall clock; fault marks and request records carry the harness's.
On one machine (the bundled cluster) that is one clock; on a real cluster keep hosts in NTP.

Each time is known within its measurement resolution (harness/stats/intervals.py,
``measured_within``): the fault took effect somewhere inside its inject step (``inject_s``), and
each clock reading is good to EVENT_CLOCK_RESOLUTION_S. So p100 passes when every fault's upper
bound is within the budget and fails when any lower bound is beyond; the evidence adds an exact
(Clopper-Pearson) statement about the share of faults within the budget.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from harness.stats.intervals import RESOLUTION, Interval, across, measured_within, share_statement
from harness.stats import nearest_rank  # noqa: F401  (also imported from here by migration.py)
from harness.checklists import Checklist, ChecklistItem, Threshold
from harness.checks.verdict import Measurement, Verdict, judge
from harness.probes.client.records import RequestRecord
from harness.evidence.fault_marks import FaultMark, affected_request_id
from harness.states import EventKind, PD_ROLES

from harness.probes.workers.rejoin import POLL_S, not_observed

if TYPE_CHECKING:
    from harness.probes.workers.rejoin import Rejoin

ITEM = "6.1.4"
# one clock reading's error: wall time (1 us) read beside the perf counter that times the client's
# records (ClockAnchor: back to back, microseconds unless preempted) and its slew over a run
EVENT_CLOCK_RESOLUTION_S = 0.001


@dataclass
class RescheduleSample:
    fault: FaultMark
    detected_s: float | None = None          # worker_down after the fault
    affected: list[str] = field(default_factory=list)
    replaced_s: dict[str, float] = field(default_factory=dict)  # request id -> re-placed after the fault
    failed: list[str] = field(default_factory=list)             # affected requests that could not be re-placed
    first_success_s: float | None = None
    total_s: float | None = None             # None: rescheduling never completed
    problem: str | None = None

    @property
    def label(self) -> str:
        verb = "kill" if self.fault.kind == "process_kill" else "hang"
        return f"{verb} {self.fault.worker}"

    @property
    def breakdown(self) -> str:
        """Where the time went, e.g. "down +0.15 s, 2 re-placed by +0.16 s, new request +0.11 s"."""
        if self.detected_s is None:
            return self.problem or ""
        parts = [f"down +{self.detected_s:.2f} s"]
        if self.affected:
            last = max(self.replaced_s.values(), default=None)
            parts.append(f"{len(self.replaced_s)}/{len(self.affected)} re-placed"
                         + (f" by +{last:.2f} s" if last is not None else ""))
        parts.append("no new request succeeded" if self.first_success_s is None
                     else f"new request +{self.first_success_s:.2f} s")
        return ", ".join(parts)

    @property
    def interval(self) -> Interval | None:
        """Where the true rescheduling time lies, given the inject step and the clocks' resolution."""
        if self.total_s is None:
            return None
        return measured_within(self.total_s, below=self.fault.inject_s + EVENT_CLOCK_RESOLUTION_S,
                               above=EVENT_CLOCK_RESOLUTION_S, noun="faults")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        d["breakdown"] = self.breakdown
        d["interval"] = None if self.interval is None else self.interval.to_dict()
        return d


def measure(faults: Sequence[FaultMark], events: Iterable[dict[str, Any]],
            records: Iterable[RequestRecord]) -> list[RescheduleSample]:
    """One sample per fault, from router events and request records (see the module doc)."""
    return measure_with(faults, events, FirstSuccess(_sent_and_first_token_wall(r) for r in records if succeeded(r)))


def measure_with(faults: Sequence[FaultMark], events: Iterable[dict[str, Any]],
                 first_success: FirstSuccess) -> list[RescheduleSample]:
    """:func:`measure` given the successes already gathered (a soak gathers them while it streams
    its records from disk rather than holding every record)."""
    events = sorted(events, key=lambda e: e["wall_time"])
    ordered = sorted(faults, key=lambda f: f.wall)
    samples = []
    for i, fault in enumerate(ordered):
        # events of the next fault on the same worker belong to that fault, not this one
        until = next((f.wall for f in ordered[i + 1:] if f.worker == fault.worker), math.inf)
        samples.append(_measure_one(fault, [e for e in events if fault.wall <= e["wall_time"] < until],
                                    first_success))
    return samples


def succeeded(rec: RequestRecord) -> bool:
    """A request that completed with a first token: what proves the cluster serves again."""
    return rec.ok and rec.finish_reason != "error" and rec.first_token_ns is not None


class FirstSuccess:
    """The earliest first token of a request sent at or after a given wall time, over (sent wall,
    first-token wall) pairs: sorted once, a suffix minimum and a binary search per question, in
    two float arrays (16 bytes a request however long the run)."""

    def __init__(self, pairs: Iterable[tuple[float, float]]) -> None:
        data = np.fromiter((x for pair in pairs for x in pair), dtype=np.float64).reshape(-1, 2)
        data = data[np.argsort(data[:, 0], kind="stable")]
        self._sent = data[:, 0]
        self._suffix_min = np.minimum.accumulate(data[::-1, 1])[::-1] if len(data) else data[:, 1]

    def __len__(self) -> int:
        return len(self._sent)

    def after(self, wall: float) -> float | None:
        i = int(np.searchsorted(self._sent, wall, side="left"))
        return None if i >= len(self._sent) else float(self._suffix_min[i])


def _measure_one(fault: FaultMark, events: list[dict[str, Any]], first_success: FirstSuccess) -> RescheduleSample:
    s = RescheduleSample(fault)
    down = next((e for e in events if e["type"] == EventKind.WORKER_DOWN and e.get("worker") == fault.worker), None)
    if down is None:
        s.problem = f"the router never declared {fault.worker} down"
        return s
    s.detected_s = down["wall_time"] - fault.wall
    s.affected = sorted({affected_request_id(a) for a in down.get("affected", [])})
    for e in events:
        rid = e.get("request_id")
        if rid not in s.affected or e["wall_time"] < down["wall_time"]:
            continue
        if e["type"] == EventKind.RESCHEDULE and rid not in s.replaced_s:
            s.replaced_s[rid] = e["wall_time"] - fault.wall
        elif e["type"] == EventKind.RESCHEDULE_FAILED and rid not in s.replaced_s and rid not in s.failed:
            s.failed.append(rid)
    first_new = first_success.after(fault.wall)
    s.first_success_s = None if first_new is None else first_new - fault.wall
    missing = [r for r in s.affected if r not in s.replaced_s and r not in s.failed]
    if s.failed or missing:
        s.problem = (f"{len(s.failed)} affected request(s) could not be re-placed, {len(missing)} never were "
                     f"(of {len(s.affected)})")
    elif s.first_success_s is None:
        s.problem = "no request sent after the fault succeeded"
    else:
        s.total_s = max([s.detected_s, s.first_success_s, *s.replaced_s.values()])
    return s


def _sent_and_first_token_wall(rec: RequestRecord) -> tuple[float, float]:
    anchor = rec.anchor
    return anchor.perf_to_wall(rec.sent_ns) / 1e9, anchor.perf_to_wall(rec.first_token_ns) / 1e9  # type: ignore[arg-type]


def time_measurements(item: ChecklistItem, times: Sequence[float | None], what: str,
                      intervals: Sequence[Interval | None] | None = None) -> list[Measurement]:
    """p100 and p95 of the completed times (None: rescheduling never completed) against ``item``'s
    ``reschedule_p100_s`` and ``reschedule_p95_s``, and how many faults never completed.
    ``intervals``: each time's resolution bounds (None entries for the faults that never completed);
    the percentiles then carry the bounds of the same percentile over the lower and the upper bounds."""
    done = [v for v in times if v is not None]
    bounds = [i for i in intervals or () if i is not None]

    def bounded(q: float) -> Interval | None:
        return across(bounds, q, noun="faults") if bounds else None

    return [
        Measurement(item.thresholds["reschedule_p100_s"], nearest_rank(done, 100) if done else None,
                    f"p100 {what} over {len(done)} fault(s)", bounded(100)),
        Measurement(item.thresholds["reschedule_p95_s"], nearest_rank(done, 95) if done else None,
                    f"p95 {what} over {len(done)} fault(s)", bounded(95)),
        Measurement(item.thresholds["faults_not_rescheduled"], len(times) - len(done),
                    f"faults whose rescheduling never completed (of {len(times)})"),
    ]


def share_within(budget: Threshold, intervals: Sequence[Interval | None]) -> str | None:
    """The exact statement about the share of faults whose upper bound is within ``budget``."""
    if not intervals:
        return None
    ok = sum(i is not None and i.hi is not None and budget.holds(i.hi) for i in intervals)
    return share_statement(ok, len(intervals), "faults", f"rescheduled {budget.describe()} (upper bounds)")


def rejoin_interval(rejoin: Rejoin) -> Interval | None:
    """Where the time a healthy worker was kept out lies, at the watch's resolution: taken back,
    it came after the poll before the one that saw it (``resolution_s``, the time the watch
    measured since that poll; else one ``POLL_S``), so the true time is up to that much shorter;
    still out when the watch ended, at least as long as it watched (no upper bound). None: not
    observable. The same rule as the black-box check's (harness/checks/reschedule_blackbox.py)."""
    kept = rejoin.kept_out_s
    if kept is None:
        return None
    if not rejoin.back:
        return Interval(max(0.0, kept - EVENT_CLOCK_RESOLUTION_S), None, 1.0, RESOLUTION, 1, noun="rejoins")
    late = getattr(rejoin, "resolution_s", None)
    late = POLL_S if late is None else late
    return measured_within(kept, below=min(kept, late + EVENT_CLOCK_RESOLUTION_S), above=EVENT_CLOCK_RESOLUTION_S,
                           noun="rejoins")


def rejoin_measurement(item: ChecklistItem, rejoins: Sequence[Rejoin]) -> Measurement | None:
    """The longest time the cluster kept a healthy worker out after its revert, against
    ``rejoin_limit_s`` (recovery is part of 6.1.4), with the watch's resolution
    (:func:`rejoin_interval`; the longest of several: [largest lower bound, largest upper bound],
    unbounded above when any is);
    None when no rejoin could be observed (each entry of the evidence says why)."""
    seen = [r for r in rejoins if r.kept_out_s is not None]
    if not seen:
        return None
    worst = max(seen, key=lambda r: r.kept_out_s or 0.0)
    bounds = [rejoin_interval(r) for r in seen]
    his = [b.hi for b in bounds if b is not None]
    interval = Interval(max(b.lo for b in bounds if b is not None and b.lo is not None),
                        None if len(his) < len(bounds) or None in his else max(his),  # type: ignore[type-var]
                        1.0, RESOLUTION, len(seen), noun="rejoins")
    return Measurement(item.thresholds["rejoin_limit_s"], worst.kept_out_s,
                       f"longest time a healthy worker was kept out of the cluster's traffic, over {len(seen)} "
                       f"restart(s) or resume(s) ({worst.sentence()})", interval)


def reschedule_verdict(samples: Sequence[RescheduleSample], checklist: Checklist, *, rejoins: Sequence[Rejoin] = (),
                       not_judged: Mapping[str, str] | None = None, stopped: str | None = None) -> Verdict:
    """``rejoins``: how each faulted worker came back after its revert (a worker kept out past
    ``rejoin_limit_s`` fails the item); ``not_judged``: roles with no survivor, never faulted (a pass
    cannot cover them); ``stopped``: why the plan ended early (a pass cannot rest on it)."""
    item = checklist.item(ITEM)
    incomplete = [s for s in samples if s.total_s is None]
    measurements = time_measurements(item, [s.total_s for s in samples], "rescheduling time",
                                     [s.interval for s in samples])
    if (rejoin := rejoin_measurement(item, rejoins)) is not None:
        measurements.append(rejoin)
    need = int(item.thresholds["min_faults_per_kind"].value)
    groups: dict[str, int] = {}
    for s in samples:
        key = f"{s.label.split()[0]} {s.fault.role}"
        groups[key] = groups.get(key, 0) + 1
    # the minimum applies to every kind: kills of both roles, and hangs of every role hung
    short = {k: c for k, c in groups.items() if c < need}
    for role in PD_ROLES:
        if f"kill {role}" not in groups:
            short[f"kill {role}"] = 0
    why = [stopped] if stopped else []
    if short:
        why.append("too few faults for a distribution: " + ", ".join(f"{k} x{c}" for k, c in sorted(short.items()))
                   + f" (need {need} of each kind per role)")
    why.extend(f"not judged: {reason}" for reason in (not_judged or {}).values())
    why += [x for x in (not_observed(rejoins),) if x]   # a worker never seen back: never a pass by health alone
    thin = "; ".join(why) or None
    evidence = {
        "samples": [{"label": s.label, "value": None if s.total_s is None else round(s.total_s, 4),
                     "note": s.breakdown} for s in samples],
        "faults_per_kind": groups,
        "within_budget": share_within(item.thresholds["reschedule_p100_s"], [s.interval for s in samples]),
        "resolution": {"event_clock_s": EVENT_CLOCK_RESOLUTION_S,
                       "inject_step_s": {s.label: round(s.fault.inject_s, 4) for s in samples}},
        "per_fault": [s.to_dict() for s in samples],
        "definition": "time from fault injection until the worker is declared down, every affected request is "
                      "re-placed and a request sent after the fault has its first token (and completes ok)",
    }
    if incomplete:
        evidence["not_rescheduled"] = [f"{s.label}: {s.problem}" for s in incomplete]
    if rejoins:
        evidence["rejoin"] = [r.to_dict() for r in rejoins]
    evidence.update({k: v for k, v in (("not_judged", not_judged), ("stopped", stopped)) if v})
    return judge(item, measurements, evidence=evidence, inconclusive_because=thin)
