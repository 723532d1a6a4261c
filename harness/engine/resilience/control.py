"""The router's resilience control: degradation level and its actions, per-worker health scores
and the automatic Section 5.3 migrations, and the HBM-fill / ECC-poisoning fault hooks.

Every ``control_interval_s`` the loop reads the cluster's signals from the routing table (KV use
with fill reservations included, queue depth, health score) and steps the degradation
controller; degradation.py's ``DegradationActions`` applies what a level change means
(admission control, speculation off, KV offload, caps, circuit open).

A decode worker whose health score exceeds the threshold sheds ``ceil(active x (score - 0.6))``
requests by live migration (if ``router.migration_enabled`` and ``router.auto_migrate``); its
detector window then restarts, so one bad trend is acted on once.

It holds no back-pointer to the router: it asks and tells the ``RoutingTable`` and records into
the ``EventLog``, like the migration manager and the degradation actions it owns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from harness.engine.resilience.degradation import DegradationActions, DegradationConfig, LevelChange, Signals
from harness.engine.resilience.health import DeltaHealthDetector, HealthConfig, HealthSnapshot, decide
from harness.engine.control.messages import (EccClearCommand, EccPoisonCommand, FaultStateReport, HbmFillCommand,
                                             HbmReleaseCommand, Message)
from harness.engine.resilience.migration import MigrationManager, MigrationSettings
from harness.engine.core.types import GenerateRequest
from harness.engine.control.routing import EventLog, RoutingTable, RouterWorker
from harness.errors import EngineError, InvalidRequestError, WorkerDeadError
from harness.states import EventKind, WorkerHealth, WorkerRole

log = logging.getLogger(__name__)

FAULT_REPLY_TIMEOUT_S = 10.0


class ResilienceSettings(MigrationSettings, Protocol):
    """The router settings resilience control reads (``RouterConfig`` has them)."""
    degradation_enabled: bool
    degradation: dict
    offload_enabled: bool
    offload_threshold: float
    auto_migrate: bool
    health: dict
    control_interval_s: float


class ResilienceControl:
    def __init__(self, config: ResilienceSettings, table: RoutingTable, events: EventLog) -> None:
        self.config, self.table, self.events = config, table, events
        self.actions = DegradationActions(
            DegradationConfig.from_dict({**config.degradation, "enabled": config.degradation_enabled}), table, events,
            offload_enabled=config.offload_enabled, offload_threshold=config.offload_threshold)
        self.degradation = self.actions.controller
        self.health_config = HealthConfig(**config.health)
        self.detectors: dict[str, DeltaHealthDetector] = {}
        self.migration = MigrationManager(config, table, events)
        self.faults: dict[str, dict[str, Any]] = {}          # fault id -> last fault_state, plus worker
        self._replies: dict[str, asyncio.Future] = {}
        self._shedding: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self.counters = {"auto_migrations": 0}

    # -- lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        for task in [self._task, *self._shedding.values()]:
            if task is not None:
                task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.control_interval_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # the control loop must survive a bad heartbeat
                log.exception("resilience control step failed")

    def tick(self, now: float) -> LevelChange | None:
        change = self.degradation.evaluate(self.signals(), now)
        cfg = self.config
        if cfg.migration_enabled and cfg.auto_migrate:
            for wid, det in self.detectors.items():
                if det.should_migrate() and wid not in self._shedding:
                    self._shed(wid, det)
        return change

    # -- signals
    def signals(self) -> Signals:
        decodes = self.table.healthy(WorkerRole.DECODE)
        hbm = max((w.kv_used_ratio() for w in decodes), default=0.0)
        queue = self.table.waiting + sum(int(w.stats.get("num_waiting", 0)) for w in decodes)
        health = max(self.health_scores().values(), default=0.0)
        return Signals(hbm=hbm, queue=float(queue), health=health)

    def health_scores(self) -> dict[str, float]:
        return {wid: det.score() for wid, det in self.detectors.items()}

    # -- hooks called by the router
    def on_heartbeat(self, w: RouterWorker) -> None:
        if w.role != WorkerRole.DECODE:
            return
        self.detectors.setdefault(w.id, DeltaHealthDetector(self.health_config)).ingest(
            HealthSnapshot.from_stats(w.stats, time.monotonic()))
        self.actions.reconcile(w)

    def on_message(self, w: RouterWorker, msg: Message) -> bool:
        """Consume fault and migration replies; False for messages of a request's stream."""
        if isinstance(msg, FaultStateReport):
            reply = msg.public()
            self.faults[msg.fault_id] = {**reply, "worker": w.id}
            self.events.record(EventKind.FAULT_STATE, worker=w.id, fault_kind=msg.kind,
                                     **{k: v for k, v in reply.items() if k not in ("type", "kind")})
            fut = self._replies.pop(msg.fault_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)
            return True
        return self.migration.on_message(w, msg)

    def on_worker_lost(self, w: RouterWorker) -> None:
        self.migration.on_worker_lost(w.id)
        self.detectors.pop(w.id, None)
        for fault_id, state in list(self.faults.items()):
            if state["worker"] == w.id:  # the process took its reservations and poisoned blocks with it
                state["active"] = False
                state["lost"] = True
                fut = self._replies.pop(fault_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(WorkerDeadError(f"worker {w.id} was lost before it answered"))

    def admit(self, request: GenerateRequest) -> tuple[GenerateRequest, str | None]:
        """Admission under the current degradation level (``DegradationActions.admit``)."""
        return self.actions.admit(request)

    # -- Section 5.3: shed load off a sick worker
    def _shed(self, worker_id: str, det: DeltaHealthDetector) -> None:
        w = self.table.healthy_worker(worker_id, WorkerRole.DECODE)
        if w is None:
            return
        score = det.score()
        decision = decide(score, self.migration.candidates(w), self.migration.targets(w),
                          threshold=self.health_config.threshold, headroom=self.config.kv_headroom_factor)
        self.events.record(EventKind.HEALTH_DECISION, worker=worker_id, score=round(score, 4),
                                 components={k: round(v, 4) for k, v in det.components().items()},
                                 evict_count=decision.evict_count,
                                 plans=[{"request": p.request_id, "target": p.target} for p in decision.plans],
                                 unplaced=decision.unplaced)
        if decision.plans or decision.evict_count:
            det.snapshots.clear()  # act on one bad trend once; the window refills from here
        # else: nothing could be moved right now (no running request to shed, say): keep the window,
        # so the trend is still seen at the next heartbeat instead of being forgotten.
        if decision.plans:
            task = asyncio.get_running_loop().create_task(self._run_plans(worker_id, decision.plans))
            self._shedding[worker_id] = task
            task.add_done_callback(lambda _t: self._shedding.pop(worker_id, None))

    async def _run_plans(self, worker_id: str, plans: list) -> None:
        for plan in plans:
            try:
                await self.migration.migrate(worker_id, plan.request_id, plan.target, reason=plan.reason)
                self.counters["auto_migrations"] += 1
            except EngineError as exc:
                log.warning("automatic migration off %s failed: %s", worker_id, exc)

    # -- fault hooks (admin API)
    def _worker(self, worker_id: str, role: WorkerRole = WorkerRole.DECODE) -> RouterWorker:
        w = self.table.healthy_worker(worker_id, role)
        if w is None:
            raise InvalidRequestError(f"no healthy {role} worker {worker_id!r}", param="worker", status=404)
        return w

    async def _ask(self, w: RouterWorker, fault_id: str, msg: Message) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._replies[fault_id] = fut
        w.send(msg)
        try:
            return await asyncio.wait_for(fut, FAULT_REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise WorkerDeadError(f"worker {w.id} did not answer {msg.TYPE} within {FAULT_REPLY_TIMEOUT_S:.0f} s") \
                from None
        finally:
            self._replies.pop(fault_id, None)

    async def hbm_fill(self, worker_id: str, share: Any, fault_id: str) -> dict:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise InvalidRequestError(f"share must be a number in (0, 1), got {share!r}", param="share")
        w = self._worker(worker_id)
        self.events.record(EventKind.FAULT_HOOK, worker=worker_id, fault_kind="hbm_fill", share=share,
                                 fault_id=fault_id)
        return await self._ask(w, fault_id, HbmFillCommand(fault_id, float(share)))

    async def ecc_poison(self, worker_id: str, count: Any, blocks: Any, fault_id: str) -> dict:
        msg = EccPoisonCommand(fault_id)
        if blocks is not None:
            if not isinstance(blocks, list) or not blocks or not all(isinstance(b, int) and b >= 0 for b in blocks):
                raise InvalidRequestError(f"blocks must be a non-empty list of block ids, got {blocks!r}",
                                          param="blocks")
            msg.blocks = blocks
        else:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InvalidRequestError(f"count must be a positive integer, got {count!r}", param="count")
            msg.count = count
        w = self._worker(worker_id)
        self.events.record(EventKind.FAULT_HOOK, worker=worker_id, fault_kind="ecc_poison", fault_id=fault_id,
                                 **{k: v for k, v in (("count", msg.count), ("blocks", msg.blocks)) if v is not None})
        return await self._ask(w, fault_id, msg)

    async def release(self, kind: str, fault_id: str) -> dict:
        """Undo an hbm_fill or ecc_poison fault; idempotent (an unknown or finished one answers inactive)."""
        state = self.faults.get(fault_id)
        if state is None or state.get("kind") != kind:
            raise InvalidRequestError(f"no {kind} fault {fault_id!r} (GET /admin/faults lists them)",
                                      param="fault_id", status=404)
        w = self.table.workers.get(state["worker"])
        if state.get("lost") or w is None or w.health != WorkerHealth.HEALTHY:
            return {**state, "active": False, "note": "the worker is gone; its fault went with it"}
        undo = {"hbm_fill": HbmReleaseCommand, "ecc_poison": EccClearCommand}[kind]
        return await self._ask(w, fault_id, undo(fault_id))

    def public(self) -> dict[str, Any]:
        s = self.signals()
        return {**self.degradation.public(), "signals": {"hbm": round(s.hbm, 4), "queue": s.queue,
                                                         "health": round(s.health, 4)},
                "health_scores": {k: round(v, 4) for k, v in self.health_scores().items()},
                "counters": {**self.actions.counters, **self.counters}, "migrations": dict(self.migration.counters),
                "migrating": len(self.migration.active), "draining": sorted(self.table.draining),
                # which migrations are in flight and who asked: a caller waits for its own by request id
                "migrations_in_flight": [{"request_id": m.request_id, "source": m.source, "target": m.target,
                                          "reason": m.reason} for m in self.migration.active.values()]}


__all__ = ["ResilienceControl"]
