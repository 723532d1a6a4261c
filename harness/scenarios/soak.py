"""A soak run: load for the whole duration while a seeded fault schedule (harness/scenarios/soak_schedule.py)
fires faults, overlapping within the blast radius, each held, reverted and watched until the cluster
serves through its worker again; the engine's processes sampled for leaks all along.

:class:`SoakUnderLoad` executes one :class:`~harness.scenarios.soak_schedule.SoakSchedule` on a
cluster seen through a :class:`~harness.scenarios.soak_view.SoakClusterView` (the bundled engine's
admin API and router events, or an external cluster's file, metrics and pid files) and returns a :class:`SoakRun` for
harness/checks/soak.py and harness/checks/leaks.py. Each scheduled fault runs in its own thread (its
inject, hold, revert and rejoin); the fault runner serialises injects and reverts, so a fault whose
slot comes while another is being reverted begins when that revert is done (its actual offset is
recorded beside the planned one). A failed revert stops the schedule at once: the run ends, the
fault runner's ledger holds it, and the plugin reports the cluster as possibly dirty (exit 4).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.engine.admin.models import EngineEvent
from harness.errors import FaultError, HarnessError, RevertError
from harness.faults import FaultRunner
from harness.probes.workers.leaks import LeakSampler
from harness.probes.machine_health import selfmem
from harness.probes.client.records import RequestRecord
from harness.evidence.soak import SoakOutcome
from harness.scenarios.fault_marks import injection
from harness.scenarios.reschedule import ContinuousLoad, StartLoad
from harness.evidence.soak import ScheduledFault
from harness.scenarios.soak_schedule import SoakSchedule
from harness.scenarios.soak_view import ROUTER_EVENTS, SoakClusterView

log = logging.getLogger(__name__)

SLOT_WAIT_S = 120.0       # a fault waits at most this long for its target to be healthy and out of other faults
LEAK_INTERVAL_S = 2.0


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
    judged_by: str = ROUTER_EVENTS    # how kills and hangs are judged (harness/scenarios/soak_view.py)
    kv_unmeasured: str | None = None  # why KV blocks in use could not be read, where they could not

    def iter_records(self) -> Iterator[RequestRecord]:
        """Every request of the run, one at a time from the load runs' files (never all in memory:
        judge them with harness/probes/client/record_digest.py)."""
        for run in self.load_runs:
            yield from run.iter_records()


@dataclass
class SoakUnderLoad:
    """The schedule run on ``view``'s cluster (harness/scenarios/soak_view.py: the bundled engine's admin
    API, or an external cluster's file, metrics and pid files) while ``start_load`` keeps load flowing."""

    faults: FaultRunner
    view: SoakClusterView
    start_load: StartLoad
    schedule: SoakSchedule
    rejoin_limit_s: float = 60.0
    out_dir: Path = Path(".")
    progress: Callable[[str], None] = lambda line: None
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _faulted: dict[str, int] = field(default_factory=dict, init=False, repr=False)   # worker id -> fault index
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _fatal: list[BaseException] = field(default_factory=list, init=False, repr=False)
    _events: list[EngineEvent] = field(default_factory=list, init=False, repr=False)   # view.new_events(), kept
    _threads: list[threading.Thread] = field(default_factory=list, init=False, repr=False)

    def run(self) -> SoakRun:
        sched = self.schedule
        selfmem.limit_arenas()   # a thread per fault: no arena per thread (harness/probes/machine_health/selfmem.py)
        idle_before = self.view.idle_kv()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        sampler = LeakSampler(self.view.leak_rows, self.out_dir / "leaks.jsonl", interval_s=LEAK_INTERVAL_S,
                              local=self.view.leak_local)
        traffic = ContinuousLoad(self.start_load, sched.duration_s + 60.0)
        outcomes = [SoakOutcome(sf) for sf in sched.faults]
        self.view.begin()
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
        idle_after = self.view.idle_kv()   # the sampler still runs: the drain is in its series
        if self._fatal:
            raise self._fatal[0]
        self._collect()
        return SoakRun(sched, outcomes, list(self._events), traffic.runs, started_wall, load_ended,
                       idle_before, idle_after, sampler.path, stopped, judged_by=self.view.judged_by,
                       kv_unmeasured=self.view.kv_unmeasured())

    def _collect(self) -> None:
        """The router's events since the last call, kept unless one per request (kv_transfer)."""
        self._events.extend(self.view.new_events())

    def _claim(self, sf: ScheduledFault) -> Any | None:
        """Wait until the target is healthy and no other fault holds it; claim it."""
        deadline = time.monotonic() + SLOT_WAIT_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            with self._lock:
                if sf.target not in self._faulted:
                    w = self.view.claim(sf.target)
                    if w is not None:
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
            fault = self.view.make(sf, worker)
            o.started_offset_s = round(time.monotonic() - t0, 2)
            seq = self.view.mark()
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
            o.rejoin = self.view.rejoin(sf, seq, self.rejoin_limit_s)
        except HarnessError as exc:
            o.error = o.error or f"{type(exc).__name__}: {exc}"
            log.warning("soak fault #%d (%s %s): %s", sf.index + 1, sf.kind, sf.target, exc)
        except Exception as exc:  # noqa: BLE001 -- one fault's bug must not leave the others unreverted
            o.error = f"{type(exc).__name__}: {exc}"
            log.exception("soak fault #%d (%s %s) crashed", sf.index + 1, sf.kind, sf.target)
        finally:
            with self._lock:
                self._faulted.pop(sf.target, None)
