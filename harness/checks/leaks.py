"""Checklist item soak.leaks: no engine process leaks KV blocks, memory, file descriptors or
threads across the faults of a soak run (issue 27), judged from the leak sampler's readings
(harness/probes/workers/leaks.py) and the KV blocks each worker held idle before the run and after the load
drained (the soak runner reads both when nothing is in flight).

- KV blocks: a worker holding more blocks idle after the run than idle before it, by more than
  ``kv_blocks_leaked``, fails. Certain evidence: nothing was in flight, yet the blocks are held.
- Growth per role, across restarts: every process of a role (prefill, decode; a worker id and a
  pid: a restarted worker is a new process) is one segment of the role's readings after that
  process's first ``warmup_s``. RSS, open fds and threads are reduced to 30 s medians per segment
  (shorter, down to 10 s, while the unit has been seen under 9 minutes after the warmup: a 3-minute
  soak then has 12 medians a process, not 4, too few for any bound; :meth:`Rules.bin_for`)
  and fitted with ONE slope per hour common to the segments, each keeping its own intercept
  (harness/stats/slope.py ``segmented_theil_sen``: pairwise slopes within a segment only, so a
  restart's drop is no slope and a restart does not reset the evidence), with its 95 % interval.
  The same fit is made per worker (its processes across restarts), so one leaking worker of a
  role is not diluted by a healthy one. A unit (a role, a worker) observed for MIN_JUDGED_S (10
  minutes of wall time from its first reading to its last, restarts included) or more is judged: it
  fails only when the whole interval is above the limit, passes only when the whole interval is
  below. Under that its slope is evidence only, except the early fail (:class:`Rules`): the
  interval's lower bound above ``early_factor`` (4) times the limit, from at least
  ``early_points`` (6) medians over at least ``early_span_s`` (90 s) fails at once. KV blocks in
  use get the same fit as evidence (they follow the load; the drained figure above judges them), and so
  do per-process slopes. Not in the run's false-fail budget (``ERROR_CONTROL``).
- The harness's own RSS after its first minute stays within ``harness_rss_band`` of its figure
  then: the rise over the run estimated by the Theil-Sen slope of its 30 s medians times the
  span, over the first median after the warmup, with the slope's 95 % interval scaled the same
  way, through judge(); judged on runs of MIN_JUDGED_S or more or by the early fail, else evidence.

Pure: the samples and idle figures come in, a verdict goes out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from harness.checklists import Checklist, Threshold
from harness.checks.leak_rules import (BIN_S, DEFINITIONS, ERROR_CONTROL, GROWTH, HOUR_S, MAX_FIT_POINTS,
                                       MAX_SERIES_POINTS, MIN_JUDGED_S, Rules)
from harness.checks.verdict import Measurement, Status, Verdict, judge
from harness.probes.workers.leaks import LeakSample
from harness.stats.slope import THEIL_SEN, Slope, binned_medians, segmented_theil_sen, theil_sen

ITEM = "soak.leaks"
__all__ = ["BIN_S", "DEFINITIONS", "ERROR_CONTROL", "ITEM", "MIN_JUDGED_S", "Rules", "leak_verdict"]


@dataclass
class _Process:
    worker: str
    role: str
    pid: int
    t: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    fds: list[float] = field(default_factory=list)
    threads: list[float] = field(default_factory=list)
    kv: list[float] = field(default_factory=list)

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
            proc.kv.append(math.nan if w.kv_blocks_used is None else float(w.kv_blocks_used))


def _downsample(rows: Sequence[Sequence[Any]], limit: int = MAX_SERIES_POINTS) -> list[list[Any]]:
    """At most ``limit`` rows, evenly spaced by index, the first and the last always kept."""
    if len(rows) <= limit:
        return [list(r) for r in rows]
    step = (len(rows) - 1) / (limit - 1)
    return [list(rows[round(i * step)]) for i in range(limit)]


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


@dataclass
class _Fit:
    """One unit's growth fit: a role's or a worker's processes (segments) after each one's warmup."""

    name: str                       # "role decode", "worker decode-0"
    processes: list[_Process]
    slopes: dict[str, Slope]        # per GROWTH field and "kv", per hour
    medians: int                    # points fitted, all segments together
    span_s: float                   # wall time from the first reading after a warmup to the last
    observed_s: float               # wall time from the first reading to the last
    bin_s: float

    @property
    def who(self) -> str:
        """``role decode (2 processes: decode-0 (pid 11), decode-1 (pid 12))``, ``decode-0 (pid 11)``."""
        if len(self.processes) == 1 and not self.name.startswith("role "):
            return self.processes[0].label
        more = ", ..." if len(self.processes) > 6 else ""
        n = len(self.processes)
        return f"{self.name} ({n} process{'es' if n > 1 else ''}: {', '.join(p.label for p in self.processes[:6])}{more})"

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.name, "processes": [p.label for p in self.processes], "medians": self.medians,
                "span_s": _round(self.span_s), "observed_s": _round(self.observed_s), "bin_s": self.bin_s,
                **{f"{k}_per_h": v.to_dict() for k, v in self.slopes.items()}}


def _fit(name: str, procs: list[_Process], rules: Rules) -> _Fit:
    kept = [(p, [i for i, t in enumerate(p.t) if t >= p.t[0] + rules.warmup_s]) for p in procs]
    kept = [(p, k) for p, k in kept if k]
    life = sum(p.t[k[-1]] - p.t[k[0]] for p, k in kept)
    span = max((p.t[k[-1]] for p, k in kept), default=0.0) - min((p.t[k[0]] for p, k in kept), default=0.0)
    bin_s = max(rules.bin_for(span), life / MAX_FIT_POINTS)
    slopes, medians = {}, 0
    for name_ in [*(g[0] for g in GROWTH), "kv"]:
        segments = []
        for p, k in kept:
            values = getattr(p, name_)
            x, y = binned_medians([p.t[i] - p.t[0] for i in k], [values[i] for i in k], bin_s)
            segments.append((x, y))
        if name_ == "rss_mb":
            medians = sum(len(x) for x, _ in segments)
        slopes[name_] = segmented_theil_sen(segments, noun=f"{bin_s:g} s medians").scaled(HOUR_S)
    observed = max((p.t[-1] for p, _ in kept), default=0.0) - min((p.t[0] for p, _ in kept), default=0.0)
    return _Fit(name, [p for p, _ in kept], slopes, medians, span, observed, bin_s)


def _growth(run: _Run, th: dict[str, Threshold], rules: Rules) -> tuple[list[Measurement], list[_Fit]]:
    """Per role, then per worker of a role with more than one: the fits, and the measurements the
    rules judge (a unit observed MIN_JUDGED_S, or one the early fail catches)."""
    by_role: dict[str, list[_Process]] = {}
    for p in sorted(run.processes.values(), key=lambda p: (p.worker, p.t[0])):
        by_role.setdefault(p.role, []).append(p)
    fits = []
    for role, procs in sorted(by_role.items()):
        fits.append(_fit(f"role {role}", procs, rules))
        workers = sorted({p.worker for p in procs})
        if len(workers) > 1:
            fits += [_fit(f"worker {w}", [p for p in procs if p.worker == w], rules) for w in workers]
    measurements = []
    for f in fits:
        if not f.processes:
            continue
        judged = f.observed_s >= rules.min_judged_s
        for name, key, what, _ in GROWTH:
            slope, t = f.slopes[name], th[key]
            lo = slope.interval.lo
            early = (not judged and slope.estimate is not None and lo is not None
                     and f.medians >= rules.early_points and f.span_s >= rules.early_span_s
                     and lo > rules.early_factor * t.value)
            if judged or early:
                how = ("" if judged else f"; early fail: its lower bound is over {rules.early_factor:g}x the limit "
                       f"after {f.span_s / 60:.1f} min, {f.medians} medians")
                measurements.append(Measurement(
                    t, slope.estimate, f"{what} growth of {f.who}, one slope across restarts over "
                    f"{f.span_s / 60:.1f} min after each process's first {rules.warmup_s:g} s{how}", slope.interval))
    return measurements, fits


def _per_request(fits: list[_Fit], run: _Run, requests: int | None) -> dict[str, Any] | None:
    """Each role's growth per completed request (evidence): slope per process x workers / requests per hour."""
    if not requests or run.t0 is None or run.t_end is None or run.t_end <= run.t0:
        return None
    per_h = requests / ((run.t_end - run.t0) / HOUR_S)
    out = {}
    for f in fits:
        if not f.name.startswith("role ") or not f.processes:
            continue
        k = len({p.worker for p in f.processes})
        out[f.name[5:]] = {g: None if f.slopes[g].estimate is None else f.slopes[g].estimate * k / per_h
                           for g in (*(x[0] for x in GROWTH), "kv")}
    return {"requests": requests, "requests_per_h": round(per_h, 1), "roles": out}


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
                 idle_after: dict[str, int], warmup_s: float = 60.0, kv_unmeasured: str | None = None,
                 requests: int | None = None, rules: Rules | None = None) -> Verdict:
    """soak.leaks from the run's leak ``samples`` (streamed once) and the KV blocks each worker held
    idle before the run (``idle_before``) and after the load drained (``idle_after``; a worker
    missing there could not be read). ``kv_unmeasured``: why the cluster's KV blocks cannot be read
    at all (an external engine without the metric), said instead of the generic reason.
    ``requests``: the run's completed requests, for the growth per request (evidence). ``rules``:
    the growth rules' figures (default :class:`Rules` with ``warmup_s``). See the module docstring."""
    rules = rules or Rules(warmup_s=warmup_s)
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
    growth, fits = _growth(run, th, rules)
    measurements = [kv, *growth]
    processes = []
    for proc in sorted(run.processes.values(), key=lambda p: (p.worker, p.t[0])):
        one = _fit(proc.label, [proc], rules)   # this process alone: evidence (its role and worker are judged)
        processes.append({
            "worker": proc.worker, "role": proc.role, "pid": proc.pid, "readings": len(proc.t),
            "first_t_rel_s": _round(proc.t[0] - (run.t0 or proc.t[0])), "observed_s": _round(proc.observed_s),
            "rss_mb_first": _round(proc.rss_mb[0]), "rss_mb_last": _round(proc.rss_mb[-1]),
            "fds_first": proc.fds[0], "fds_last": proc.fds[-1],
            "threads_first": proc.threads[0], "threads_last": proc.threads[-1],
            **{key: one.slopes[name].to_dict() for name, key, *_ in GROWTH}})
    harness, band = _harness(run, th["harness_rss_band"], rules)
    if band is not None:
        measurements.append(band)
    because = kv_because
    if run.n == 0:
        because = "; ".join(filter(None, [because, "no leak samples were taken (the sampler recorded nothing), so "
                                                   "memory, fd and thread growth are unknown"]))
    evidence = {
        "kv": kv_evidence, "roles": [f.to_dict() for f in fits], "processes": processes, "harness": harness,
        "samples_taken": run.n, "duration_s": None if run.t0 is None else _round(run.t_end - run.t0),
        "warmup_s": rules.warmup_s, "min_judged_s": rules.min_judged_s,
        "rules": {"bin_s": rules.bin_s, "short_bin_s": rules.short_bin_s, "early_factor": rules.early_factor, "early_points": rules.early_points,
                  "early_span_s": rules.early_span_s},
        "per_request": _per_request(fits, run, requests), "definitions": DEFINITIONS, "error_control": ERROR_CONTROL,
        "series_columns": ["t_rel_s", "rss_mb", "fds", "threads", "kv_blocks_used"],
        "series": {wid: _downsample([[_round(r[0] - run.t0), _round(r[1]), *r[2:]] for r in rows])
                   for wid, rows in sorted(run.rows.items())},
        "harness_rss_mb": _downsample([[_round(t - run.t0), _round(mb)] for t, mb in run.harness]),
    }
    if not run.processes and run.n:
        evidence["growth_note"] = ("no process readings (not a local cluster, no worker pid, or /proc not readable "
                                   "on the workers' hosts): growth not measured")
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=because or None)
    return _with_context(verdict, fits, rules, bool(run.processes), run.n)


def _harness(run: _Run, band: Threshold, rules: Rules) -> tuple[dict[str, Any], Measurement | None]:
    """The harness's RSS band (module docstring) and its measurement when judged."""
    if not run.harness:
        return {"note": "no reading of the harness's own process"}, None
    start = run.harness[0][0] + rules.warmup_s
    after = [(t, mb) for t, mb in run.harness if t >= start]
    observed = run.harness[-1][0] - run.harness[0][0]
    if not after:
        return {"observed_s": _round(observed), "judged": False,
                "note": f"no reading after the first {rules.warmup_s:g} s"}, None
    span = after[-1][0] - after[0][0]
    bin_s = max(rules.bin_s, span / MAX_FIT_POINTS)
    x, y = binned_medians([t - start for t, _ in after], [mb for _, mb in after], bin_s)
    ref = y[0]
    slope = theil_sen(x, y, noun=f"{bin_s:g} s medians")
    factor = span / ref if ref > 0 and span > 0 else None
    value = None if slope.estimate is None or factor is None else slope.estimate * factor
    interval = slope.interval.scaled(factor) if factor else slope.interval
    lo = interval.lo
    judged = observed >= rules.min_judged_s
    early = (not judged and value is not None and lo is not None and len(x) >= rules.early_points
             and span >= rules.early_span_s and lo > rules.early_factor * band.value)
    out: dict[str, Any] = {
        "ref_mb": _round(ref), "max_mb": _round(max(mb for _, mb in after)), "last_mb": _round(after[-1][1]),
        "band": value, "interval": interval.to_dict(), "slope_mb_per_h": slope.scaled(HOUR_S).to_dict(),
        "observed_s": _round(observed), "judged": judged or early, "early_fail": early}
    blocks = [b for t, b in run.py_blocks if t >= start]
    if blocks:   # evidence beside RSS: Python's own live blocks (harness/probes/machine_health/selfmem.py)
        out["py_blocks"] = {"ref": blocks[0], "max": max(blocks), "last": blocks[-1],
                            "band": (max(blocks) - blocks[0]) / blocks[0] if blocks[0] > 0 else 0.0}
    if not (judged or early):
        out["note"] = f"a run of {observed / 60:.1f} min, under {rules.min_judged_s / 60:g}: evidence only"
        return out, None
    how = "" if judged else f"; early fail: its lower bound is over {rules.early_factor:g}x the band"
    return out, Measurement(band, value, f"the harness's own RSS rise after its first {rules.warmup_s:g} s "
                                         f"(from {ref:.1f} MB, {THEIL_SEN} over {span / 60:.1f} min){how}", interval)


def _with_context(verdict: Verdict, fits: list[_Fit], rules: Rules, measured: bool, n: int) -> Verdict:
    """Unless it failed, say in the reason what it did not weigh (units observed too briefly, growth
    not measured) and the steepest RSS growth seen."""
    if verdict.status is Status.FAIL:
        return verdict
    extra = []
    fitted = [f for f in fits if f.processes and f.slopes["rss_mb"].estimate is not None]
    if fitted:
        steep = max(fitted, key=lambda f: f.slopes["rss_mb"].estimate)
        slope = steep.slopes["rss_mb"]
        extra.append(f"steepest RSS growth {steep.who} {slope.estimate:.3g} MB/h {slope.interval.brackets()}")
    short = [f.name for f in fits if f.processes and f.observed_s < rules.min_judged_s]
    if short:
        extra.append(f"{', '.join(short[:4])}{', ...' if len(short) > 4 else ''} observed under "
                     f"{rules.min_judged_s / 60:g} min: their growth is evidence only unless it is over "
                     f"{rules.early_factor:g}x the limit")
    if n and not measured:
        extra.append("no process readings: growth not measured")
    if extra:
        verdict.add("note", text="; ".join(extra))
    return verdict


__all__ = ["ITEM", "MIN_JUDGED_S", "Rules", "leak_verdict"]
