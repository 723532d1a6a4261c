"""Checklist item soak.leaks: no engine process leaks KV blocks, memory, file descriptors or
threads across the faults of a soak run (issue 27), judged from the leak sampler's readings
(harness/probes/leaks.py) and the KV blocks each worker held idle before the run and after the load
drained (the soak runner reads both when nothing is in flight).

- KV blocks: a worker holding more blocks idle after the run than idle before it, by more than
  ``kv_blocks_leaked``, fails. Certain evidence: nothing was in flight, yet the blocks are held.
- Growth: per process (a worker id and a pid: a restarted worker is a new process) after its first
  ``warmup_s``, the slope of RSS, open fds and threads over time, per hour: Theil-Sen over
  30 s medians with its 95 % interval (harness/stats/slope.py). It fails only when the whole
  interval is above the limit and passes only when the whole interval is below; a process observed
  for less than MIN_JUDGED_S is too short for a trend, so its slope is evidence only.
- The harness's own RSS after its first minute stays within ``harness_rss_band`` of its figure
  then (the rise above it); judged on runs of MIN_JUDGED_S or more, else evidence.

Pure: the samples and idle figures come in, a verdict goes out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from harness.checklists import Checklist, Threshold
from harness.checks.verdict import Measurement, Status, Verdict, judge
from harness.probes.leaks import LeakSample
from harness.stats.intervals import brackets
from harness.stats.slope import THEIL_SEN, Slope, binned_medians, theil_sen

ITEM = "soak.leaks"
MIN_JUDGED_S = 600.0      # a process observed this long has a trend worth judging (10 minutes)
BIN_S = 30.0              # readings are reduced to medians per bin before the fit ...
MAX_FIT_POINTS = 720      # ... with wider bins on runs longer than 6 hours (the fit is O(n^2))
MAX_SERIES_POINTS = 300   # per chart series
HOUR_S = 3600.0
# (reading field, threshold key, what it is, unit of the slope)
GROWTH = (("rss_mb", "rss_growth_mb_per_h", "RSS", "MB/h"),
          ("fds", "fds_growth_per_h", "open file descriptors", "fds/h"),
          ("threads", "threads_growth_per_h", "threads", "threads/h"))
DEFINITIONS = {
    "kv_blocks_leaked": "kv_blocks_used of a worker read with nothing in flight after the load drained, minus "
                        "the same read before the run",
    "growth": f"{THEIL_SEN} over {BIN_S:g} s medians of a process's readings after its first minute, scaled "
              "to per hour; the medians are taken as independent around the trend (a cycle longer than a bin, "
              "e.g. a slow allocator sawtooth, makes the interval too narrow)",
    "rss_mb": "VmRSS of /proc/PID/status in MB of 2**20 bytes",
    "harness_rss_band": "(highest RSS of the harness after its first minute - its RSS then) / its RSS then",
}


@dataclass
class _Process:
    worker: str
    role: str
    pid: int
    t: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[float] = field(default_factory=list)
    threads: list[float] = field(default_factory=list)

    @property
    def observed_s(self) -> float:
        return self.t[-1] - self.t[0]

    @property
    def label(self) -> str:
        return f"{self.worker} (pid {self.pid})"


@dataclass
class _Run:
    """The samples, gathered once: per process readings, per worker chart rows, the harness's RSS."""

    n: int = 0
    t0: float | None = None
    t_end: float | None = None
    processes: dict[tuple[str, int], _Process] = field(default_factory=dict)
    rows: dict[str, list[list[Any]]] = field(default_factory=dict)   # worker -> [t, rss_mb, fds, threads, kv]
    harness: list[tuple[float, float]] = field(default_factory=list)
    py_blocks: list[tuple[float, int]] = field(default_factory=list)   # the harness's live Python blocks

    def add(self, s: LeakSample) -> None:
        self.n += 1
        self.t0 = s.t if self.t0 is None else min(self.t0, s.t)
        self.t_end = s.t if self.t_end is None else max(self.t_end, s.t)
        if s.harness is not None:
            self.harness.append((s.t, s.harness.rss_mb))
        if s.harness_py_blocks is not None:
            self.py_blocks.append((s.t, s.harness_py_blocks))
        for w in s.workers:
            p = w.process
            self.rows.setdefault(w.id, []).append([s.t, None if p is None else p.rss_mb, None if p is None else p.fds,
                                                   None if p is None else p.threads, w.kv_blocks_used])
            if p is None:
                continue
            proc = self.processes.setdefault((w.id, p.pid), _Process(w.id, w.role, p.pid))
            proc.t.append(s.t)
            proc.rss_mb.append(p.rss_mb)
            proc.fds.append(float(p.fds))
            proc.threads.append(float(p.threads))


def _downsample(rows: Sequence[Sequence[Any]], limit: int = MAX_SERIES_POINTS) -> list[list[Any]]:
    """At most ``limit`` rows, evenly spaced by index, the first and the last always kept."""
    if len(rows) <= limit:
        return [list(r) for r in rows]
    step = (len(rows) - 1) / (limit - 1)
    return [list(rows[round(i * step)]) for i in range(limit)]


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _slopes(proc: _Process, warmup_s: float) -> tuple[dict[str, Slope], float, int]:
    """Per GROWTH field its per-hour slope after the warmup; the bin width and the readings fitted."""
    start = proc.t[0] + warmup_s
    keep = [i for i, t in enumerate(proc.t) if t >= start]
    span = proc.t[keep[-1]] - proc.t[keep[0]] if keep else 0.0
    bin_s = max(BIN_S, span / MAX_FIT_POINTS)
    t = [proc.t[i] - proc.t[0] for i in keep]
    out = {}
    for name, *_ in GROWTH:
        values = getattr(proc, name)
        x, y = binned_medians(t, [values[i] for i in keep], bin_s)
        out[name] = theil_sen(x, y, noun=f"{bin_s:g} s medians").scaled(HOUR_S)
    return out, bin_s, len(keep)


def _kv(thresholds: dict[str, Threshold], idle_before: dict[str, int], idle_after: dict[str, int],
        seen: Iterable[str]) -> tuple[Measurement, dict[str, Any], str | None]:
    """The KV measurement (the worst worker's blocks held after above before), its evidence, and why
    it cannot pass yet (a worker whose figure after could not be read), if so."""
    per = {}
    for wid in sorted(set(idle_before) | set(idle_after)):
        before, after = idle_before.get(wid), idle_after.get(wid)
        entry: dict[str, Any] = {"idle_before": before, "idle_after": after,
                                 "leaked": None if after is None else after - (before or 0)}
        if after is None:
            entry["note"] = "could not be read after the load drained (worker gone or admin API unanswered)"
        elif before is None:
            entry["note"] = "no figure before the run: compared with 0 blocks"
        per[wid] = entry
    unread = [wid for wid, e in per.items() if e["leaked"] is None]
    leaks = sorted(((e["leaked"], wid) for wid, e in per.items() if e["leaked"] is not None),
                   key=lambda x: (-x[0], x[1]))
    evidence = {"workers": per, "unread_after": unread,
                "not_in_idle_figures": sorted(set(seen) - set(per))}
    t = thresholds["kv_blocks_leaked"]
    if not leaks:
        because = ("no worker's KV blocks could be read once the load drained" if per
                   else "no idle KV figures of any worker were taken before and after the run")
        return Measurement(t, None, "KV blocks held once the load drained above idle before the run"), evidence, because
    worst, wid = leaks[0]
    before = per[wid]["idle_before"] or 0
    figures = f"{per[wid]['idle_after']} vs {before} before"
    if t.holds(worst):
        what = (f"KV blocks held once the load drained above idle before the run, the most of {len(leaks)} "
                f"workers ({wid}: {figures})")
    else:
        over = [f"{w}: {n}" for n, w in leaks[1:] if not t.holds(n)]
        what = (f"KV blocks held once the load drained above idle before the run on {wid} ({figures}"
                + (f"; also over on {', '.join(over)})" if over else ")"))
    because = f"the KV blocks of {', '.join(unread)} could not be read once the load drained" if unread else None
    return Measurement(t, float(worst), what), evidence, because


def leak_verdict(checklist: Checklist, samples: Iterable[LeakSample], *, idle_before: dict[str, int],
                 idle_after: dict[str, int], warmup_s: float = 60.0, kv_unmeasured: str | None = None) -> Verdict:
    """soak.leaks from the run's leak ``samples`` (streamed once) and the KV blocks each worker held
    idle before the run (``idle_before``) and after the load drained (``idle_after``; a worker
    missing there could not be read). ``kv_unmeasured``: why the cluster's KV blocks cannot be read
    at all (an external engine without the metric), said instead of the generic reason. See the
    module docstring for the rules."""
    item = checklist.item(ITEM)
    th = dict(item.thresholds)
    run = _Run()
    for s in samples:
        run.add(s)
    kv, kv_evidence, kv_because = _kv(th, idle_before, idle_after, run.rows)
    if kv_unmeasured:
        kv_evidence["unmeasured"] = kv_unmeasured
        if kv.value is None:
            kv_because = f"KV blocks not measured: {kv_unmeasured}"
    measurements = [kv]
    processes, short = [], []
    for proc in sorted(run.processes.values(), key=lambda p: (p.worker, p.t[0])):
        slopes, bin_s, fitted = _slopes(proc, warmup_s)
        judged = proc.observed_s >= MIN_JUDGED_S
        minutes = proc.observed_s / 60
        entry: dict[str, Any] = {
            "worker": proc.worker, "role": proc.role, "pid": proc.pid, "judged": judged,
            "first_t_rel_s": _round(proc.t[0] - (run.t0 or proc.t[0])), "observed_s": _round(proc.observed_s),
            "readings": len(proc.t), "readings_fitted": fitted, "bin_s": bin_s,
            "rss_mb_first": _round(proc.rss_mb[0]), "rss_mb_last": _round(proc.rss_mb[-1]),
            "fds_first": proc.fds[0], "fds_last": proc.fds[-1],
            "threads_first": proc.threads[0], "threads_last": proc.threads[-1],
            **{key: slopes[name].to_dict() for name, key, *_ in GROWTH}}
        if not judged:
            entry["note"] = (f"observed {minutes:.1f} min, under {MIN_JUDGED_S / 60:g}: its slopes are evidence "
                             "only (they neither fail nor block a pass)")
            short.append(proc.label)
        else:
            measurements += [Measurement(th[key], slopes[name].estimate,
                                         f"{what} growth of {proc.label} over {minutes:.1f} min after its first "
                                         f"{warmup_s:g} s", slopes[name].interval)
                             for name, key, what, _ in GROWTH]
        processes.append(entry)
    harness = _harness(run, warmup_s)
    if harness.get("judged"):
        measurements.append(Measurement(th["harness_rss_band"], harness["band"],
                                        f"the harness's own RSS rise after its first {warmup_s:g} s "
                                        f"({harness['max_mb']:.1f} MB at most vs {harness['ref_mb']:.1f} MB then, "
                                        f"over {harness['observed_s'] / 60:.1f} min)"))
    because = kv_because
    if run.n == 0:
        because = "; ".join(filter(None, [because, "no leak samples were taken (the sampler recorded nothing), so "
                                                   "memory, fd and thread growth are unknown"]))
    evidence = {
        "kv": kv_evidence, "processes": processes, "harness": harness, "samples_taken": run.n,
        "duration_s": None if run.t0 is None else _round(run.t_end - run.t0), "warmup_s": warmup_s,
        "min_judged_s": MIN_JUDGED_S, "definitions": DEFINITIONS,
        "series_columns": ["t_rel_s", "rss_mb", "fds", "threads", "kv_blocks_used"],
        "series": {wid: _downsample([[_round(r[0] - run.t0), _round(r[1]), *r[2:]] for r in rows])
                   for wid, rows in sorted(run.rows.items())},
        "harness_rss_mb": _downsample([[_round(t - run.t0), _round(mb)] for t, mb in run.harness]),
    }
    if not run.processes and run.n:
        evidence["growth_note"] = ("no process readings (not a local cluster, no worker pid, or /proc not readable "
                                   "on the workers' hosts): growth not measured")
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=because or None)
    return _with_context(verdict, processes, short, bool(run.processes), run.n)


def _harness(run: _Run, warmup_s: float) -> dict[str, Any]:
    """The harness's RSS band: the rise of its RSS after the warmup above its first reading then."""
    if not run.harness:
        return {"note": "no reading of the harness's own process"}
    start = run.harness[0][0] + warmup_s
    after = [(t, mb) for t, mb in run.harness if t >= start]
    observed = run.harness[-1][0] - run.harness[0][0]
    if not after:
        return {"observed_s": _round(observed), "judged": False,
                "note": f"no reading after the first {warmup_s:g} s"}
    ref, top = after[0][1], max(mb for _, mb in after)
    judged = observed >= MIN_JUDGED_S
    out = {"ref_mb": _round(ref), "max_mb": _round(top), "band": (top - ref) / ref if ref > 0 else 0.0,
           "observed_s": _round(observed), "judged": judged}
    blocks = [b for t, b in run.py_blocks if t >= start]
    if blocks:   # evidence beside RSS: Python's own live blocks (harness/probes/selfmem.py)
        out["py_blocks"] = {"ref": blocks[0], "max": max(blocks), "last": blocks[-1],
                            "band": (max(blocks) - blocks[0]) / blocks[0] if blocks[0] > 0 else 0.0}
    if not judged:
        out["note"] = f"a run of {observed / 60:.1f} min, under {MIN_JUDGED_S / 60:g}: evidence only"
    return out


def _with_context(verdict: Verdict, processes: list[dict[str, Any]], short: list[str], measured: bool,
                  n: int) -> Verdict:
    """Unless it failed (its reason then names what failed), say in the reason what the verdict did
    not weigh (short processes' slopes, growth not measured) and the steepest RSS growth seen."""
    if verdict.status is Status.FAIL:
        return verdict
    extra = []
    if processes:
        steep = max(processes, key=lambda p: -math.inf if p["rss_growth_mb_per_h"]["estimate"] is None
                    else p["rss_growth_mb_per_h"]["estimate"])
        slope = steep["rss_growth_mb_per_h"]
        if slope["estimate"] is not None:
            extra.append(f"steepest RSS growth {steep['worker']} (pid {steep['pid']}) {slope['estimate']:.3g} MB/h "
                         f"{brackets(slope['interval'])}")
    if short:
        extra.append(f"{len(short)} process(es) observed under {MIN_JUDGED_S / 60:g} min ({', '.join(short[:4])}"
                     f"{', ...' if len(short) > 4 else ''}): their growth is evidence only")
    if n and not measured:
        extra.append("no process readings: growth not measured")
    if extra:
        verdict.reason = f"{verdict.reason}; {'; '.join(extra)}"
    return verdict


__all__ = ["ITEM", "MIN_JUDGED_S", "leak_verdict"]
