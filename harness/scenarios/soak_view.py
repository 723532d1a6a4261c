"""What the soak (harness/scenarios/soak.py) needs of a cluster, behind one small interface, with its
two implementations:

* :class:`AdminView`, the bundled engine: the admin API's worker table and the router's event log
  (health, pids, KV blocks, "worker down", KV moved through a worker), the topology to restart a
  killed worker, the fault hooks of the admin kinds (HBM fill, ECC poisoning) and the emulated fabric's
  hosts for NIC flaps and PFC storms;
* :class:`ExternalView`, any other cluster (vLLM, NVIDIA Dynamo, ...): the cluster file's ``workers:``
  only. A worker is healthy when its health URL answers 200; a fault is a black-box kill or hang of its
  process found afresh on its host by its ``process:`` entry (pid file, pgrep, systemd) through the
  host's executor, the kill brought back by its ``restart:`` command or its supervisor; after the revert
  it is back when the cluster serves through it again (harness/probes/workers/rejoin.py: its own metrics, or the
  router's view of it); leak readings come from /proc on its host and its engine's metrics
  (harness/probes/workers/external_leaks.py). There are no router events: the suite judges each kill and hang
  from the client's records (harness/checks/reschedule_blackbox.py), ``judged_by`` says so.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from harness.engine.admin.models import AdminWorker, EngineEvent
from harness.errors import FaultError
from harness.faults import EccPoison, Fault, HbmFill, NicFlap, PfcStorm, ProcessHang, ProcessKill
from harness.faults.fanout import NewProcess
from harness.probes.workers.external_leaks import ExternalLeakReader
from harness.probes.workers.inventory import health_url, is_healthy, resolve, wait_healthy
from harness.probes.workers.leaks import WorkerLeakReading
from harness.probes.workers.rejoin import Rejoin, RejoinWatch
from harness.scenarios.blackbox_faults import REJOIN_WATCH_MAX_S, RESTART_TIMEOUT_S
from harness.scenarios.reschedule import RouterView, make_fault, wait_served_through
from harness.evidence.soak import ScheduledFault
from harness.states import EventKind, WorkerHealth
from harness.waiting import wait_until

log = logging.getLogger(__name__)

HBM_SHARE = 0.8           # share of a decode worker's KV pool an hbm_fill reserves
ECC_BLOCKS = 2            # blocks one ecc_poison poisons
BUSY_WAIT_S = 3.0         # an ecc_poison waits this long for its worker to decode something
IDLE_TIMEOUT_S = 60.0     # after the load: until nothing is in flight, to read what each worker holds idle
ROUTER_EVENTS = "router events"
CLIENT_VIEW = "client view"


class SoakClusterView(Protocol):
    """The cluster as the soak sees it (see the module doc)."""

    judged_by: str          # how a kill or hang is judged: ROUTER_EVENTS or CLIENT_VIEW
    leak_local: bool        # the leak sampler reads /proc itself for the pids of ``leak_rows``

    def begin(self) -> None:
        """The run starts: note where the cluster's own logs are now."""

    def claim(self, worker_id: str) -> Any | None:
        """The worker when it is healthy now (what :meth:`make` takes), else None."""

    def make(self, sf: ScheduledFault, worker: Any) -> Fault:
        """The fault object of ``sf`` against the claimed ``worker``."""

    def mark(self) -> int:
        """Where the router's event log is now (0 without one): a fault's rejoin counts traffic after it."""

    def rejoin(self, sf: ScheduledFault, mark: int, limit_s: float) -> Rejoin:
        """After ``sf``'s revert: how its worker came back into the cluster's traffic."""

    def new_events(self) -> list[EngineEvent]:
        """The router's events since the last call, the per-request kv_transfer ones left out."""

    def idle_kv(self) -> dict[str, int]:
        """Each worker's KV blocks in use once nothing is in flight ({} when they cannot be read)."""

    def leak_rows(self) -> Sequence[AdminWorker | WorkerLeakReading]:
        """One leak-sampler tick's rows."""

    def kv_unmeasured(self) -> str | None:
        """Why KV blocks in use cannot be measured here (None: they can)."""

    def close(self) -> None:
        """Release what the view opened."""


@dataclass
class AdminView:
    """The bundled engine through its admin API (see the module doc)."""

    router: RouterView
    admin_url: str
    topology: Any = None                                             # restarts killed workers
    fabric_hosts: Mapping[str, Any] = field(default_factory=dict)    # worker id -> FabricHost
    judged_by: str = ROUTER_EVENTS
    leak_local: bool = True
    # the router's events as the run goes, per-request kv_transfer ones left out: its log keeps the
    # last 10000 (router max_events), and a 15-minute soak made 22668 requests, so a log read once at
    # the end had lost the early worker_down events (7 faults judged "never declared down")
    _seq: int = field(default=0, init=False, repr=False)

    def begin(self) -> None:
        self._seq = max([0] + [e["seq"] for e in self.router.events()])

    def claim(self, worker_id: str) -> AdminWorker | None:
        w = next((w for w in self.router.workers() if w.id == worker_id), None)
        return w if w is not None and w.healthy else None

    def make(self, sf: ScheduledFault, worker: AdminWorker) -> Fault:
        if sf.kind in ("process_kill", "process_hang"):
            return make_fault(sf.kind, worker, self.topology)
        if sf.kind == "hbm_fill":
            return HbmFill(admin_url=self.admin_url, worker_id=worker.id, share=HBM_SHARE)
        if sf.kind == "ecc_poison":   # poisoning needs blocks in use: wait a little for a decode
            wait_until(lambda: any(w.id == sf.target and w.busy for w in self.router.workers()), BUSY_WAIT_S,
                       0.05, what=f"requests on {sf.target}", on_timeout="return")
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

    def mark(self) -> int:
        return self._seq

    def rejoin(self, sf: ScheduledFault, mark: int, limit_s: float) -> Rejoin:
        # traffic through the worker counts from here: a fault that kept it in rotation (an HBM
        # fill, an ECC poisoning) had KV moved through it during its hold, which proves nothing
        seq = max([mark] + [e["seq"] for e in self.router.events(since=mark)])
        return wait_served_through(self.router, sf.target, seq, limit_s)

    def new_events(self) -> list[EngineEvent]:
        out = []
        for e in self.router.events(since=self._seq):
            self._seq = max(self._seq, e["seq"])
            if e["type"] != EventKind.KV_TRANSFER:
                out.append(e)
        return out

    def idle_kv(self) -> dict[str, int]:
        def idle() -> list[AdminWorker] | None:
            ws = self.router.workers()
            return ws if all(not w.busy for w in ws) else None

        workers = wait_until(idle, IDLE_TIMEOUT_S, 0.5, what="no request in flight on any worker",
                             on_timeout="return")
        if not workers:
            return {}
        return {w.id: w.kv_blocks_used for w in workers if w.health == WorkerHealth.HEALTHY}

    def leak_rows(self) -> list[AdminWorker]:
        return self.router.workers()

    def kv_unmeasured(self) -> str | None:
        return None

    def close(self) -> None:
        pass


IDLE_STEADY_READS = 3     # an external worker's KV figure unchanged this many reads in a row: drained


@dataclass
class ExternalView:
    """A cluster known from its cluster file (see the module doc). ``cluster``: the session's
    ClusterHandle (workers, metric profile, auth); ``executor_for``: the fault runner's executors."""

    cluster: Any
    executor_for: Callable[[str | None], Any]
    judged_by: str = CLIENT_VIEW
    leak_local: bool = False
    poll_s: float = 1.0
    reader: ExternalLeakReader = field(init=False)

    def __post_init__(self) -> None:
        self.reader = ExternalLeakReader(self.workers, self.executor_for, self.cluster.spec.metric_profile,
                                         headers=self.cluster.auth_headers())

    @property
    def workers(self) -> tuple[Any, ...]:
        """The inventory's workers whose process can be found (``process:``): the others cannot be faulted."""
        return tuple(w for w in self.cluster.workers if w.process is not None)

    def begin(self) -> None:
        pass

    def _spec(self, worker_id: str) -> Any:
        return next(w for w in self.workers if str(w.name) == worker_id)

    def claim(self, worker_id: str) -> Any | None:
        spec = self._spec(worker_id)
        return spec if is_healthy(health_url(spec)) else None

    def make(self, sf: ScheduledFault, worker: Any) -> Fault:
        which = "process" if sf.kind == "process_kill" else "hang_process"
        found = resolve([worker], self.executor_for, which=which)[0]   # pids change at every restart
        if sf.kind == "process_hang":
            return ProcessHang.from_worker(found.as_target())
        if sf.kind != "process_kill":
            raise FaultError(f"{sf.kind} cannot be injected on an external cluster (no admin API, no fabric)",
                             fix="schedule only process_kill and process_hang (harness/scenarios/soak_schedule.py)")
        if not worker.restartable:
            raise FaultError(f"process_kill would leave {worker.name} down: no `restart:` and not `supervised: true`",
                             fix="give the worker a way back in the cluster file, or leave kills out")
        # no rejoin hook here: the runner serialises reverts, and the soak watches the way back after it
        return ProcessKill.from_worker(found.as_target(), restart_cmd=found.restart_cmd, supervised=found.supervised,
                                       healthy_url=found.health_url, healthy_timeout_s=RESTART_TIMEOUT_S,
                                       healthy=NewProcess(worker, found, self.executor_for(found.host)).answers)

    def mark(self) -> int:
        return 0

    def rejoin(self, sf: ScheduledFault, mark: int, limit_s: float) -> Rejoin:
        del mark   # no router log: the worker's own metrics (or the router's view of it) show its traffic
        spec = self._spec(sf.target)
        started = time.time()
        if wait_healthy(health_url(spec), RESTART_TIMEOUT_S) is None:   # a resumed worker that never answers again
            return Rejoin(sf.target, limit_s, started, watched=[f"{health_url(spec)} (never answered 200)"],
                          watched_s=round(time.time() - started, 2))
        watch = RejoinWatch.for_worker(self.cluster, spec, limit_s, restarted=sf.kind == "process_kill")
        try:
            result = watch.wait(limit_s)
            if result.observable and not result.back:   # a finding: learn how long past the limit
                result = watch.wait(max(REJOIN_WATCH_MAX_S, limit_s) - result.watched_s)
        finally:
            watch.close()
        return result

    def new_events(self) -> list[EngineEvent]:
        return []

    def idle_kv(self) -> dict[str, int]:
        """Once the load finished nothing of the harness's is in flight; a worker may still be freeing
        blocks, so its figure is taken once it read the same IDLE_STEADY_READS times in a row."""
        if self.reader.kv_families[0] is None:
            return {}
        history: list[dict[str, int]] = []

        def steady() -> list[dict[str, int]] | None:   # in a list: an empty figure ({}) is an answer too
            history.append(self.reader.kv_blocks())
            last = history[-IDLE_STEADY_READS:]
            return [last[-1]] if len(last) == IDLE_STEADY_READS and all(h == last[-1] for h in last) else None

        got = wait_until(steady, IDLE_TIMEOUT_S, self.poll_s, what="KV blocks in use to settle on every worker",
                         on_timeout="return")
        return got[0] if got else (history[-1] if history else {})

    def leak_rows(self) -> list[WorkerLeakReading]:
        return self.reader()

    def kv_unmeasured(self) -> str | None:
        return self.reader.kv_unmeasured

    def close(self) -> None:
        self.reader.close()


__all__ = ["AdminView", "CLIENT_VIEW", "ExternalView", "ROUTER_EVENTS", "SoakClusterView"]
