"""A soak run: load for the whole duration while a seeded fault schedule (harness/scenarios/soak_schedule.py)
fires faults, overlapping within the blast radius, each held, reverted and watched until the router
serves through its worker again; the engine's processes sampled for leaks all along.

:class:`SoakUnderLoad` executes one :class:`~harness.scenarios.soak_schedule.SoakSchedule` on a
cluster with router events (the bundled engine's admin API) and returns a :class:`SoakRun` for
harness/checks/soak.py and harness/checks/leaks.py. Each scheduled fault runs in its own thread (its
inject, hold, revert and rejoin); the fault runner serialises injects and reverts, so a fault whose
slot comes while another is being reverted begins when that revert is done (its actual offset is
recorded beside the planned one). A failed revert stops the schedule at once: the run ends, the
fault runner's ledger holds it, and the plugin reports the cluster as possibly dirty (exit 4).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from harness.engine.admin.models import AdminWorker, EngineEvent
from harness.errors import FaultError, HarnessError, RevertError
from harness.faults import EccPoison, Fault, FaultRunner, HbmFill, NicFlap, PfcStorm
from harness.probes.leaks import LeakSampler
from harness.probes import selfmem
from harness.probes.records import RequestRecord
from harness.probes.rejoin import Rejoin
from harness.scenarios.fault_marks import FaultMark, injection
from harness.scenarios.reschedule import ContinuousLoad, RouterView, StartLoad, make_fault, wait_served_through
from harness.scenarios.soak_schedule import ScheduledFault, SoakSchedule
from harness.states import EventKind, WorkerHealth
from harness.waiting import wait_until

log = logging.getLogger(__name__)

HBM_SHARE = 0.8           # share of a decode worker's KV pool an hbm_fill reserves
ECC_BLOCKS = 2            # blocks one ecc_poison poisons
BUSY_WAIT_S = 3.0         # an ecc_poison waits this long for its worker to decode something
SLOT_WAIT_S = 120.0       # a fault waits at most this long for its target to be healthy and out of other faults
IDLE_TIMEOUT_S = 60.0     # after the load: until nothing is in flight, to read what each worker holds idle
LEAK_INTERVAL_S = 2.0


@dataclass
class SoakOutcome:
    """What happened to one scheduled fault."""

    fault: ScheduledFault
    started_offset_s: float | None = None   # when its inject began, from the start of the load
    fault_id: str | None = None
    inject_wall: float | None = None
    inject_s: float = 0.0
    reverted_wall: float | None = None
    rejoin: Rejoin | None = None
    detail: str = ""                        # the inject step's own words (what it did)
    not_injected: str | None = None         # why it never took effect (the harness's, not the cluster's)
    error: str | None = None                # the fault failed in a way that is the cluster's doing

    @property
    def injected(self) -> bool:
        return self.inject_wall is not None and self.not_injected is None

    def mark(self) -> FaultMark | None:
        if not self.injected or self.fault.kind not in ("process_kill", "process_hang"):
            return None
        return FaultMark(self.fault_id or "", self.fault.kind, self.fault.target, self.fault.role,
                         self.inject_wall or 0.0, inject_s=self.inject_s)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("fault", "rejoin")}
        d["fault"] = self.fault.to_dict()
        d["rejoin"] = None if self.rejoin is None else {
            "back": self.rejoin.back, "after_healthy_s": self.rejoin.after_healthy_s,
            "healthy_wall": self.rejoin.healthy_wall, "serving_wall": self.rejoin.serving_wall,
            "watched_s": self.rejoin.watched_s}
        return d


@dataclass
class SoakRun:
    """What :meth:`SoakUnderLoad.run` measured."""

    schedule: SoakSchedule
    outcomes: list[SoakOutcome]
    events: list[EngineEvent]
    load_runs: list[Any]
    started_wall: float
    load_ended_wall: float
    idle_before: dict[str, int]
    idle_after: dict[str, int]
    leak_samples_path: Path
    stopped: str | None = None        # why the schedule ended early
    notes: list[str] = field(default_factory=list)

    def iter_records(self) -> Iterator[RequestRecord]:
        """Every request of the run, one at a time from the load runs' files (never all in memory:
        judge them with harness/probes/record_digest.py)."""
        for run in self.load_runs:
            yield from run.iter_records()


@dataclass
class SoakUnderLoad:
    faults: FaultRunner
    router: RouterView
    start_load: StartLoad
    schedule: SoakSchedule
    admin_url: str
    topology: Any = None                      # restarts killed workers (bundled)
    fabric_hosts: Mapping[str, Any] = field(default_factory=dict)   # worker id -> FabricHost
    rejoin_limit_s: float = 60.0
    out_dir: Path = Path(".")
    progress: Callable[[str], None] = lambda line: None
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _faulted: dict[str, int] = field(default_factory=dict, init=False, repr=False)   # worker id -> fault index
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _fatal: list[BaseException] = field(default_factory=list, init=False, repr=False)
    _seq: int = field(default=0, init=False, repr=False)
    # the router's events as the run goes, per-request kv_transfer ones left out: its log keeps the
    # last 10000 (router max_events), and a 15-minute soak made 22668 requests, so a log read once at
    # the end had lost the early worker_down events (7 faults judged "never declared down")
    _events: list[EngineEvent] = field(default_factory=list, init=False, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False, repr=False)   # the router's newest event, polled by the main loop

    def make(self, sf: ScheduledFault, worker: AdminWorker) -> Fault:
        """The fault object of ``sf`` against the live ``worker``."""
        if sf.kind in ("process_kill", "process_hang"):
            return make_fault(sf.kind, worker, self.topology)
        if sf.kind == "hbm_fill":
            return HbmFill(admin_url=self.admin_url, worker_id=worker.id, share=HBM_SHARE)
        if sf.kind == "ecc_poison":
            return EccPoison(admin_url=self.admin_url, worker_id=worker.id, count=ECC_BLOCKS)
        host = self.fabric_hosts.get(worker.id)
        if host is None:
            raise FaultError(f"{sf.kind}: {worker.id} has no fabric host", fix="run the soak on a cluster with "
                             "the emulated fabric (fabric: {enabled: true}) or leave the fabric kinds out")
        if sf.kind == "nic_flap":
            return NicFlap.on_fabric_host(host, period_s=1.0, duty=0.5, count=max(1, math.ceil(sf.hold_s)))
        if sf.kind == "pfc_storm":
            return PfcStorm.on_fabric_hosts([host], pause_ms=300.0, resume_ms=100.0,
                                            bursts=max(1, int(sf.hold_s / 0.4)))
        raise FaultError(f"unknown soak fault kind {sf.kind}", fix="see harness/scenarios/soak_schedule.py KINDS")

    def idle_kv(self) -> dict[str, int]:
        """Each worker's KV blocks in use once nothing is in flight (waits up to IDLE_TIMEOUT_S)."""
        def idle() -> list[AdminWorker] | None:
            ws = self.router.workers()
            return ws if all(not w.busy for w in ws) else None

        workers = wait_until(idle, IDLE_TIMEOUT_S, 0.5, what="no request in flight on any worker",
                             on_timeout="return")
        if not workers:
            return {}
        return {w.id: w.kv_blocks_used for w in workers if w.health == WorkerHealth.HEALTHY}

    def run(self) -> SoakRun:
        sched = self.schedule
        selfmem.limit_arenas()   # a thread per fault: no arena per thread (harness/probes/selfmem.py)
        idle_before = self.idle_kv()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        sampler = LeakSampler(self.router.workers, self.out_dir / "leaks.jsonl", interval_s=LEAK_INTERVAL_S,
                              local=True)
        traffic = ContinuousLoad(self.start_load, sched.duration_s + 60.0)
        outcomes = [SoakOutcome(sf) for sf in sched.faults]
        self._seq = max([0] + [e["seq"] for e in self.router.events()])
        with sampler:
            try:
                return self._drive(sched, traffic, outcomes, sampler, idle_before)
            finally:   # however the run ends (an interrupt too), no fault thread begins another step,
                self._stop.set()   # and each one ends its hold and reverts before the runner's teardown
                for t in self._threads:
                    t.join(timeout=SLOT_WAIT_S)

    def _drive(self, sched: SoakSchedule, traffic: ContinuousLoad, outcomes: list[SoakOutcome], sampler: LeakSampler,
               idle_before: dict[str, int]) -> SoakRun:
        threads = self._threads
        stopped = None
        traffic.ensure(sched.duration_s)
        t0 = time.monotonic()
        started_wall = time.time()
        pending = list(outcomes)
        last_line = 0.0
        while time.monotonic() - t0 < sched.duration_s or any(t.is_alive() for t in threads):
            if self._fatal:
                stopped = f"stopped: {self._fatal[0]}"
                self._stop.set()
                break
            now = time.monotonic() - t0
            while pending and pending[0].fault.offset_s <= now:
                o = pending.pop(0)
                t = threading.Thread(target=self._lifecycle, args=(o, t0), name=f"soak-fault-{o.fault.index}",
                                     daemon=True)
                t.start()
                threads.append(t)
            traffic.ensure(min(30.0, max(5.0, sched.duration_s - now + 10.0)))
            self._collect()
            if now - last_line >= 10.0:
                last_line = now
                done = sum(o.reverted_wall is not None or o.not_injected is not None for o in outcomes)
                self.progress(f"soak +{now:.0f}/{sched.duration_s:.0f} s: {len(threads)}/{len(outcomes)} "
                              f"faults begun, {done} done, faulted now: "
                              f"{', '.join(sorted(self._faulted)) or 'none'}; {sampler.count} leak samples")
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=SLOT_WAIT_S + self.rejoin_limit_s * 2)
        traffic.finish()   # the records stay on disk: the suite streams them (SoakRun.iter_records)
        load_ended = time.time()
        idle_after = self.idle_kv()   # the sampler still runs: the drain is in its series
        if self._fatal:
            raise self._fatal[0]
        self._collect()
        return SoakRun(sched, outcomes, list(self._events), traffic.runs, started_wall, load_ended,
                       idle_before, idle_after, sampler.path, stopped)

    def _collect(self) -> None:
        """The router's events since the last call, kept unless one per request (kv_transfer)."""
        for e in self.router.events(since=self._seq):
            self._seq = max(self._seq, e["seq"])
            if e["type"] != EventKind.KV_TRANSFER:
                self._events.append(e)

    def _claim(self, sf: ScheduledFault) -> AdminWorker | None:
        """Wait until the target is healthy and no other fault holds it; claim it."""
        deadline = time.monotonic() + SLOT_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            with self._lock:
                if sf.target not in self._faulted:
                    w = next((w for w in self.router.workers() if w.id == sf.target), None)
                    if w is not None and w.healthy:
                        self._faulted[sf.target] = sf.index
                        return w
            time.sleep(0.2)
        return None

    def _lifecycle(self, o: SoakOutcome, t0: float) -> None:
        sf = o.fault
        worker = self._claim(sf)
        if worker is None:
            o.not_injected = f"{sf.target} was not healthy and free within {SLOT_WAIT_S:.0f} s"
            return
        try:
            if sf.kind == "ecc_poison":   # poisoning needs blocks in use: wait a little for a decode
                wait_until(lambda: any(w.id == sf.target and w.busy for w in self.router.workers()), BUSY_WAIT_S,
                           0.05, what=f"requests on {sf.target}", on_timeout="return")
            fault = self.make(sf, worker)
            o.started_offset_s = round(time.monotonic() - t0, 2)
            seq = self._seq
            if self._stop.is_set():
                o.not_injected = "the run stopped before its turn"
                return
            try:
                self.faults.inject(fault)
            except RevertError as exc:
                self._fatal.append(exc)
                return
            except FaultError as exc:   # reverted by the runner; the fault never held
                o.not_injected = str(exc)
                return
            rec = injection(self.faults, fault)
            o.fault_id, o.inject_wall, o.inject_s = fault.fault_id, rec.started_wall, rec.duration_s
            o.detail = rec.output
            self._stop.wait(sf.hold_s)
            try:
                self.faults.revert(fault)
            except RevertError as exc:
                o.error = f"revert failed: {exc}"
                self._fatal.append(exc)
                return
            o.reverted_wall = time.time()
            # traffic through the worker counts from here: a fault that kept it in rotation (an HBM
            # fill, an ECC poisoning) had KV moved through it during its hold, which proves nothing
            seq = max([seq] + [e["seq"] for e in self.router.events(since=seq)])
            o.rejoin = wait_served_through(self.router, sf.target, seq, self.rejoin_limit_s)
        except HarnessError as exc:
            o.error = o.error or f"{type(exc).__name__}: {exc}"
            log.warning("soak fault #%d (%s %s): %s", sf.index + 1, sf.kind, sf.target, exc)
        except Exception as exc:  # noqa: BLE001 -- one fault's bug must not leave the others unreverted
            o.error = f"{type(exc).__name__}: {exc}"
            log.exception("soak fault #%d (%s %s) crashed", sf.index + 1, sf.kind, sf.target)
        finally:
            with self._lock:
                self._faulted.pop(sf.target, None)
