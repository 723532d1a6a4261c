"""Live KV migration of a running request between decode workers, router side (seed Section 3.1;
steps 4-6 of Section 5.3's decision flow).

One migration of attempt ``rid`` from ``source`` to ``target``:

1. reserve the request's KV blocks on the target and send it ``migrate_in`` (the request, the
   tokens streamed so far, ``num_tokens`` = prompt + those); the target prepares an import and
   answers ``migrate_ready`` (harness/engine/worker_migration.py is the worker side);
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
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from harness.engine.health import Candidate, TargetWorker, order_victims, pick_target
from harness.errors import EngineError, InvalidRequestError

if TYPE_CHECKING:
    from harness.engine.router import Router, Worker, _Attempt

log = logging.getLogger(__name__)

# worker -> router messages this module consumes (never handed to the attempt's stream)
MIGRATION_REPLIES = ("migrate_ready", "migrate_committed", "migrated", "migrate_failed")


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
    ready: asyncio.Future = field(repr=False)        # target: migrate_ready / migrate_failed
    done: asyncio.Future = field(repr=False)         # source: migrated / migrate_failed
    import_s: float | None = None                    # target: from migrate_in to commit


class MigrationManager:
    """Orchestrates migrations for one ``Router`` (see the module docstring)."""

    def __init__(self, router: "Router") -> None:
        self.router = router
        self.active: dict[str, MigrationState] = {}   # attempt id -> in-flight migration
        self.counters = {"completed": 0, "failed": 0, "timed_out": 0}
        self.draining: set[str] = set()

    # -- routing of worker replies (called from Router._on_message)
    def on_message(self, worker: "Worker", msg: dict) -> bool:
        """Consume a migration reply; False when ``msg`` is not one (the stream gets it)."""
        state = self.active.get(msg.get("rid", ""))
        kind = msg["type"]
        if state is None:
            return kind in MIGRATION_REPLIES  # a late reply of a finished migration: nothing to do
        if worker.id == state.target:
            if kind == "migrate_committed":
                state.import_s = msg.get("import_s")
            elif kind in ("migrate_ready", "migrate_failed"):
                _resolve(state.ready, msg)  # a target failure after ready also fails the source's send
            return kind in MIGRATION_REPLIES
        if worker.id == state.source and kind in ("migrated", "migrate_failed"):
            _resolve(state.done, msg)
            return True
        return kind in MIGRATION_REPLIES

    def on_worker_lost(self, worker_id: str) -> None:
        for state in self.active.values():
            if worker_id in (state.source, state.target):
                error = {"type": "migrate_failed", "error": f"worker {worker_id} was lost during the migration"}
                _resolve(state.ready, error)
                _resolve(state.done, error)

    def cancel(self, att: "_Attempt", how: str = "ended") -> None:
        """The attempt ends while migrating (``how``: finished, was lost: ..., ended): the migration
        is called off. A request that *finished* was moot to move, not a failed migration."""
        state = self.active.get(att.id)
        if state is not None:
            error = {"type": "migrate_failed", "error": f"the request {how} during the migration",
                     "finished": how == "finished"}
            _resolve(state.ready, error)
            _resolve(state.done, error)

    # -- choosing
    def candidates(self, source: "Worker") -> list[Candidate]:
        router = self.router
        out = []
        for att_id in source.attempts:
            att = router.attempts.get(att_id)
            if att is None or att.decode != source.id or att.last_worker != source.id or att_id in self.active:
                continue  # not decoding here yet (no token streamed from this worker), or already moving
            if att.request.params.max_tokens - len(att.streamed) < MIN_TOKENS_LEFT:
                continue  # about to finish: moving it would cost more than it frees
            out.append(Candidate(att_id, att.priority, att.last_active, att.blocks * _block_bytes(source)))
        return out

    def targets(self, source: "Worker") -> list[TargetWorker]:
        return [TargetWorker(w.id, len(w.attempts), w.free_blocks() * _block_bytes(w))
                for w in self.router.workers.values()
                if w.role == "decode" and w.health == "healthy" and w.id != source.id and w.id not in self.draining]

    def _resolve_request(self, source: "Worker", request_id: str | None) -> "_Attempt":
        cands = self.candidates(source)
        if request_id is not None:
            match = [c for c in cands if c.request_id == request_id or c.request_id.rsplit("#", 1)[0] == request_id]
            if not match:
                raise InvalidRequestError(f"request {request_id!r} is not decoding on {source.id} (or is already "
                                          "migrating)", param="rid", status=404)
            return self.router.attempts[match[0].request_id]
        if not cands:
            raise InvalidRequestError(f"{source.id} has no decoding request to migrate", param="source",
                                      status=409, code="nothing_to_migrate")
        return self.router.attempts[order_victims(cands)[0].request_id]

    def _resolve_target(self, source: "Worker", att: "_Attempt", target: str | None) -> "Worker":
        router = self.router
        need = att.blocks * _block_bytes(source)
        if target is not None:
            w = router.workers.get(target)
            if w is None or w.role != "decode" or w.health != "healthy" or w.id == source.id:
                raise InvalidRequestError(f"target {target!r} is not a healthy decode worker other than the source",
                                          param="target", status=404)
            if w.free_blocks() * _block_bytes(w) <= router.config.kv_headroom_factor * need:
                raise InvalidRequestError(f"target {target} has too little free KV for {att.id} (needs "
                                          f"{router.config.kv_headroom_factor} x {need} bytes)", param="target",
                                          status=409, code="no_headroom")
            return w
        picked = pick_target(self.targets(source), need, router.config.kv_headroom_factor)
        if picked is None:
            raise InvalidRequestError(f"no decode worker has KV headroom of {router.config.kv_headroom_factor}x "
                                      f"{att.id}'s KV", param="target", status=409, code="no_headroom")
        return router.workers[picked.worker_id]

    # -- doing
    async def migrate(self, source: str, request_id: str | None = None, target: str | None = None,
                      reason: str = "admin") -> dict[str, Any]:
        """Migrate one decoding request off ``source``; returns the ``migration_done`` event.
        Raises InvalidRequestError for a refused request, MigrationFailed when it did not work."""
        router = self.router
        if not router.config.migration_enabled:
            raise InvalidRequestError("live migration is disabled in the cluster configuration "
                                      "(router.migration_enabled: false)", status=409, code="migration_disabled")
        src = router.workers.get(source)
        if src is None or src.role != "decode" or src.health != "healthy":
            raise InvalidRequestError(f"source {source!r} is not a healthy decode worker", param="source", status=404)
        att = self._resolve_request(src, request_id)
        tgt = self._resolve_target(src, att, target)
        loop = asyncio.get_running_loop()
        num_tokens = len(att.request.prompt_token_ids) + len(att.streamed)
        state = MigrationState(att.id, att.request.request_id, src.id, tgt.id, reason, time.monotonic(), num_tokens,
                               loop.create_future(), loop.create_future())
        self.active[att.id] = state
        tgt.attempts.add(att.id)
        tgt.reserved_blocks += att.blocks
        tgt.queue_depth += 1
        router.record_event("migration_started", request_id=state.request_id, source=src.id, target=tgt.id,
                            reason=reason, streamed_tokens=len(att.streamed))
        timeout = router.config.migration_timeout_s
        try:
            tgt.send({"type": "migrate_in", "rid": att.id, "request": _request_dict(att), "num_tokens": num_tokens,
                      "generated": list(att.streamed)})
            ready = await asyncio.wait_for(state.ready, timeout)
            if ready.get("finished"):
                raise _Finished(ready["error"])
            if ready["type"] != "migrate_ready":
                raise MigrationFailed(f"target {tgt.id} refused the import: {ready.get('error')}")
            src.send({"type": "migrate_out", "rid": att.id, "num_tokens": num_tokens,
                      "max_kv_tokens": ready.get("max_kv_tokens", num_tokens - 1), "target_id": tgt.id,
                      "target_kv": list(tgt.kv_addr),
                      "target_control": list(tgt.control_addr), "transfer": router.config.transfer})
            done = await asyncio.wait_for(state.done, timeout)
            if done.get("finished"):
                raise _Finished(done["error"])
            if done["type"] != "migrated":
                raise MigrationFailed(f"source {src.id} could not migrate {att.id}: {done.get('error')}")
        except asyncio.TimeoutError:
            self.counters["timed_out"] += 1
            self._undo_target(att, tgt)
            # nobody can say where the request lives now: reschedule it (re-prefill), never hang it
            att.inbox.put_nowait({"type": "worker_lost", "worker": src.id, "at": time.monotonic(),
                                  "reason": f"migration to {tgt.id} timed out after {timeout:.0f} s"})
            raise self._failed(state, f"no answer within {timeout:.1f} s; the request is rescheduled") from None
        except _Finished as exc:
            # the source decoded the request to its end before the handshake was done: nothing left
            # to move, and nothing failed (the caller asked too late)
            self._undo_target(att, tgt)
            self.counters["moot"] = self.counters.get("moot", 0) + 1
            router.record_event("migration_moot", request_id=state.request_id, source=src.id, target=tgt.id,
                                reason=reason, total_s=round(time.monotonic() - state.started, 6))
            raise InvalidRequestError(f"{state.request_id} finished on {src.id} before it could be migrated "
                                      f"({exc})", param="rid", status=409, code="request_finished") from None
        except MigrationFailed as exc:
            self._undo_target(att, tgt)
            raise self._failed(state, str(exc)) from None
        finally:
            self.active.pop(att.id, None)
        self._switch(att, src, tgt)
        self.counters["completed"] += 1
        event = {"request_id": state.request_id, "source": src.id, "target": tgt.id, "reason": reason,
                 "total_s": round(time.monotonic() - state.started, 6),
                 "num_tokens": num_tokens, "import_s": state.import_s,
                 **{k: done.get(k) for k in ("export_s", "transfer_s", "bytes", "path", "retries", "fallback",
                                               "extra_tokens")
                    if k in done}}
        router.record_event("migration_done", **event)
        return event

    async def drain(self, worker_id: str) -> dict[str, Any]:
        """Planned drain (rolling update): no new placements on the worker, then migrate every
        decoding request off it. The worker stays out of placement until ``undrain``."""
        router = self.router
        w = router.workers.get(worker_id)
        if w is None or w.role != "decode" or w.health != "healthy":
            raise InvalidRequestError(f"{worker_id!r} is not a healthy decode worker", param="worker", status=404)
        self.draining.add(worker_id)
        router.record_event("drain_started", worker=worker_id, active=len(w.attempts))
        moved, failed = [], []
        deadline = time.monotonic() + router.config.migration_timeout_s * 3
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
            if failed and not router.config.migration_enabled:
                break
        left = sorted(w.attempts)
        router.record_event("drain_done", worker=worker_id, migrated=len(moved), failed=len(failed), left=left)
        return {"worker": worker_id, "migrated": moved, "failed": failed, "left": left}

    def undrain(self, worker_id: str) -> dict[str, Any]:
        self.draining.discard(worker_id)
        self.router.record_event("drain_ended", worker=worker_id)
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
        self.router.record_event("migration_failed", **event)
        log.warning("migration of %s from %s to %s failed: %s", state.attempt_id, state.source, state.target, error)
        return MigrationFailed(f"migration of {state.request_id} from {state.source} to {state.target} failed: "
                               f"{error}")

    def _undo_target(self, att: "_Attempt", tgt: "Worker") -> None:
        if att.id in tgt.attempts:
            tgt.attempts.discard(att.id)
            tgt.reserved_blocks -= att.blocks
            tgt.queue_depth -= 1
            tgt.send({"type": "abort", "rid": att.id})

    def _switch(self, att: "_Attempt", src: "Worker", tgt: "Worker") -> None:
        """Step 5: the route now points at the target; the source's share is released."""
        att.decode = tgt.id
        if att.id in src.attempts:
            src.attempts.discard(att.id)
            src.reserved_blocks -= att.blocks
            src.queue_depth -= 1


def _resolve(fut: asyncio.Future, value: dict) -> None:
    if not fut.done():
        fut.set_result(value)


def _block_bytes(w: "Worker") -> int:
    return int(w.stats.get("kv_block_bytes") or 0) or 1


def _request_dict(att: "_Attempt") -> dict[str, Any]:
    req = att.request
    return {"request_id": att.id, "prompt_token_ids": list(req.prompt_token_ids), "params": asdict(req.params),
            "resume_token_ids": list(req.resume_token_ids), "arrival_time": req.arrival_time}


__all__ = ["MigrationFailed", "MigrationManager", "MigrationState"]
