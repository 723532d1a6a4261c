"""Checklist item 6.1.3 judged by load on a foreign engine (no admin API, no HBM-fill hook).

The cluster file states, per level, the KV use above which the level holds and what the cluster
must do there (``degradation.levels``: reject new requests with a status and Retry-After, cap
completions, queue without errors, no errors). harness/probes/loadgen/kv_drive.py drove KV use (the
engine's own metric) over each threshold with long-prompt streams. A level is in force from a KV
sample inside its band (at or above its threshold, below the next one) until the next sample. This
check judges, per level:

- on the requests *sent* while it was in force: refusals (``reject``: status codes, Retry-After)
  and completion lengths against ``max_tokens_cap``, since both act on admission;
- on the requests *in flight* while it was in force: errors (``no_errors``, ``queue``);
- on the engine's metrics meanwhile: waiting requests or preemptions (``queue``);
- after the load stopped, KV use fell back below the first threshold within ``step_down_s``, judged
  with the resolution of the KV samples (:func:`step_down_interval`: it fell after the last sample
  that still read at or above the threshold), so a time within one sample of the limit is inconclusive.

A level whose threshold the load could not reach (within its time budget, or that KV use jumped
over without a request sent inside it) cannot be judged: the verdict is then inconclusive, naming
the level and the highest KV use seen, unless an action already failed.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from harness.checks.degradation import ITEM
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Verdict, judge
from harness.stats.intervals import RESOLUTION, Interval, measured_within
from harness.probes.loadgen.kv_drive import DriveResult, KvSample
from harness.probes.client.records import NOT_SENT, RequestRecord

_RETRY_AFTER = re.compile(r"\(Retry-After: [^)]+\)")  # how the streaming client keeps the header
_MAX_LISTED = 10
_MAX_SERIES = 400  # KV-use points kept in the evidence


@dataclass
class LevelResult:
    level: int
    kv_use_above: float
    expect: dict[str, Any]
    reached: bool = False
    crossed_after_s: float | None = None     # from the first request of the drive
    kv_max: float | None = None              # highest KV use while this level was in force
    seconds_in_level: float = 0.0
    requests: int = 0                        # in flight at some time while it was in force
    sent: int = 0                            # sent while it was in force
    completed: int = 0
    refused: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    waiting_max: float | None = None
    preemptions: float | None = None         # increase while in this level
    violations: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def level_index_at(samples: Sequence[KvSample], thresholds: Sequence[float], t_wall_ns: int) -> int | None:
    """Index of the level in force at ``t_wall_ns`` (the latest sample at or before it), None below
    the first threshold or before the first sample."""
    times = [s.t_wall_ns for s in samples]
    k = bisect.bisect_right(times, t_wall_ns) - 1
    if k < 0 or samples[k].kv_use is None:
        return None
    i = bisect.bisect_right(list(thresholds), samples[k].kv_use) - 1
    return None if i < 0 else i


def _failed(rec: RequestRecord) -> bool:
    return not rec.ok or rec.finish_reason == "error"


def _check_actions(res: LevelResult, expect: Any, recs: list[RequestRecord], active: list[RequestRecord]) -> None:
    """``recs``: sent while the level was in force; ``active``: in flight meanwhile (a superset)."""
    failed = [r for r in recs if _failed(r)]
    if expect.reject is not None and not recs:
        res.unchecked.append(f"level {res.level}: no request was sent while it held, so refusals could not be checked")
    elif expect.reject is not None:
        statuses = set(expect.reject.status)
        refusals = [r for r in failed if r.status == "http_error" and r.http_status in statuses]
        res.refused = len(refusals)
        if not refusals:
            res.violations.append(f"level {res.level}: no new request was refused with HTTP "
                                  f"{'/'.join(map(str, sorted(statuses)))} ({len(recs)} sent while KV use was above "
                                  f"{res.kv_use_above:.2f})")
        if expect.reject.retry_after:
            bare = [r.request_id for r in refusals if not _RETRY_AFTER.search(r.error_message or "")]
            if bare:
                res.violations.append(f"level {res.level}: {len(bare)} refusal(s) without a Retry-After header, "
                                      f"e.g. {', '.join(bare[:_MAX_LISTED])}")
        other = [r for r in failed if r not in refusals]
        if other:
            res.violations.append(f"level {res.level}: {len(other)} request(s) failed other than by a stated "
                                  f"refusal, e.g. {_brief(other[0])}")
    if expect.max_tokens_cap is not None:
        done = [r for r in recs if r.ok and r.finish_reason != "error"]
        over = [r for r in done if r.num_output_tokens > expect.max_tokens_cap]
        if not recs:
            res.unchecked.append(f"level {res.level}: no request was sent while it held, so the cap of "
                                 f"{expect.max_tokens_cap} tokens could not be checked")
        elif not done:
            res.unchecked.append(f"level {res.level}: no completion ended while it held, so the cap of "
                                 f"{expect.max_tokens_cap} tokens could not be checked")
        elif over:
            res.violations.append(f"level {res.level}: {len(over)} of {len(done)} completions exceeded the cap of "
                                  f"{expect.max_tokens_cap} tokens (e.g. {over[0].request_id}: "
                                  f"{over[0].num_output_tokens} tokens)")
    if expect.queue:
        if not (res.waiting_max or 0) > 0 and not (res.preemptions or 0) > 0:
            res.violations.append(f"level {res.level}: no request waited and none was preempted (the engine's "
                                  "waiting and preemption metrics did not rise): nothing queued")
    errored = [r for r in active if _failed(r)]
    if (expect.queue or expect.no_errors) and errored:
        res.violations.append(f"level {res.level}: {len(errored)} of {len(active)} request(s) in flight while it held "
                              f"ended with an error, e.g. {_brief(errored[0])}")


def _brief(rec: RequestRecord) -> str:
    http = f"HTTP {rec.http_status} " if rec.http_status else ""
    return f"{rec.request_id} ({rec.status}, {http}{rec.error_class}: {(rec.error_message or '')[:120]})"


def measure_levels(levels: Sequence[Any], drive: DriveResult) -> list[LevelResult]:
    """One LevelResult per stated level (``levels``: the cluster file's DegradationLevel models)."""
    thresholds = [lv.kv_use_above for lv in levels]
    ramp = [s for s in drive.samples if s.t_wall_ns <= drive.stopped_wall_ns]
    recs = [r for r in drive.records if r.error_class != NOT_SENT and r.request_id != "kv-drive-calibration"]
    t0 = min((r.start_wall_ns() for r in recs), default=ramp[0].t_wall_ns if ramp else 0)
    by_level: dict[int, list[RequestRecord]] = {}
    for r in recs:
        i = level_index_at(ramp, thresholds, r.start_wall_ns())
        if i is not None:
            by_level.setdefault(i, []).append(r)
    # (start, end) of every stretch of time each level was in force
    spans: dict[int, list[tuple[int, int]]] = {}
    for k, smp in enumerate(ramp):
        i = level_index_at(ramp, thresholds, smp.t_wall_ns)
        if i is not None:
            end = ramp[k + 1].t_wall_ns if k + 1 < len(ramp) else drive.stopped_wall_ns
            spans.setdefault(i, []).append((smp.t_wall_ns, end))
    out = []
    for i, lv in enumerate(levels):
        res = LevelResult(lv.level, lv.kv_use_above, lv.expect.model_dump(mode="json", exclude_defaults=True))
        res.reached = i in drive.crossed_wall_ns
        if res.reached:
            res.crossed_after_s = round((drive.crossed_wall_ns[i] - t0) / 1e9, 3)
        inside = [(k, s) for k, s in enumerate(ramp) if level_index_at(ramp, thresholds, s.t_wall_ns) == i]
        if inside:
            res.kv_max = max(s.kv_use for _, s in inside if s.kv_use is not None)
            res.seconds_in_level = round(sum((ramp[k + 1].t_wall_ns - s.t_wall_ns) / 1e9
                                             for k, s in inside if k + 1 < len(ramp)), 2)
            waits = [s.waiting for _, s in inside if s.waiting is not None]
            res.waiting_max = max(waits) if waits else None
            res.preemptions = _increase(ramp, [k for k, _ in inside])
        level_recs = by_level.get(i, [])
        active = [r for r in recs if any(_overlaps(r, a, b) for a, b in spans.get(i, ()))]
        res.requests, res.sent = len(active), len(level_recs)
        res.completed = sum(1 for r in active if not _failed(r))
        for r in active:
            if _failed(r):
                key = f"{r.http_status or r.status} {r.error_class}"
                res.errors[key] = res.errors.get(key, 0) + 1
        if res.reached and active:
            _check_actions(res, lv.expect, level_recs, active)
        out.append(res)
    return out


def _overlaps(rec: RequestRecord, start_ns: int, end_ns: int) -> bool:
    sent = rec.start_wall_ns()
    ended = rec.anchor.perf_to_wall(rec.end_ns) if rec.end_ns is not None else None
    return sent < end_ns and (ended is None or ended >= start_ns)


def _increase(samples: Sequence[KvSample], indexes: Sequence[int]) -> float | None:
    """Preemption counter increase over the intervals that follow the samples at ``indexes`` (a
    restarted engine's reset counter counts its new value, as Prometheus' increase() does)."""
    total, seen = 0.0, False
    for k in indexes:
        if k + 1 >= len(samples) or samples[k].preemptions is None or samples[k + 1].preemptions is None:
            continue
        seen = True
        before, after = samples[k].preemptions, samples[k + 1].preemptions
        total += after - before if after >= before else after
    return total if seen else None


def step_down_interval(drive: DriveResult, threshold: float, timeout_s: float) -> Interval:
    """Where the step-down time lies, from the stop of the load: KV use fell below ``threshold``
    after the last KV sample that still read at or above it (the one before the first sample after
    the stop that read below) and by ``drive.step_down_s``, when that sample's read ended. Never
    seen below: at least ``timeout_s``, with no upper bound."""
    if drive.step_down_s is None:
        return Interval(timeout_s, None, 1.0, RESOLUTION, 1, noun="KV samples")
    read = [s for s in drive.samples if s.kv_use is not None]
    first_below = next((k for k, s in enumerate(read) if s.t_wall_ns >= drive.stopped_wall_ns
                        and s.kv_use < threshold), None)
    lo = 0.0
    if first_below is not None and first_below > 0:
        lo = min(max(0.0, (read[first_below - 1].t_wall_ns - drive.stopped_wall_ns) / 1e9), drive.step_down_s)
    return measured_within(drive.step_down_s, below=drive.step_down_s - lo, above=0.0, noun="KV samples")


def load_degradation_verdict(levels: Sequence[Any], drive: DriveResult, checklist: Checklist, *,
                             step_down_timeout_s: float) -> Verdict:
    item = checklist.item(ITEM)
    t = item.thresholds
    results = measure_levels(levels, drive)
    violations = [v for r in results for v in r.violations]
    seen = [s.kv_use for s in drive.samples if s.kv_use is not None]
    highest = max(seen) if seen else None
    ramping = [s.kv_use for s in drive.samples if s.kv_use is not None and s.t_wall_ns <= drive.stopped_wall_ns]
    top = f"{max(ramping):.3f}" if ramping else "n/a"
    gaps = []
    for r in results:
        if not r.reached:
            gaps.append(f"level {r.level} not reached: KV use stayed below {r.kv_use_above:.2f} while the load ramped "
                        f"(highest {top}; {drive.ramp_ended})")
        elif not r.requests:
            gaps.append(f"level {r.level}: no request was in flight while it held (KV use jumped past it)")
    gaps += [u for r in results for u in r.unchecked]
    step_down = drive.step_down_s if drive.step_down_s is not None else step_down_timeout_s
    measurements = [
        Measurement(t["actions_not_applied"], len(violations),
                    "stated level actions not seen on the API or the engine's metrics"),
        Measurement(t["step_down_s"], round(step_down, 3),
                    f"time from the end of the load until KV use fell below {levels[0].kv_use_above:.2f}",
                    step_down_interval(drive, levels[0].kv_use_above, step_down_timeout_s)),
    ]
    evidence: dict[str, Any] = {
        "method": "by load: long-prompt streams ramped until the engine's KV-use metric crossed each level of the "
                  "cluster file's degradation.levels; actions checked on the requests sent at each level",
        "levels": [r.to_dict() for r in results],
        "highest_kv_use": highest,
        "ramp_ended": drive.ramp_ended,
        "max_streams": drive.max_concurrency_used,
        "chars_per_token": round(drive.chars_per_token, 3),
        "kv_use_series": _series(drive.samples),
        "step_down_never": drive.step_down_s is None,
    }
    if violations:
        evidence["problems"] = violations
    if gaps:
        evidence["not_judged"] = gaps
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because="; ".join(gaps) or None)
    if verdict.status.value == "fail" and violations:
        verdict.add("note", sep=" First problem: ", text=str(violations[0]))
    elif verdict.status.value == "pass":
        verdict.add("note", sep=" Levels: ", text="; ".join(
            f"{r.level} (KV use above {r.kv_use_above:.2f}, up to {r.kv_max or 0:.2f}): {r.requests} requests in flight, "
            f"{', '.join(k for k, v in r.expect.items() if v)} held" for r in results) + ".")
    return verdict


def _series(samples: Sequence[KvSample]) -> list[dict[str, Any]]:
    step = max(1, -(-len(samples) // _MAX_SERIES))
    return [s.to_dict() for s in samples[::step]]


__all__ = ["LevelResult", "level_index_at", "load_degradation_verdict", "measure_levels"]
