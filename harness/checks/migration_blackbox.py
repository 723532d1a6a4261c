"""Item 6.1.2 on an engine that migrates a stream when its worker is lost, judged from the client.

NVIDIA Dynamo's request migration (``--migration-limit``) replays a stream's prompt and the tokens
it produced so far on another worker when its worker dies; the bundled engine's rescheduling does
the same. Such an engine has no "migrate this stream now" API, so the suite kills a worker of the
cluster file's inventory while streams decode on it (harness/scenarios/migration_on_loss.py) and
measures, per stream that crossed the migration, what the client saw:

* **the stall at the crossing**: the stream's longest gap between chunks at or after the kill
  (chunks the victim made just before it died may still arrive after the kill's instant);
* **minus the stream's typical gap**: its mean inter-chunk gap before the kill (the span of its chunks
  before the kill over their number; not the median: a busy client reads several chunks in one read, so
  many gaps are 0 and their median says nothing of the token cadence).

The excess is the "TTFT delta" of a stream whose next token had to come from a new worker. Unlike
the bundled suite's live migration (a planned move of a healthy stream), it also holds the time the
engine took to notice the loss: that is what a user of such an engine gets.

A sample comes only from a stream that moved. Which streams moved, in this order of evidence:

1. the engine names its worker in each chunk (``served_by``, the bundled engine does): the streams
   whose chunks named the victim and then another worker (the stream's own change of worker); a
   stream that named only the victim and completed is unmeasured (no change seen);
2. the engine counts migrations of streams that had begun (its metric profile's
   ``migrations_ongoing``: Dynamo's ``dynamo_frontend_model_migration_total{migration_type=
   "ongoing_request"}``; never ``new_request``, a request re-sent before its first token, which moved
   no stream), else every migration (``migrations``, an engine that does not tell them apart): the engine
   cannot say which streams moved, so they are taken to be the k streams decoding at the kill with the
   largest stall, k being how much that counter rose over the kill's window (each sample says so in its
   ``migration`` field: the counter, k and how many streams were decoding). Dynamo counts as
   ``ongoing_request`` any stream whose connection broke, also one still waiting for its first token
   (the load's, under load): k is then an upper bound on the decoding streams that moved;
3. neither: the kill is *unmeasured*, with that reason (never counted against the engine).

So the samples counted against the checklist's ``min_migrations_*`` are moved streams only.

A stream in flight on the victim that failed instead of resuming is a failed migration. Samples are
:class:`harness.checks.migration.MigrationSample` so the item's one verdict function judges them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from harness.checks.migration import Assessment, MigrationSample
from harness.probes.client.records import NOT_SENT, RequestRecord
from harness.evidence.records import KillWindow

MIN_GAPS_BEFORE = 3   # inter-chunk gaps a stream needs before the kill for a typical gap

DEFINITION = ("per stream that crossed a migration after its worker was killed, as the client saw it: its "
              "longest inter-chunk gap at or after the kill (the switch to the new worker), minus the mean of "
              "its gaps before the kill (includes the engine's time to notice the loss); the streams that moved: "
              "those whose chunks named the victim then another worker, else (an engine that names no worker) "
              "the k streams decoding at the kill with the largest stall, k = the rise of the engine's counter of "
              "moved streams (Dynamo: migration_type=\"ongoing_request\" only)")


def _wall(rec: RequestRecord, perf_ns: int | None) -> float | None:
    return None if perf_ns is None else rec.anchor.perf_to_wall(perf_ns) / 1e9


def crossing(rec: RequestRecord, t: float, window_s: float = 5.0) -> tuple[float, float] | str:
    """(stall ms, typical gap ms) of ``rec`` across a kill at wall time ``t``, or why it cannot be
    measured. The stall is the longest gap between consecutive chunks that ends after ``t`` and
    starts within ``window_s`` of it: chunks the victim produced just before it died may still
    arrive after ``t`` (they were on their way), so the switch is not always the first gap after it."""
    walls = [_wall(rec, ns) for ns in rec.chunk_ns]
    j = next((i for i, w in enumerate(walls) if w is not None and w >= t), None)
    if j is None:
        return "no chunk after the kill"
    if j == 0:
        return "no chunk before the kill"
    before = [(walls[i] - walls[i - 1]) * 1000 for i in range(1, j)]
    if len(before) < MIN_GAPS_BEFORE:
        return f"only {len(before)} inter-chunk gap(s) before the kill (needs {MIN_GAPS_BEFORE})"
    stall = max((walls[i] - walls[i - 1]) * 1000 for i in range(j, len(walls)) if walls[i - 1] <= t + window_s)
    return stall, (walls[j - 1] - walls[0]) * 1000 / (j - 1)


def _decoding_at(rec: RequestRecord, t: float) -> bool:
    first, end = _wall(rec, rec.first_token_ns), _wall(rec, rec.end_ns)
    return first is not None and first < t and (end is None or end > t)


def _label(window: KillWindow, rec: RequestRecord) -> str:
    return f"{window.phase} {rec.request_id} ({window.fault.label})"


def _changed(rec: RequestRecord, victim: str) -> bool:
    """Did the stream's chunks name another worker after the victim (its own change of worker)?"""
    last = max(i for i, x in enumerate(rec.served_by) if x == victim)
    return any(x != victim for x in rec.served_by[last + 1:])


def measure(windows: Sequence[KillWindow], records: Iterable[RequestRecord]) -> Assessment:
    """Sort the streams in flight at each kill into measured crossings, failed migrations and
    unmeasured ones (see the module doc)."""
    records = [r for r in records if r.error_class != NOT_SENT]
    out = Assessment()
    for w in windows:
        victim = w.fault.victims[0] if w.fault.victims else ""
        decoding = [r for r in records if _decoding_at(r, w.fault.wall)]
        if not decoding:
            out.unmeasured.append(f"{w.phase} {w.fault.label}: no stream was still decoding when the kill came "
                                  "(longer streams would be)")
            continue
        named = sorted({x for r in decoding for x in r.served_by})
        how: dict[str, object] | None = None
        if named:
            on_victim = [r for r in decoding if victim in r.served_by]
            crossed = [r for r in on_victim if not r.ok or _changed(r, victim)]
            out.unmeasured.extend(f"{_label(w, rec)}: its chunks named only {victim} and it completed: no change of "
                                  "worker seen" for rec in on_victim if rec not in crossed)
        elif w.migrations is not None:
            stalls = [(c[0], r) for r in decoding if r.ok
                      and not isinstance(c := crossing(r, w.fault.wall, w.window_s), str)]
            k = int(round(w.migrations))
            crossed = [r for _, r in sorted(stalls, key=lambda x: -x[0])[:k]]
            how = {"identified_by": f"one of the {k} largest stalls among {len(stalls)} stream(s) decoding at the kill "
                                    f"(the engine names no worker per chunk; k = the rise of {w.counter or 'its migration counter'})",
                   "counter": w.counter, "k": k, "decoding": len(decoding)}
            crossed += [r for r in decoding if not r.ok]  # failed while in flight at the kill: a failed migration
        else:
            out.unmeasured.append(f"{w.phase} {w.fault.label}: cannot tell which streams crossed a migration: the "
                                  "engine names no worker per chunk (served_by) and its metric profile has no "
                                  "migration counter")
            continue
        if not crossed:
            where = (f"they ran on {', '.join(named)}" if named
                     else f"the migration counter rose by {w.migrations:g}")
            out.unmeasured.append(f"{w.phase} {w.fault.label}: none of the {len(decoding)} stream(s) decoding at the "
                                  f"kill crossed a migration ({where})")
            continue
        for rec in crossed:
            target = next((x for x in reversed(rec.served_by) if x != victim), "?")
            s = MigrationSample(w.phase, rec.request_id, victim, target, migration=how)
            if not rec.ok:
                out.failures.append(f"{_label(w, rec)}: the stream ended {rec.status} instead of resuming elsewhere: "
                                    f"{rec.error_class}: {rec.error_message}")
                continue
            gap = crossing(rec, w.fault.wall, w.window_s)
            if isinstance(gap, str):
                out.unmeasured.append(f"{_label(w, rec)}: {gap}")
                continue
            s.stall_ms, s.typical_gap_ms = round(gap[0], 3), round(gap[1], 3)
            s.client_stall_ms, s.client_typical_gap_ms = s.stall_ms, s.typical_gap_ms
            s.excess_ms = round(max(0.0, gap[0] - gap[1]), 3)
            out.samples.append(s)
    return out


__all__ = ["DEFINITION", "KillWindow", "MIN_GAPS_BEFORE", "crossing", "measure"]
