"""6.1.4 on a cluster with router events (the bundled engine's admin API): prefill and decode workers
killed (SIGKILL) and hung (SIGSTOP) under continuous load, one fault at a time, each settled in the
router's events, reverted and served through again before the next.

:class:`RescheduleUnderLoad` drives it and returns a :class:`RescheduleRun` (fault marks, how each
worker came back, every request record, the router's events) for harness/checks/reschedule.py.

Every fault must happen under load, however long a restart takes on this machine; and no load run
may be stopped (SIGTERM cancels its in-flight requests, which the nothing-lost check would rightly
count as hung). So load comes in runs (:class:`ContinuousLoad`), a new one started, overlapping the
old one, before the old one would end inside the next fault's cycle; after the last fault every run
is finished (LoadRunner.finish: no new request, those in flight complete), not waited out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from harness.engine.pd.topology import Topology
from harness.errors import ProbeError
from harness.faults import FaultRunner, ProcessHang, ProcessKill, select_targets
from harness.engine.admin.models import EngineEvent, AdminWorker
from harness.probes.loadgen.load import LoadRunner
from harness.probes.client.records import RequestRecord
from harness.probes.workers.rejoin import Rejoin
from harness.evidence.fault_marks import FaultMark, affected_request_id, first_success_sent_after
from harness.scenarios.fault_marks import injection
from harness.waiting import WaitTimeoutError, wait_until
from harness.states import EventKind, PD_ROLES, WorkerHealth

log = logging.getLogger(__name__)

CYCLE_BUDGET_S = {"process_kill": 20.0, "process_hang": 8.0}  # first guesses; then the longest seen
LOAD_RUN_S = 60.0           # length of one load run (--load-duration overrides)
BUSY_WAIT_S = 3.0           # wait at most this long for the target to hold requests before the fault
SETTLE_TIMEOUT_S = 15.0     # watch the router this long for one fault's rescheduling to finish
REJOIN_TIMEOUT_S = 120.0    # a killed worker restarts and registers (27-65 s seen on a loaded 2-core machine)
SERVING_TIMEOUT_S = 90.0    # Locust start-up on a loaded 2-core machine
WATCH_FACTOR = 1.25         # a worker not served through is watched this many times rejoin_limit_s
KEEP_LOAD_S = 10.0          # while a restarted worker is awaited, load for at least this long more
POLL_S = 0.1                 # polling the admin API only observes; measurements use event timestamps

StartLoad = Callable[..., LoadRunner]  # the ``load`` fixture: LoadProfile overrides -> a started run


class RouterView(Protocol):
    """The router's worker table and event log (the ``timeline`` fixture)."""

    def workers(self) -> list[AdminWorker]: ...

    def events(self, since: int = 0, type: str | None = None) -> list[EngineEvent]: ...  # noqa: A002


def fault_plan(faults_per_kind: int, roles: Sequence[str] = PD_ROLES) -> list[tuple[str, str]]:
    """``faults_per_kind`` kills of each role, then as many hangs of each (the checklist's
    min_faults_per_kind applies to every kind), for the roles that have a survivor."""
    kills = [("process_kill", r) for _ in range(faults_per_kind) for r in PD_ROLES if r in roles]
    hangs = [("process_hang", r) for _ in range(faults_per_kind) for r in reversed(PD_ROLES) if r in roles]
    return kills + hangs


def lone_roles(workers: Sequence[AdminWorker]) -> dict[str, str]:
    """Roles with fewer than two workers, each with why it cannot be judged: a fault on its only
    worker leaves nothing to take over, so rescheduling can never happen there."""
    out = {}
    for role in PD_ROLES:
        ids = [w.id for w in workers if w.role == role]
        if len(ids) < 2:
            out[role] = (f"only one {role} worker ({ids[0]}): nothing can take over" if ids
                         else f"no {role} worker")
    return out


def make_fault(kind: str, worker: AdminWorker, topology: Topology | None) -> ProcessKill | ProcessHang:
    """The fault of ``kind`` on ``worker``; a kill restarts it through ``topology`` (none on an
    external cluster: nothing to restart with, the worker stays down, docs/clusters.md)."""
    if kind == "process_hang":
        return ProcessHang.from_worker(worker)
    if topology is None:
        return ProcessKill.from_worker(worker)
    topo = topology
    return ProcessKill.from_worker(worker, restart=lambda wid: topo.restart(wid),
                                   healthy=lambda wid: _health(topo.workers(), wid) == WorkerHealth.HEALTHY,
                                   healthy_timeout_s=REJOIN_TIMEOUT_S)


def _health(workers: Sequence[AdminWorker], worker_id: str) -> str | None:
    return next((w.health for w in workers if w.id == worker_id), None)


def wait_serving(run: LoadRunner, what: str = "the load") -> None:
    """Until ``run`` completed a request (its records file has a line)."""
    def served() -> bool:
        if run.records_path.exists() and run.records_path.stat().st_size > 0:
            return True
        if not run.running:
            raise ProbeError(f"{what} ended before it served a request",
                             fix=f"check the cluster answers; see the Locust log: {run.log_path}")
        return False

    try:
        wait_until(served, SERVING_TIMEOUT_S, POLL_S, what=f"{what} to serve a request")
    except WaitTimeoutError as exc:
        raise ProbeError(f"{what} served no request within {SERVING_TIMEOUT_S:.0f} s",
                         fix=f"check the cluster answers; see the Locust log: {run.log_path}") from exc


class ContinuousLoad:
    """Chained load runs (see the module doc); ``ensure(s)`` guarantees load for the next ``s``
    seconds, ``records()`` finishes every run (LoadRunner.finish: requests in flight end, nothing
    new is sent) and merges their records."""

    def __init__(self, start_load: StartLoad, run_s: float) -> None:
        self._start_load, self.run_s = start_load, run_s
        self.runs: list[LoadRunner] = []
        self.ends_at = 0.0  # monotonic time the newest run stops sending (conservative)

    def ensure(self, needed_s: float) -> None:
        if self.runs and self.ends_at - time.monotonic() >= needed_s:
            return
        run = self._start_load(duration_s=max(self.run_s, needed_s + 5.0), max_tokens=32)
        self.runs.append(run)
        wait_serving(run, f"load run {len(self.runs)}")
        # its clock started at least one request ago, so this end estimate errs early
        self.ends_at = time.monotonic() + run.profile.duration_s - 1.0

    def records(self) -> list[RequestRecord]:
        # the faults are done: finish every run now (no new request, the ones in flight end) rather
        # than wait out the rest of its duration
        records = [r for run in self.runs for r in run.finish()]
        return sorted(records, key=lambda r: r.start_wall_ns())

    def finish(self) -> None:
        """Finish every run (as :meth:`records` does) without reading a record back."""
        for run in self.runs:
            run.finish(read=False)

    def iter_records(self) -> Iterator[RequestRecord]:
        """Every record of the finished runs, one at a time (run by run, not in send order)."""
        for run in self.runs:
            yield from run.iter_records()

    def wait_success_after(self, wall: float) -> None:
        """Until a request sent after ``wall`` completed ok (or SETTLE_TIMEOUT_S passed: the
        measurement then says no request sent after the fault succeeded, the cluster's doing)."""
        self.ensure(SETTLE_TIMEOUT_S)

        def served() -> bool:
            for run in self.runs:
                try:
                    records = run.records()
                except ProbeError:  # a run that just started has written nothing yet
                    continue
                if first_success_sent_after(records, wall) is not None:
                    return True
            return False

        wait_until(served, SETTLE_TIMEOUT_S, 0.5, what="a request sent after the last fault to succeed",
                   on_timeout="return")


@dataclass
class RescheduleRun:
    """What :meth:`RescheduleUnderLoad.run` measured, for harness/checks/reschedule.py."""

    marks: list[FaultMark]
    rejoins: list[Rejoin]
    records: list[RequestRecord]     # every request of every load run, in start order
    events: list[EngineEvent]        # the router's whole event log after the last fault
    load_runs: list[LoadRunner]
    longest_cycle_s: dict[str, float]
    stopped: str | None = None       # why the plan ended early (a worker not back): a pass cannot rest on it


@dataclass
class RescheduleUnderLoad:
    """Kill and hang workers per ``plan`` ((kind, role) pairs) under continuous load, each fault
    settled, reverted and its worker served through before the next."""

    faults: FaultRunner
    router: RouterView
    start_load: StartLoad
    topology: Topology | None
    plan: list[tuple[str, str]]
    seed: int
    rejoin_limit_s: float
    load_run_s: float = LOAD_RUN_S
    cycle_s: dict[str, float] = field(default_factory=lambda: dict(CYCLE_BUDGET_S))  # longest seen, per kind

    def rehearse(self) -> None:
        """A dry run: each fault's plan printed by the fault runner, nothing signalled."""
        for i, (kind, role) in enumerate(self.plan):
            self.faults.inject(make_fault(kind, self._target(self.router.workers(), role, i), self.topology))
        self.faults.revert_all()

    def run(self) -> RescheduleRun:
        traffic = ContinuousLoad(self.start_load, self.load_run_s)
        seq = max([0] + [e["seq"] for e in self.router.events()])
        marks: list[FaultMark] = []
        rejoins: list[Rejoin] = []
        stopped: str | None = None
        for i, (kind, role) in enumerate(self.plan):
            traffic.ensure(self.cycle_s[kind])
            cycle_started = time.monotonic()
            target = self._target([w for w in self.router.workers() if w.healthy], role, i)
            self._wait_busy(target.id)
            fault = self.faults.inject(make_fault(kind, target, self.topology))
            injected = injection(self.faults, fault)
            marks.append(FaultMark(fault.fault_id, kind, target.id, role, injected.started_wall,
                                   inject_s=injected.duration_s))
            seq = self._wait_settled(target.id, seq)
            self.faults.revert(fault)  # a kill: restarted and registered; a hang: resumed
            rejoin = self.wait_served_through(target.id, seq, lambda: traffic.ensure(KEEP_LOAD_S))
            rejoins.append(rejoin)
            self.cycle_s[kind] = max(self.cycle_s[kind], time.monotonic() - cycle_started)
            if not rejoin.back:  # the cluster is not whole: the next fault would be judged on a broken cluster
                stopped = f"the plan stopped after {i + 1} of {len(self.plan)} faults: {rejoin.sentence()}"
                break
        # what the item measures after the last fault (a request sent after it served) must have had
        # its chance before the load is finished
        traffic.wait_success_after(marks[-1].wall)
        records = traffic.records()
        return RescheduleRun(marks, rejoins, records, self.router.events(), traffic.runs,
                             {k: round(v, 2) for k, v in self.cycle_s.items()}, stopped)

    def _target(self, workers: list[AdminWorker], role: str, i: int) -> AdminWorker:
        """The plan's i-th victim among ``workers`` (seeded: the same cluster gets the same choice)."""
        chosen = select_targets(workers, role, seed=self.seed + i)[0]
        return next(w for w in workers if w.id == chosen["id"])

    def _wait_busy(self, worker_id: str) -> None:
        """Up to BUSY_WAIT_S for the target to hold requests; the fault goes ahead either way."""
        if not wait_until(lambda: any(w.id == worker_id and w.active_requests > 0 for w in self.router.workers()),
                          BUSY_WAIT_S, POLL_S, what=f"requests on {worker_id}", on_timeout="return"):
            log.info("%s held no request after %.0f s; faulting it anyway", worker_id, BUSY_WAIT_S)

    def _wait_settled(self, worker_id: str, since_seq: int) -> int:
        """Until the router declared the worker down and every affected request was re-placed or
        failed (or SETTLE_TIMEOUT_S passed: the measurement then says what did not happen)."""
        last = since_seq
        seen: list[EngineEvent] = []

        def settled() -> bool:
            nonlocal last
            new = self.router.events(since=last)
            seen.extend(new)
            last = max([last] + [e["seq"] for e in new])
            down = next((e for e in seen if e["type"] == EventKind.WORKER_DOWN and e.get("worker") == worker_id), None)
            if down is None:
                return False
            pending = {affected_request_id(a) for a in down.get("affected", [])}
            return not pending - {e.get("request_id") for e in seen
                                  if e["type"] in (EventKind.RESCHEDULE, EventKind.RESCHEDULE_FAILED)}

        if not wait_until(settled, SETTLE_TIMEOUT_S, POLL_S,
                          what=f"the rescheduling after the fault on {worker_id}", on_timeout="return"):
            log.warning("rescheduling after the fault on %s did not settle within %.0f s", worker_id, SETTLE_TIMEOUT_S)
        return last

    def wait_served_through(self, worker_id: str, since_seq: int, keep_load: Callable[[], None]) -> Rejoin:
        """See :func:`wait_served_through`."""
        return wait_served_through(self.router, worker_id, since_seq, self.rejoin_limit_s, keep_load)


def wait_served_through(router: RouterView, worker_id: str, since_seq: int, limit_s: float,
                        keep_load: Callable[[], None] = lambda: None) -> Rejoin:
    """How ``worker_id`` came back after its revert: from when the router lists it healthy until
    the router serves through it (moves a request's KV through it: a ``kv_transfer`` event naming
    it), load kept flowing meanwhile. Watched past ``limit_s`` (WATCH_FACTOR x) so that a
    worker kept out shows as kept out for longer than the limit: a recovery finding under 6.1.4
    (harness/checks/reschedule.py rejoin_measurement)."""
    started = time.time()
    rejoin: Rejoin | None = None
    seq = since_seq
    while True:
        keep_load()
        now = time.time()
        if rejoin is None and _health(router.workers(), worker_id) == WorkerHealth.HEALTHY:
            rejoin = Rejoin(worker_id, limit_s, now, watched=["kv_transfer events of the router"],
                            kept_out_by="the router")
        if rejoin is not None:
            for e in router.events(since=seq, type=EventKind.KV_TRANSFER):
                seq = max(seq, e["seq"])
                if worker_id in (e.get("prefill"), e.get("decode")):
                    rejoin.serving_wall = rejoin.traffic_wall = max(e["wall_time"], rejoin.healthy_wall)
                    rejoin.seen_by = rejoin.watched[0]
                    break
        since = now - (rejoin.healthy_wall if rejoin is not None else started)
        if (rejoin is not None and rejoin.back) or since > limit_s * WATCH_FACTOR:
            break
        time.sleep(POLL_S * 2)
    if rejoin is None:  # never even listed healthy again: kept out at least as long as it was watched
        rejoin = Rejoin(worker_id, limit_s, started, watched=["the router's worker table"],
                        kept_out_by="the router")
    rejoin.watched_s = round(time.time() - rejoin.healthy_wall, 2)
    return rejoin
