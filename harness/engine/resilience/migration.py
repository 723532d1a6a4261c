"""Live KV migration of a running request between decode workers, router side (seed Section 3.1;
steps 4-6 of Section 5.3's decision flow).

One migration of attempt ``rid`` from ``source`` to ``target``:

1. reserve the request's KV blocks on the target and send it ``migrate_in`` (the request, the
   tokens streamed so far, ``num_tokens`` = prompt + those); the target prepares an import and
   answers ``migrate_ready`` (harness/engine/resilience/worker_migration.py is the worker side);
2. send the source ``migrate_out`` with the same ``num_tokens`` and the target's KV addresses: it
   pauses the request, exports
   its blocks and state, sends them with the KV transfer sender (retries, fallback path,
   checksummed frames) and, once the target confirmed, frees them and reports ``migrated``
   (``migrate_failed`` leaves the request running on the source);
3. switch the route: the attempt's decode worker becomes the target, the source's reservation is
   released. Tokens of the attempt reach the router from whichever worker holds it; the router
   drops any it already streamed (by cumulative token count), so the client sees each token once.

A migration that neither completes nor fails within ``migration_timeout_s`` cannot be trusted to
have left the request anywhere: the attempt is treated as lost and rescheduled (re-prefill of
prompt + streamed tokens), so the stream still continues token-exactly. Callers: the health
decision flow, a planned drain (rolling update, Section 3.1 case 3) and ``POST /admin/migrate``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.engine.resilience.health import Candidate, TargetWorker, order_victims, pick_target
from harness.engine.control.messages import (MIGRATION_REPLIES, Message, MigrateCommitted, MigrateFailed, MigrateIn,
                                             MigrateOut, MigrateReady, Migrated, request_dict)
from harness.engine.control.routing import Attempt, EventLog, RoutingTable, RouterWorker
from harness.errors import EngineError, InvalidRequestError
from harness.states import EventKind, WorkerRole

log = logging.getLogger(__name__)

MIN_TOKENS_LEFT = 16  # a request this close to its max_tokens is not worth migrating


class MigrationFailed(EngineError):
    """A live migration did not complete; the request keeps running (or is rescheduled)."""


class _Finished(Exception):
    """The request finished on its source while the migration was being set up."""


@dataclass
class MigrationState:
    attempt_id: str
    request_id: str
    source: str
    target: str
    reason: str
    started: float                                   # monotonic
    num_tokens: int                                  # prompt + streamed tokens both sides agree on
    ready: asyncio.Future = field(repr=False)        # target: MigrateReady / MigrateFailed / _CalledOff
    done: asyncio.Future = field(repr=False)         # source: Migrated / MigrateFailed / _CalledOff
    import_s: float | None = None                    # target: from migrate_in to commit


@dataclass
class _CalledOff:
    """The router ended the migration: a worker was lost, or the request ended meanwhile."""
    error: str
    finished: bool = False  # the request finished on its source: moot, not failed


class MigrationSettings(Protocol):
    """The router settings live migration reads (``pd.router_config.RouterConfig`` has them; a
    protocol so that resilience does not import the router's package above it)."""
    kv_headroom_factor: float
    migration_enabled: bool
    migration_timeout_s: float
    transfer: dict


class MigrationManager:
    """Orchestrates migrations over the router's routing table (see the module docstring)."""

    def __init__(self, config: MigrationSettings, table: RoutingTable, events: EventLog) -> None:
        self.config, self.table, self.events = config, table, events
        self.active: dict[str, MigrationState] = {}   # attempt id -> in-flight migration
        self.counters = {"completed": 0, "failed": 0, "timed_out": 0}

    # -- routing of worker replies (called from WorkerSessions._on_message)
    def on_message(self, worker: RouterWorker, msg: Message) -> bool:
        """Consume a migration reply; False when ``msg`` is not one (the stream gets it)."""
        if not isinstance(msg, MIGRATION_REPLIES):
            return False
        state = self.active.get(msg.rid)
        if state is None:
            return True  # a late reply of a finished migration: nothing to do
        if worker.id == state.target:
            if isinstance(msg, MigrateCommitted):
                state.import_s = msg.import_s
            elif isinstance(msg, (MigrateReady, MigrateFailed)):
                _resolve(state.ready, msg)  # a target failure after ready also fails the source's send
        elif worker.id == state.source and isinstance(msg, (Migrated, MigrateFailed)):
            _resolve(state.done, msg)
        return True

    def on_worker_lost(self, worker_id: str) -> None:
        for state in self.active.values():
            if worker_id in (state.source, state.target):
                error = _CalledOff(f"worker {worker_id} was lost during the migration")
                _resolve(state.ready, error)
                _resolve(state.done, error)

    def cancel(self, att: Attempt, how: str = "ended") -> None:
        """The attempt ends while migrating (``how``: finished, was lost: ..., ended): the migration
        is called off. A request that *finished* was moot to move, not a failed migration."""
        state = self.active.get(att.id)
        if state is not None:
            error = _CalledOff(f"the request {how} during the migration", finished=how == "finished")
            _resolve(state.ready, error)
            _resolve(state.done, error)

    # -- choosing
    def candidates(self, source: RouterWorker) -> list[Candidate]:
        out = []
        for att_id in source.attempts:
            att = self.table.attempts.get(att_id)
            if att is None or att.decode != source.id or att.last_worker != source.id or att_id in self.active:
                continue  # not decoding here yet (no token streamed from this worker), or already moving
            if att.request.params.max_tokens - len(att.streamed) < MIN_TOKENS_LEFT:
                continue  # about to finish: moving it would cost more than it frees
            out.append(Candidate(att_id, att.priority, att.last_active, att.blocks * source.block_bytes()))
        return out

    def targets(self, source: RouterWorker) -> list[TargetWorker]:
        return [TargetWorker(w.id, len(w.attempts), w.free_blocks() * w.block_bytes())
                for w in self.table.healthy(WorkerRole.DECODE) if w.id != source.id and w.id not in self.table.draining]

    def _resolve_request(self, source: RouterWorker, request_id: str | None) -> Attempt:
        cands = self.candidates(source)
        if request_id is not None:
            match = [c for c in cands if c.request_id == request_id or c.request_id.rsplit("#", 1)[0] == request_id]
            if not match:
                raise InvalidRequestError(f"request {request_id!r} is not decoding on {source.id} (or is already "
                                          "migrating)", param="rid", status=404)
            return self.table.attempts[match[0].request_id]
        if not cands:
            raise InvalidRequestError(f"{source.id} has no decoding request to migrate", param="source",
                                      status=409, code="nothing_to_migrate")
        return self.table.attempts[order_victims(cands)[0].request_id]

    def _resolve_target(self, source: RouterWorker, att: Attempt, target: str | None) -> RouterWorker:
        headroom = self.config.kv_headroom_factor
        need = att.blocks * source.block_bytes()
        if target is not None:
            w = self.table.healthy_worker(target, WorkerRole.DECODE)
            if w is None or w.id == source.id:
                raise InvalidRequestError(f"target {target!r} is not a healthy decode worker other than the source",
                                          param="target", status=404)
            if w.free_blocks() * w.block_bytes() <= headroom * need:
                raise InvalidRequestError(f"target {target} has too little free KV for {att.id} (needs "
                                          f"{headroom} x {need} bytes)", param="target",
                                          status=409, code="no_headroom")
            return w
        picked = pick_target(self.targets(source), need, headroom)
        if picked is None:
            raise InvalidRequestError(f"no decode worker has KV headroom of {headroom}x "
                                      f"{att.id}'s KV", param="target", status=409, code="no_headroom")
        return self.table.workers[picked.worker_id]

    # -- doing
    async def migrate(self, source: str, request_id: str | None = None, target: str | None = None,
                      reason: str = "admin") -> dict[str, Any]:
        """Migrate one decoding request off ``source``; returns the ``migration_done`` event.
        Raises InvalidRequestError for a refused request, MigrationFailed when it did not work."""
        if not self.config.migration_enabled:
            raise InvalidRequestError("live migration is disabled in the cluster configuration "
                                      "(router.migration_enabled: false)", status=409, code="migration_disabled")
        src = self.table.healthy_worker(source, WorkerRole.DECODE)
        if src is None:
            raise InvalidRequestError(f"source {source!r} is not a healthy decode worker", param="source", status=404)
        att = self._resolve_request(src, request_id)
        tgt = self._resolve_target(src, att, target)
        loop = asyncio.get_running_loop()
        num_tokens = len(att.request.prompt_token_ids) + len(att.streamed)
        state = MigrationState(att.id, att.request.request_id, src.id, tgt.id, reason, time.monotonic(), num_tokens,
                               loop.create_future(), loop.create_future())
        self.active[att.id] = state
        self.table.reserve_target(att, tgt)
        self.events.record(EventKind.MIGRATION_STARTED, request_id=state.request_id, source=src.id, target=tgt.id,
                            reason=reason, streamed_tokens=len(att.streamed))
        timeout = self.config.migration_timeout_s
        try:
            tgt.send(MigrateIn(att.id, request_dict(att.request, att.id), num_tokens, list(att.streamed)))
            ready = await asyncio.wait_for(state.ready, timeout)
            if isinstance(ready, _CalledOff) and ready.finished:
                raise _Finished(ready.error)
            if not isinstance(ready, MigrateReady):
                raise MigrationFailed(f"target {tgt.id} refused the import: {ready.error}")
            src.send(MigrateOut(att.id, num_tokens, list(tgt.kv_addr), max_kv_tokens=ready.max_kv_tokens,
                                target_id=tgt.id, target_control=list(tgt.control_addr),
                                transfer=dict(self.config.transfer)))
            done = await asyncio.wait_for(state.done, timeout)
            if isinstance(done, _CalledOff) and done.finished:
                raise _Finished(done.error)
            if not isinstance(done, Migrated):
                raise MigrationFailed(f"source {src.id} could not migrate {att.id}: {done.error}")
        except asyncio.TimeoutError:
            self.counters["timed_out"] += 1
            self.table.undo_target(att, tgt)
            # nobody can say where the request lives now: reschedule it (re-prefill), never hang it
            self.table.lose_attempt(att, src.id, f"migration to {tgt.id} timed out after {timeout:.0f} s")
            raise self._failed(state, f"no answer within {timeout:.1f} s; the request is rescheduled") from None
        except _Finished as exc:
            # the source decoded the request to its end before the handshake was done: nothing left
            # to move, and nothing failed (the caller asked too late)
            self.table.undo_target(att, tgt)
            self.counters["moot"] = self.counters.get("moot", 0) + 1
            self.events.record(EventKind.MIGRATION_MOOT, request_id=state.request_id, source=src.id, target=tgt.id,
                                reason=reason, total_s=round(time.monotonic() - state.started, 6))
            raise InvalidRequestError(f"{state.request_id} finished on {src.id} before it could be migrated "
                                      f"({exc})", param="rid", status=409, code="request_finished") from None
        except MigrationFailed as exc:
            self.table.undo_target(att, tgt)
            raise self._failed(state, str(exc)) from None
        finally:
            self.active.pop(att.id, None)
        self.table.switch(att, src, tgt)
        self.counters["completed"] += 1
        event = {"request_id": state.request_id, "source": src.id, "target": tgt.id, "reason": reason,
                 "total_s": round(time.monotonic() - state.started, 6),
                 "num_tokens": num_tokens, "import_s": state.import_s,
                 **{k: getattr(done, k) for k in ("export_s", "transfer_s", "bytes", "path", "retries", "fallback",
                                                  "extra_tokens")}}
        self.events.record(EventKind.MIGRATION_DONE, **event)
        return event

    async def drain(self, worker_id: str) -> dict[str, Any]:
        """Planned drain (rolling update): no new placements on the worker, then migrate every
        decoding request off it. The worker stays out of placement until ``undrain``."""
        w = self.table.healthy_worker(worker_id, WorkerRole.DECODE)
        if w is None:
            raise InvalidRequestError(f"{worker_id!r} is not a healthy decode worker", param="worker", status=404)
        self.table.set_draining(worker_id, True)
        self.events.record(EventKind.DRAIN_STARTED, worker=worker_id, active=len(w.attempts))
        moved, failed = [], []
        deadline = time.monotonic() + self.config.migration_timeout_s * 3
        while time.monotonic() < deadline:
            cands = self.candidates(w)
            if not cands:
                if not w.attempts:
                    break
                await asyncio.sleep(0.05)  # requests still receiving their KV land here; wait for them
                continue
            results = await asyncio.gather(*(self._migrate_quietly(worker_id, c.request_id, "drain") for c in cands))
            for c, r in zip(cands, results):
                (moved if "error" not in r else failed).append({"request": c.request_id, **r})
            if failed and not self.config.migration_enabled:
                break
        left = sorted(w.attempts)
        self.events.record(EventKind.DRAIN_DONE, worker=worker_id, migrated=len(moved), failed=len(failed), left=left)
        return {"worker": worker_id, "migrated": moved, "failed": failed, "left": left}

    def undrain(self, worker_id: str) -> dict[str, Any]:
        self.table.set_draining(worker_id, False)
        self.events.record(EventKind.DRAIN_ENDED, worker=worker_id)
        return {"worker": worker_id, "draining": False}

    async def _migrate_quietly(self, source: str, request_id: str, reason: str) -> dict[str, Any]:
        try:
            return await self.migrate(source, request_id, reason=reason)
        except EngineError as exc:
            return {"error": str(exc)}

    def _failed(self, state: MigrationState, error: str) -> MigrationFailed:
        self.counters["failed"] += 1
        event = {"request_id": state.request_id, "source": state.source, "target": state.target,
                 "reason": state.reason, "error": error, "total_s": round(time.monotonic() - state.started, 6)}
        self.events.record(EventKind.MIGRATION_FAILED, **event)
        log.warning("migration of %s from %s to %s failed: %s", state.attempt_id, state.source, state.target, error)
        return MigrationFailed(f"migration of {state.request_id} from {state.source} to {state.target} failed: "
                               f"{error}")


def _resolve(fut: asyncio.Future, value: "Message | _CalledOff") -> None:
    if not fut.done():
        fut.set_result(value)


__all__ = ["MigrationFailed", "MigrationManager", "MigrationState"]
