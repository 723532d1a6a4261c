"""The test machine's health while suites measure: a sampler thread, and a summary per window.

Timing verdicts are only as good as the machine that measured them: a load generator that waits
for a CPU sends late and reads tokens late, so a starved test machine looks like a slow cluster.
Every ``interval_s`` the sampler records, from /proc (harness/probes/machine_health/procfs.py):

- CPU pressure: the stall microseconds of ``/proc/pressure/cpu`` (``some``, and ``full`` where the
  kernel has it) since the previous sample, so any window's stall share is exact; avg10 as context;
- the 1-minute load average;
- per group of processes (:data:`GROUPS`: Locust, the bundled engine, the fabric probes, this
  process) the CPU time used and the run-queue wait (runnable, waiting for a CPU) since the
  previous sample. Group members are found among the descendants of ``roots`` by their command
  line; a process that appears later (a restarted worker) counts from its birth, one that exits
  loses at most its last interval;
- its own timer lag: how late the sampler woke against the interval it asked for, the scheduling
  lag any process of this machine sees at that moment.

:meth:`MachineMonitor.window` sums the samples whose middle lies in a window; with the request
records of the window it adds the open-loop send lateness (scheduled vs actual send), which is
the load generator's own lag. Memory is bounded: a ring of ``max_samples`` samples.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from harness.stats import nearest_rank
from harness.errors import ProbeError
from harness.probes.machine_health import procfs

log = logging.getLogger(__name__)

GROUPS = {"load generator": "load_generator", "engine": "engine", "fabric probes": "fabric_probe",
          "harness": "harness"}  # group -> key prefix of its figures in a window summary
SERIES_KEYS = ("psi_some_pct", "steal_pct", "load_generator_wait_share_pct", "fabric_probe_wait_share_pct",
               "watched_wait_per_run_ms", "timer_lag_max_ms", "load_generator_cpu_pct", "runnable_per_cpu", "load1_max")


def group_of(argv: Sequence[str]) -> str | None:
    """Which group a descendant process belongs to, from its command line (None: not watched)."""
    if any(a == "locust" or a.endswith("/locust") for a in argv):
        return "load generator"  # `python -m locust ...` (harness.probes.loadgen.load.LoadRunner) and its forks
    if any(a.startswith("harness.engine") for a in argv):
        return "engine"  # the bundled cluster's router and workers
    if any(a.startswith("harness.fabric") for a in argv):
        return "fabric probes"  # raw TCP and KV-transfer probe ends of 6.1.1 / NIC flap / 6.1.5
    return None


def _label(pid: int, argv: Sequence[str]) -> str:
    name = argv[argv.index("--id") + 1] if "--id" in argv[:-1] else None
    if name is None and "-m" in argv[:-1]:
        name = argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
    return f"{name or (argv[0] if argv else '?')} (pid {pid})"


@dataclass(frozen=True, slots=True)
class Sample:
    """What happened between the previous sample and this one (``dt`` seconds ending at wall ``t``)."""

    t: float
    dt: float
    lag_ms: float
    load1: float | None
    runnable: int | None  # tasks runnable on the whole machine at the sample (the sampler not counted)
    psi_some_us: float | None
    psi_full_us: float | None
    psi_some_avg10: float | None
    steal_s: float | None  # CPU seconds (all CPUs) the hypervisor took (procfs.read_steal_seconds)
    cpu_s: dict[str, float]  # group -> CPU seconds (utime + stime) in the interval
    ran_s: dict[str, float]  # group -> seconds on a CPU (schedstat), the same in finer grain
    wait_s: dict[str, float]  # group -> seconds runnable but waiting for a CPU
    runs: dict[str, int]  # times the group's threads were put on a CPU
    processes: dict[str, int]
    engine_wait: tuple[tuple[str, float], ...]  # (process label, run-queue wait seconds)


class MachineMonitor:
    """Samples this machine every ``interval_s`` in a thread until :meth:`stop` (always joined);
    looks for new processes under ``roots`` (this process by default) every ``scan_every_s``."""

    def __init__(self, *, interval_s: float = 0.5, roots: Iterable[int] | None = None,
                 max_samples: int = 14_400, psi_path: os.PathLike | str = procfs.PSI_CPU,
                 scan_every_s: float = 2.0) -> None:
        if not 0.05 <= interval_s <= 60:
            raise ProbeError(f"machine sampling interval {interval_s!r} s is out of range",
                             fix="use 0.05 to 60 s (0.5 s by default)")
        self.interval_s = interval_s
        self.roots = list(roots) if roots is not None else [os.getpid()]
        self.cpus = os.cpu_count() or 1
        self._psi_path = Path(psi_path)
        self.psi_note: str | None = None
        self._samples: deque[Sample] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # pid -> (group, label, CPU s (utime+stime), on-CPU s, run-queue wait s, dispatches)
        self._procs: dict[int, tuple[str, str, float, float, float, int]] = {}
        self._prev_psi: procfs.Psi | None = None
        self._prev_steal: float | None = None
        self._prev_mono: float | None = None
        self._scan_every = max(1, round(scan_every_s / interval_s))  # samples between scans of the process tree
        self._samples_since_scan = 0
        self._scan_boot: float | None = None  # CLOCK_BOOTTIME of the latest scan, and of the one before
        self._last_scan_boot: float | None = None
        self._warned: set[str] = set()
        self.taken = 0  # samples taken so far (the ring keeps the last max_samples)

    # -- lifecycle --
    def start(self) -> MachineMonitor:
        if self._thread is not None:
            raise ProbeError("this machine monitor was already started", fix="create one monitor per session")
        self._take(0.0)  # the baseline every later sample is a difference from
        self._thread = threading.Thread(target=self._run, name="machine-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling and join the thread. Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> MachineMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        due = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            lag_s = time.monotonic() - due
            try:
                self._take(lag_s * 1000.0)
            except Exception as exc:  # noqa: BLE001 -- a sampler must never take the run down
                self._warn_once(f"machine sample failed: {exc!r}")
            due += self.interval_s
            if due < time.monotonic():  # fell behind (a starved machine): no burst of late samples
                due = time.monotonic() + self.interval_s

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s", message)

    # -- one sample --
    def _read_psi(self) -> procfs.Psi | None:
        try:
            psi = procfs.read_psi(self._psi_path)
        except ProbeError as exc:
            self.psi_note = str(exc)
            self._warn_once(self.psi_note)
            return None
        if psi is None:
            self.psi_note = procfs.PSI_ABSENT
        return psi

    def _take(self, lag_ms: float) -> None:
        mono, wall = time.monotonic(), time.time()
        psi, steal = self._read_psi(), procfs.read_steal_seconds()
        cpu = {g: 0.0 for g in GROUPS}
        ran = {g: 0.0 for g in GROUPS}
        wait = {g: 0.0 for g in GROUPS}
        count = {g: 0 for g in GROUPS}
        runs = {g: 0 for g in GROUPS}
        engine: list[tuple[str, float]] = []
        for pid, group, label in self._members():
            stat, sched = procfs.cpu_and_start_seconds(pid), procfs.schedstat(pid)
            if stat is None or sched is None:
                continue  # exited between listing and reading
            now = (stat[0], *sched)
            if pid in self._procs:
                before = self._procs[pid][2:]
            elif self._last_scan_boot is not None and stat[1] >= self._last_scan_boot - 0.02:
                before = (0.0, 0.0, 0.0, 0)  # born since the last scan: all it used is in this sample
            else:
                before = now  # seen for the first time: the baseline
            self._procs[pid] = (group, label, *now)
            cpu_d, ran_d, wait_d, runs_d = (max(0, a - b) for a, b in zip(now, before))
            count[group] += 1
            cpu[group] += cpu_d
            ran[group] += ran_d
            wait[group] += wait_d
            runs[group] += int(runs_d)
            if group == "engine":
                engine.append((label, wait_d))
        prev_psi, self._prev_psi = self._prev_psi, psi
        prev_mono, self._prev_mono = self._prev_mono, mono
        prev_steal, self._prev_steal = self._prev_steal, steal
        if prev_mono is None:
            return  # the baseline
        some = full = None
        if psi is not None and prev_psi is not None:
            some = max(0, psi.some_total_us - prev_psi.some_total_us)
            if psi.full_total_us is not None and prev_psi.full_total_us is not None:
                full = max(0, psi.full_total_us - prev_psi.full_total_us)
        load = procfs.read_loadavg()
        sample = Sample(t=wall, dt=mono - prev_mono, lag_ms=lag_ms, load1=load[0] if load else None,
                        runnable=load[1] if load else None, psi_some_us=some,
                        psi_full_us=full, psi_some_avg10=psi.some_avg10 if psi else None,
                        steal_s=None if steal is None or prev_steal is None else max(0.0, steal - prev_steal), cpu_s=cpu, ran_s=ran,
                        wait_s=wait, runs=runs, processes=count, engine_wait=tuple(engine))
        with self._lock:
            self._samples.append(sample)
            self.taken += 1

    def _members(self) -> list[tuple[int, str, str]]:
        """(pid, group, label) of every watched process. The process tree is scanned every
        ~2 s (a scan reads every process of the machine); in between the known members are read.
        A descendant outside every group is looked at again at the next scan: a fork that has
        not exec'd yet still shows its parent's command line."""
        roots = [(root, "harness", f"harness (pid {root})") for root in self.roots]
        self._samples_since_scan += 1
        if self._samples_since_scan < self._scan_every and self._scan_boot is not None:
            return roots + [(pid, group, label) for pid, (group, label, *_) in self._procs.items()
                            if pid not in self.roots]
        self._samples_since_scan, self._last_scan_boot = 0, self._scan_boot
        self._scan_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        members, live = list(roots), set(self.roots)
        for root in self.roots:
            for pid in procfs.descendants(root):
                live.add(pid)
                if pid in self._procs:
                    members.append((pid, *self._procs[pid][:2]))
                elif (group := group_of(argv := procfs.cmdline(pid))) is not None:
                    members.append((pid, group, _label(pid, argv)))
        for gone in set(self._procs) - live:
            del self._procs[gone]
        return members

    # -- reading --
    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def window(self, start: float, end: float, records: Sequence[Any] | None = None) -> dict[str, Any]:
        """The machine's figures over wall-clock ``[start, end]`` (JSON-able); ``records``
        (RequestRecord) add the open-loop send lateness of the requests scheduled in it."""
        chosen = [s for s in self.samples() if start <= s.t - s.dt / 2 <= end]
        out = {"start": start, "end": end, **summarise(chosen, self.cpus), "psi_note": self.psi_note}
        out.update(send_lateness(records or [], start, end))
        return out

    def steal_spans(self, limit_pct: float, start: float | None = None) -> list[tuple[float, float]]:
        """:func:`steal_spans` of the samples taken since wall ``start`` (all by default)."""
        chosen = [s for s in self.samples() if s.steal_s is not None and (start is None or s.t - s.dt >= start)]
        return steal_spans(chosen, self.cpus, limit_pct)

    def series(self, max_points: int = 300) -> list[dict[str, Any]]:
        """The run's samples for a chart, merged into at most ``max_points`` consecutive buckets."""
        samples = self.samples()
        size = max(1, math.ceil(len(samples) / max(1, max_points)))
        out = []
        for i in range(0, len(samples), size):
            bucket = samples[i:i + size]
            figures = summarise(bucket, self.cpus)
            out.append({"t": bucket[-1].t, **{k: figures[k] for k in SERIES_KEYS}})
        return out


def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 2)


def summarise(samples: Sequence[Sample], cpus: int) -> dict[str, Any]:
    """Figures of consecutive samples: shares of the wall time they cover, in %. A group's CPU and
    wait shares are of one CPU (a process with two busy threads can show 200 %)."""
    seconds = sum(s.dt for s in samples)
    out: dict[str, Any] = {"samples": len(samples), "seconds": round(seconds, 3), "cpus": cpus}
    if not samples or seconds <= 0:
        return {**out, **{k: None for k in SERIES_KEYS}}
    psi = [s for s in samples if s.psi_some_us is not None]
    psi_s = sum(s.dt for s in psi)
    out["psi_some_pct"] = _pct(sum(s.psi_some_us or 0 for s in psi) / 1e6, psi_s) if psi else None
    full = [s for s in samples if s.psi_full_us is not None]
    out["psi_full_pct"] = _pct(sum(s.psi_full_us or 0 for s in full) / 1e6, sum(s.dt for s in full)) if full else None
    out["psi_some_avg10_max"] = max((s.psi_some_avg10 for s in psi if s.psi_some_avg10 is not None), default=None)
    stolen = [s for s in samples if s.steal_s is not None]
    # of the machine's CPU capacity (seconds x CPUs), the share the hypervisor gave to others
    out["steal_pct"] = _pct(sum(s.steal_s or 0 for s in stolen), sum(s.dt for s in stolen) * cpus) if stolen else None
    out.update(steal_burst(stolen, cpus))
    out["load1_max"] = max((s.load1 for s in samples if s.load1 is not None), default=None)
    runnable = [s.runnable for s in samples if s.runnable is not None]
    out["runnable_per_cpu"] = round(sum(runnable) / len(runnable) / cpus, 2) if runnable else None
    lags = [s.lag_ms for s in samples]
    out.update(timer_lag_p50_ms=round(nearest_rank(lags, 50), 2), timer_lag_p99_ms=round(nearest_rank(lags, 99), 2),
               timer_lag_max_ms=round(max(lags), 2))
    for group, key in GROUPS.items():
        present = [s for s in samples if s.processes.get(group)]
        out[f"{key}_processes"] = max((s.processes.get(group, 0) for s in samples), default=0)
        out[f"{key}_cpu_pct"] = _pct(sum(s.cpu_s[group] for s in present), seconds) if present else None
        out[f"{key}_wait_pct"] = _pct(sum(s.wait_s[group] for s in present), seconds) if present else None
        out.update(_waits(present, key, [group]))
    out.update(_waits(samples, "watched", list(GROUPS)))
    per_proc: dict[str, float] = {}
    for s in samples:
        for label, waited in s.engine_wait:
            per_proc[label] = per_proc.get(label, 0.0) + waited
    worst = max(per_proc, key=per_proc.__getitem__, default=None)
    out["engine_wait_max_pct"] = _pct(per_proc[worst], seconds) if worst else None
    out["engine_worst_process"] = worst
    return out


STEAL_BURST_SPAN_S = 5.0


def _steal_windows(samples: Sequence[Sample], cpus: int, span_s: float):
    """Each run of consecutive samples ending at a sample and just ``span_s`` long (the shortest tail
    that long): ``(start, end, pct)``, pct the share of the CPUs' capacity the hypervisor took in it."""
    j, stolen, covered = 0, 0.0, 0.0
    for s in samples:
        stolen, covered = stolen + (s.steal_s or 0.0), covered + s.dt
        while j < len(samples) and covered - samples[j].dt >= span_s:   # the shortest tail still span_s long
            stolen, covered = stolen - (samples[j].steal_s or 0.0), covered - samples[j].dt
            j += 1
        if covered >= span_s:
            yield samples[j].t - samples[j].dt, s.t, stolen / (covered * cpus) * 100


def steal_burst(samples: Sequence[Sample], cpus: int, span_s: float = STEAL_BURST_SPAN_S) -> dict[str, float | None]:
    """The largest share of the machine's CPU capacity the hypervisor took over any ``span_s`` of
    consecutive samples (``steal_burst_pct``) and when that span began (``steal_burst_start``, wall
    s): a burst the window's mean hides (2026-12-07: 20-50 % for 10-15 s inside a 115 s window whose
    mean was 3 %, and 6.2's TPOT p99 undecided by the exceedances it caused). None when the samples
    cover less than ``span_s`` or carry no steal reading."""
    best = max(_steal_windows(samples, cpus, span_s), key=lambda w: w[2], default=None)
    if best is None:
        return {"steal_burst_pct": None, "steal_burst_start": None}
    return {"steal_burst_pct": round(best[2], 2), "steal_burst_start": best[0]}


def steal_spans(samples: Sequence[Sample], cpus: int, limit_pct: float,
                span_s: float = STEAL_BURST_SPAN_S) -> list[tuple[float, float]]:
    """Wall-clock ``(start, end)`` spans, merged, covered by some ``span_s`` of consecutive samples
    in which the hypervisor took over ``limit_pct`` of the machine's CPU capacity: the times a
    request was timed in a steal burst (6.2 leaves such requests out, harness/checks/slo.py)."""
    spans: list[tuple[float, float]] = []
    for start, end, pct in _steal_windows(samples, cpus, span_s):
        if pct <= limit_pct:
            continue
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def _waits(samples: Sequence[Sample], key: str, groups: Sequence[str]) -> dict[str, float | None]:
    """Mean run-queue wait per dispatch (ms) and the share of runnable time spent waiting (%)."""
    wait = sum(s.wait_s[g] for s in samples for g in groups)
    ran = sum(s.ran_s[g] for s in samples for g in groups)
    runs = sum(s.runs[g] for s in samples for g in groups)
    return {f"{key}_wait_per_run_ms": round(1000 * wait / runs, 3) if runs else None,
            f"{key}_wait_share_pct": _pct(wait, wait + ran) if wait + ran > 0 else None}


def send_lateness(records: Sequence[Any], start: float, end: float) -> dict[str, Any]:
    """How late the open-loop load generator sent the requests it had scheduled in ``[start, end]``
    (sent minus scheduled, ms). Closed-loop requests have no schedule and are not counted."""
    late = [(r.sent_ns - r.scheduled_ns) / 1e6 for r in records
            if r.scheduled_ns is not None and r.sent_ns and start <= r.start_wall_ns() / 1e9 <= end]
    if not late:
        return {"send_lateness_n": 0, "send_lateness_p50_ms": None, "send_lateness_p99_ms": None}
    return {"send_lateness_n": len(late), "send_lateness_p50_ms": round(nearest_rank(late, 50), 2),
            "send_lateness_p99_ms": round(nearest_rank(late, 99), 2)}
