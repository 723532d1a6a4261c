"""Checklist item 6.1.2, "热迁移 TTFT 增量：空载下迁移增加 < 50ms，满载下 < 200ms".

What is measured, per live-migrated stream: the stall it saw at the switch (the gap between the
last token from the source worker and the first from the target) minus that stream's typical
inter-token gap. That excess is the delay the migration added, the "TTFT delta" of a stream whose
next token had to be produced by a new worker. The gap is taken where the router receives token
messages from the workers (the ``migration_resumed`` event: ``stall_s`` and ``typical_gap_s``, the
median of the stream's recent gaps): the hop from router to client is the same before and after a
migration, while a load generator starved of CPU reads SSE in bursts and would blur the gap. The
client's view of the same gap (found by token count, ``at_token``) is kept as evidence.

Judged separately for an idle cluster (one stream at a time) and under full load (Locust), on the
MEDIAN delta with its distribution-free 95 % interval from order statistics: from 6 migrations a
phase it has both bounds. A p95 would need 72 migrations a phase for both bounds (docs/statistics.md),
more than a CI run can spend; the observed p95 and maximum stay in the evidence beside an exact
(Clopper-Pearson) lower bound on the share of migrations within the limit.

Three outcomes are kept apart (:func:`assess`): a migration the engine refused or botched (the
migrated stream failed) counts against ``failed_migrations``; a migration the harness could not
measure (it could not catch the stream mid-decode, or no steady gap existed to compare with) is
*unmeasured*: shown beside ``failed_migrations``, never counted as the engine's failure; when too
few measured migrations remain the item is inconclusive, naming how many were unmeasured and why.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from harness.stats.intervals import percentile_interval, share_statement
from harness.checks.reschedule import nearest_rank
from harness.checklists import Checklist, Threshold
from harness.checks.verdict import Measurement, Verdict, judge
from harness.probes.client.records import RequestRecord
from harness.states import EventKind

if TYPE_CHECKING:
    from harness.evidence.migration import MigrationAttempt

ITEM = "6.1.2"
PHASES = ("idle", "loaded")


@dataclass
class MigrationSample:
    phase: str
    request_id: str
    source: str
    target: str
    stall_ms: float | None = None          # router: gap at the switch
    typical_gap_ms: float | None = None    # router: median of the stream's recent gaps before it
    excess_ms: float | None = None         # stall - typical gap: what the migration added
    client_stall_ms: float | None = None   # the same gap as the client saw it
    client_typical_gap_ms: float | None = None
    migration: dict[str, Any] | None = None  # the router's migration_done event (export/transfer/import)
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _client_gap(rec: RequestRecord, at_token: int) -> tuple[float, float] | str:
    """(stall ms, typical gap ms) around the chunk that starts at token ``at_token``."""
    starts, total = [], 0
    for n in rec.chunk_tokens:
        starts.append(total)
        total += n
    j = next((i for i, s in enumerate(starts) if s >= at_token), None)
    if j is None or j == 0:
        return f"the client saw no chunk starting at token {at_token} (it received {total} tokens)"
    gaps = [(rec.chunk_ns[i] - rec.chunk_ns[i - 1]) / 1e6 for i in range(1, len(rec.chunk_ns))]
    others = [g for i, g in enumerate(gaps, start=1) if i != j]
    if not others:
        return "too few chunks for a typical gap"
    return gaps[j - 1], statistics.median(others)


def measure(events: Iterable[dict[str, Any]], records: Iterable[RequestRecord],
            phase_of: dict[str, str]) -> list[MigrationSample]:
    """One sample per ``migration_resumed`` event whose request id ``phase_of`` names."""
    events = sorted(events, key=lambda e: e["seq"])
    by_id = {r.response_id: r for r in records if r.response_id}
    samples = []
    for i, e in enumerate(events):
        if e["type"] != EventKind.MIGRATION_RESUMED or e.get("request_id") not in phase_of:
            continue
        rid = e["request_id"]
        s = MigrationSample(phase_of[rid], rid, e["from_worker"], e["to_worker"])
        s.migration = next(({k: v for k, v in d.items() if k not in ("seq", "type", "request_id")}
                            for d in reversed(events[:i]) if d["type"] == EventKind.MIGRATION_DONE
                            and d.get("request_id") == rid), None)
        if e.get("typical_gap_s") is None:
            s.problem = "the stream had no steady inter-token gap before the switch"
        else:
            s.stall_ms, s.typical_gap_ms = round(1000 * e["stall_s"], 3), round(1000 * e["typical_gap_s"], 3)
            s.excess_ms = round(max(0.0, s.stall_ms - s.typical_gap_ms), 3)
        rec = by_id.get(rid)
        if rec is None:
            s.problem = s.problem or "no client record of this request"
        elif not rec.ok:
            s.problem = f"the request ended {rec.status}: {rec.error_message}"
        elif not isinstance(gap := _client_gap(rec, int(e.get("at_token", 0))), str):
            s.client_stall_ms, s.client_typical_gap_ms = round(gap[0], 3), round(gap[1], 3)
        samples.append(s)
    return samples


def _dist(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"n": len(values), "p50": nearest_rank(values, 50), "p95": nearest_rank(values, 95),
            "max": max(values), "min": min(values)}


def _share_within(values: Sequence[float], limit: Threshold) -> str | None:
    if not values:
        return None
    return share_statement(sum(limit.holds(v) for v in values), len(values), "migrations", f"added {limit.describe()}")


@dataclass
class Assessment:
    """Every migration attempt of a run, sorted into the three outcomes."""

    samples: list[MigrationSample] = field(default_factory=list)   # migrated and measured
    failures: list[str] = field(default_factory=list)              # refused or botched by the engine
    unmeasured: list[str] = field(default_factory=list)            # the harness could not measure it

    def measured(self, phase: str) -> int:
        return sum(s.phase == phase and s.excess_ms is not None for s in self.samples)


# MigrationSample.problem values that say the harness could not measure (the others: the engine failed)
_MEASUREMENT_PROBLEMS = ("the stream had no steady", "no client record")


def assess(attempts: Iterable["MigrationAttempt"], samples: Sequence[MigrationSample],
           records: Iterable[RequestRecord]) -> Assessment:
    """Sort attempts (harness/scenarios/migration.py) into measured, failed and unmeasured, using the
    samples :func:`measure` made from the router's events and the client records."""
    by_request = {s.request_id: s for s in samples}
    by_id = {r.response_id: r for r in records if r.response_id}
    out = Assessment()
    for a in attempts:
        label = f"{a.phase} stream {a.index}" + (f" ({a.request_id} on {a.source})" if a.request_id else "")
        if a.outcome == "refused":
            out.failures.append(f"{label}: migration refused or failed: {a.detail}")
        elif a.outcome == "unobservable":
            out.unmeasured.append(f"{label}: {a.detail}")
        elif (s := by_request.get(a.request_id or "")) is not None:
            if s.problem is None:
                out.samples.append(s)
            elif s.problem.startswith(_MEASUREMENT_PROBLEMS):
                out.unmeasured.append(f"{label}: migrated, not measurable: {s.problem}")
            else:
                out.failures.append(f"{label}: migrated, then {s.problem}")
        else:
            rec = by_id.get(a.request_id or "")
            if rec is not None and not rec.ok:
                out.failures.append(f"{label}: migrated, then the request ended {rec.status}: {rec.error_message}")
            else:
                out.unmeasured.append(f"{label}: migrated, but the router recorded no migration_resumed event "
                                      "(no token after the switch to time)")
    return out


def migration_verdict(samples: Sequence[MigrationSample] | Assessment, failures: Sequence[str] = (),
                      checklist: Checklist | None = None, unmeasured: Sequence[str] = ()) -> Verdict:
    """Judge item 6.1.2 from an :class:`Assessment` (or its parts: measured samples, engine
    failures, unmeasured attempts)."""
    if isinstance(samples, Assessment):
        samples, failures, unmeasured = samples.samples, samples.failures, samples.unmeasured
    assert checklist is not None
    item = checklist.item(ITEM)
    t = item.thresholds
    botched = [f"{s.phase} {s.request_id}: {s.problem}" for s in samples if s.problem is not None
               and not s.problem.startswith(_MEASUREMENT_PROBLEMS)]
    unmeasured = list(unmeasured) + [f"{s.phase} {s.request_id}: {s.problem}" for s in samples
                                     if s.problem is not None and s.problem.startswith(_MEASUREMENT_PROBLEMS)]
    failures = list(failures) + botched
    excess = {p: [s.excess_ms for s in samples if s.phase == p and s.excess_ms is not None] for p in PHASES}
    measurements = [
        Measurement(t[f"ttft_delta_{p}_ms"], nearest_rank(excess[p], 50) if excess[p] else None,
                    f"median hot-migration TTFT delta {where}", percentile_interval(excess[p], 50, noun="migrations"))
        for p, where in (("idle", "with no load"), ("loaded", "under full load"))] + [
        Measurement(t["failed_migrations"], len(failures),
                    f"migrations the engine refused or failed ({len(unmeasured)} more could not be measured and are "
                    "not counted)"),
    ]
    short = [f"{p}: {len(excess[p])} of {int(t[f'min_migrations_{p}'].value)}" for p in PHASES
             if len(excess[p]) < t[f"min_migrations_{p}"].value]
    evidence = {
        "definition": "per migrated stream, at the router: the gap between the last token from the source and the "
                      "first from the target, minus the stream's median recent inter-token gap (client view in "
                      "per_migration)",
        "distribution_ms": {p: _dist(excess[p]) for p in PHASES},
        "within_limit": {p: _share_within(excess[p], t[f"ttft_delta_{p}_ms"]) for p in PHASES},
        "stall_ms": {p: _dist([s.stall_ms for s in samples if s.phase == p and s.stall_ms is not None])
                     for p in PHASES},
        "samples": [{"label": f"{s.phase} {s.source}->{s.target}", "value": s.excess_ms,
                     "note": s.problem or f"stall {s.stall_ms} ms, typical gap {s.typical_gap_ms} ms, client stall "
                                          f"{s.client_stall_ms} ms"}
                    for s in samples],
        "per_migration": [s.to_dict() for s in samples],
        "failed_migrations": len(failures),
        "unmeasured_migrations": len(unmeasured),
    }
    if failures:
        evidence["failed"] = failures[:20]
    if unmeasured:
        evidence["unmeasured"] = unmeasured[:20]
    because = None
    if short:
        because = "too few migrations measured (" + ", ".join(short) + ")"
        if unmeasured:
            because += f"; {len(unmeasured)} attempt(s) could not be measured, first: {unmeasured[0]}"
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=because)
    if verdict.status.value == "fail" and failures:
        verdict.add("note", sep=" First failure: ", text=" ".join(failures[0].split()))
    elif unmeasured and verdict.status.value != "inconclusive":
        verdict.add("note", sep=" ", text=f"({len(unmeasured)} attempt(s) unmeasured, not counted as failures)")
    return verdict


__all__ = ["ITEM", "Assessment", "MigrationSample", "assess", "measure", "migration_verdict"]
