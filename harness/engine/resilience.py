"""The router's resilience control: degradation level and its actions, per-worker health scores
and the automatic Section 5.3 migrations, and the HBM-fill / ECC-poisoning fault hooks.

Every ``control_interval_s`` the loop reads the cluster's signals from the workers' heartbeats
(KV use with fill reservations included, queue depth, health score), steps the degradation
controller and applies what a level change means:

- L1+: admission control: a new request is answered 429 with Retry-After once
  ``l1_queue_cap`` requests already wait for a placement (``admit``);
- L2+: speculative decoding off on every worker (restored on the way down if it was on);
- L3+: KV offload on (``set_offload``, threshold 85 %) unless ``router.offload_enabled`` is false;
- L4+: max_tokens capped and long prompts cut to their last tokens, marked in the response;
- L5: new requests answered 503 while in-flight ones finish.

Workers that (re)join, or missed a command, are reconciled from their heartbeat: a worker that
still reports speculation on at L2+ is told again. A decode worker whose health score exceeds
the threshold sheds ``ceil(active x (score - 0.6))`` requests by live migration (if
``router.migration_enabled`` and ``router.auto_migrate``); its detector window then restarts,
so one bad trend is acted on once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from harness.engine.degradation import DegradationConfig, DegradationController, LevelChange, Signals
from harness.engine.health import DeltaHealthDetector, HealthConfig, HealthSnapshot, decide
from harness.engine.migration import MigrationManager
from harness.engine.protocol import GenerateRequest
from harness.errors import EngineError, InvalidRequestError, WorkerDeadError

if TYPE_CHECKING:
    from harness.engine.router import Router, Worker

log = logging.getLogger(__name__)

FAULT_REPLY_TIMEOUT_S = 10.0


class ResilienceControl:
    def __init__(self, router: "Router") -> None:
        cfg = router.config
        self.router = router
        self.degradation = DegradationController(
            DegradationConfig.from_dict({**cfg.degradation, "enabled": cfg.degradation_enabled}),
            on_change=self._apply)
        self.health_config = HealthConfig(**cfg.health)
        self.detectors: dict[str, DeltaHealthDetector] = {}
        self.migration = MigrationManager(router)
        self.faults: dict[str, dict[str, Any]] = {}          # fault id -> last fault_state, plus worker
        self._replies: dict[str, asyncio.Future] = {}
        self._spec_before: bool = False
        self._shedding: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self.counters = {"rejected_429": 0, "rejected_503": 0, "degraded_requests": 0, "auto_migrations": 0}

    # -- lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        for task in [self._task, *self._shedding.values()]:
            if task is not None:
                task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.router.config.control_interval_s)
            try:
                self.tick(time.monotonic())
            except Exception:  # the control loop must survive a bad heartbeat
                log.exception("resilience control step failed")

    def tick(self, now: float) -> LevelChange | None:
        change = self.degradation.evaluate(self.signals(), now)
        cfg = self.router.config
        if cfg.migration_enabled and cfg.auto_migrate:
            for wid, det in self.detectors.items():
                if det.should_migrate() and wid not in self._shedding:
                    self._shed(wid, det)
        return change

    # -- signals
    def decode_workers(self) -> list["Worker"]:
        return [w for w in self.router.workers.values() if w.role == "decode" and w.health == "healthy"]

    def signals(self) -> Signals:
        decodes = self.decode_workers()
        hbm = max((kv_used_ratio(w) for w in decodes), default=0.0)
        queue = self.router.waiting + sum(int(w.stats.get("num_waiting", 0)) for w in decodes)
        health = max(self.health_scores().values(), default=0.0)
        return Signals(hbm=hbm, queue=float(queue), health=health)

    def health_scores(self) -> dict[str, float]:
        return {wid: det.score() for wid, det in self.detectors.items()}

    # -- hooks called by the router
    def on_heartbeat(self, w: "Worker") -> None:
        if w.role != "decode":
            return
        self.detectors.setdefault(w.id, DeltaHealthDetector(self.health_config)).ingest(
            HealthSnapshot.from_stats(w.stats, time.monotonic()))
        self._reconcile(w)

    def on_message(self, w: "Worker", msg: dict) -> bool:
        """Consume fault and migration replies; False for messages of a request's stream."""
        if msg["type"] == "fault_state":
            fault_id = msg.get("fault_id", "")
            self.faults[fault_id] = {**msg, "worker": w.id}
            self.router.record_event("fault_state", worker=w.id, fault_kind=msg.get("kind"),
                                     **{k: v for k, v in msg.items() if k not in ("type", "kind")})
            fut = self._replies.pop(fault_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return True
        return self.migration.on_message(w, msg)

    def on_worker_lost(self, w: "Worker") -> None:
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
        """Admission under the current level: raises 429/503, or returns the (capped) request and
        the marker the response carries when Level 4 changed it."""
        level, c = self.degradation.level, self.degradation.config
        if level >= 5:
            self.counters["rejected_503"] += 1
            raise _retry_later(f"the cluster is at degradation Level 5 (circuit open): new requests are refused "
                               f"while in-flight ones finish; retry after {c.retry_after_s} s", 503, "circuit_open",
                               c.retry_after_s)
        if level >= 1 and self.router.waiting >= c.l1_queue_cap:
            self.counters["rejected_429"] += 1
            raise _retry_later(f"admission control (degradation Level {level}): {self.router.waiting} requests "
                               f"already wait for KV capacity (cap {c.l1_queue_cap}); retry after {c.retry_after_s} s",
                               429, "overloaded", c.retry_after_s)
        if level < 4:
            return request, None
        notes = []
        params, prompt = request.params, request.prompt_token_ids
        if params.max_tokens > c.l4_max_tokens:
            notes.append(f"max_tokens capped from {params.max_tokens} to {c.l4_max_tokens}")
            params = replace(params, max_tokens=c.l4_max_tokens)
        if len(prompt) > c.l4_max_prompt_tokens and not request.resume_token_ids:
            notes.append(f"context truncated from {len(prompt)} to its last {c.l4_max_prompt_tokens} tokens")
            prompt = prompt[-c.l4_max_prompt_tokens:]
        if not notes:
            return request, None
        self.counters["degraded_requests"] += 1
        marker = f"degradation Level {level}: " + "; ".join(notes)
        return replace(request, params=params, prompt_token_ids=list(prompt)), marker

    # -- level actions
    def _send_all(self, msg: dict) -> None:
        for w in self.router.workers.values():
            w.send(msg)

    def _apply(self, change: LevelChange) -> None:
        cfg, c = self.router.config, self.degradation.config
        a, b = change.from_level, change.to_level
        actions: dict[str, Any] = {}
        if a < 2 <= b:
            self._spec_before = any(bool(w.stats.get("spec_enabled")) for w in self.decode_workers())
            self._send_all({"type": "set_speculative", "enabled": False})
            actions["speculative"] = "off"
        elif b < 2 <= a:
            if self._spec_before:
                self._send_all({"type": "set_speculative", "enabled": True})
            actions["speculative"] = "restored" if self._spec_before else "stays off (was off before Level 2)"
        if a < 3 <= b:
            if cfg.offload_enabled:
                self._send_all({"type": "set_offload", "enabled": True, "threshold": cfg.offload_threshold})
                actions["offload"] = f"on (threshold {cfg.offload_threshold})"
            else:
                actions["offload"] = "NOT enabled: router.offload_enabled is false"
        elif b < 3 <= a:
            self._send_all({"type": "set_offload", "enabled": False, "threshold": cfg.offload_threshold})
            actions["offload"] = "off"
        if b >= 1:
            actions["admission_queue_cap"] = c.l1_queue_cap
        if b >= 4:
            actions["max_tokens_cap"] = c.l4_max_tokens
            actions["max_prompt_tokens"] = c.l4_max_prompt_tokens
        if b >= 5:
            actions["new_requests"] = "rejected (503)"
        self.router.record_event("degradation_level", **change.to_event(), actions=actions)

    def _reconcile(self, w: "Worker") -> None:
        level, cfg = self.degradation.level, self.router.config
        if level >= 2 and w.stats.get("spec_enabled"):
            w.send({"type": "set_speculative", "enabled": False})
        offload_on = w.stats.get("offload_enabled")
        if offload_on is not None and cfg.offload_enabled and bool(offload_on) != (level >= 3):
            w.send({"type": "set_offload", "enabled": level >= 3, "threshold": cfg.offload_threshold})

    # -- Section 5.3: shed load off a sick worker
    def _shed(self, worker_id: str, det: DeltaHealthDetector) -> None:
        w = self.router.workers.get(worker_id)
        if w is None or w.health != "healthy":
            return
        score = det.score()
        decision = decide(score, self.migration.candidates(w), self.migration.targets(w),
                          threshold=self.health_config.threshold, headroom=self.router.config.kv_headroom_factor)
        self.router.record_event("health_decision", worker=worker_id, score=round(score, 4),
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
    def _worker(self, worker_id: str, role: str = "decode") -> "Worker":
        w = self.router.workers.get(worker_id)
        if w is None or w.health != "healthy" or w.role != role:
            raise InvalidRequestError(f"no healthy {role} worker {worker_id!r}", param="worker", status=404)
        return w

    async def _ask(self, w: "Worker", fault_id: str, msg: dict) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self._replies[fault_id] = fut
        w.send(msg)
        try:
            return await asyncio.wait_for(fut, FAULT_REPLY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise WorkerDeadError(f"worker {w.id} did not answer {msg['type']} within {FAULT_REPLY_TIMEOUT_S:.0f} s") \
                from None
        finally:
            self._replies.pop(fault_id, None)

    async def hbm_fill(self, worker_id: str, share: Any, fault_id: str) -> dict:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
            raise InvalidRequestError(f"share must be a number in (0, 1), got {share!r}", param="share")
        w = self._worker(worker_id)
        self.router.record_event("fault_hook", worker=worker_id, fault_kind="hbm_fill", share=share,
                                 fault_id=fault_id)
        return await self._ask(w, fault_id, {"type": "hbm_fill", "fault_id": fault_id, "share": float(share)})

    async def ecc_poison(self, worker_id: str, count: Any, blocks: Any, fault_id: str) -> dict:
        msg: dict[str, Any] = {"type": "ecc_poison", "fault_id": fault_id}
        if blocks is not None:
            if not isinstance(blocks, list) or not blocks or not all(isinstance(b, int) and b >= 0 for b in blocks):
                raise InvalidRequestError(f"blocks must be a non-empty list of block ids, got {blocks!r}",
                                          param="blocks")
            msg["blocks"] = blocks
        else:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise InvalidRequestError(f"count must be a positive integer, got {count!r}", param="count")
            msg["count"] = count
        w = self._worker(worker_id)
        self.router.record_event("fault_hook", worker=worker_id, fault_kind="ecc_poison", fault_id=fault_id,
                                 **{k: v for k, v in msg.items() if k in ("count", "blocks")})
        return await self._ask(w, fault_id, msg)

    async def release(self, kind: str, fault_id: str) -> dict:
        """Undo an hbm_fill or ecc_poison fault; idempotent (an unknown or finished one answers inactive)."""
        state = self.faults.get(fault_id)
        if state is None or state.get("kind") != kind:
            raise InvalidRequestError(f"no {kind} fault {fault_id!r} (GET /admin/faults lists them)",
                                      param="fault_id", status=404)
        w = self.router.workers.get(state["worker"])
        if state.get("lost") or w is None or w.health != "healthy":
            return {**state, "active": False, "note": "the worker is gone; its fault went with it"}
        undo = {"hbm_fill": "hbm_release", "ecc_poison": "ecc_clear"}[kind]
        return await self._ask(w, fault_id, {"type": undo, "fault_id": fault_id})

    def public(self) -> dict[str, Any]:
        s = self.signals()
        return {**self.degradation.public(), "signals": {"hbm": round(s.hbm, 4), "queue": s.queue,
                                                         "health": round(s.health, 4)},
                "health_scores": {k: round(v, 4) for k, v in self.health_scores().items()},
                "counters": dict(self.counters), "migrations": dict(self.migration.counters),
                "migrating": len(self.migration.active), "draining": sorted(self.migration.draining)}


def kv_used_ratio(w: "Worker") -> float:
    """A worker's KV use, fill reservations included; derived from block counts for older workers."""
    ratio = w.stats.get("kv_used_ratio")
    if ratio is not None:
        return float(ratio)
    return w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 0.0


def _retry_later(message: str, status: int, code: str, retry_after: int) -> InvalidRequestError:
    exc = InvalidRequestError(message, status=status, code=code)
    exc.retry_after = retry_after  # the API answers it as a Retry-After header
    return exc


__all__ = ["ResilienceControl", "kv_used_ratio"]
