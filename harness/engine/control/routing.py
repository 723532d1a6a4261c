"""The router's state: the routing table (workers, the attempts placed on them, their counters)
and the event log.

``RoutingTable`` is the one owner of worker state. The router, resilience control, live
migration and degradation ask it (who is healthy, who has headroom, what runs where) and tell it
(placed, KV arrived, released, reserved for a migration, switched, worker lost); none of them
changes a worker's ``attempts``, ``queue_depth`` or ``reserved_blocks`` by hand. Counters:

- ``queue_depth``: prefill: attempts placed on it whose KV has not arrived yet; decode: attempts
  it decodes or holds a migration reservation for;
- ``reserved_blocks``: decode: KV blocks promised to those attempts (placement needs headroom
  over ``max(kv_blocks_used, reserved_blocks)``);
- ``attempts``: attempt ids the worker takes part in.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from harness.engine.control.codec import encode
from harness.engine.control.messages import Abort, Message, Tokens
from harness.engine.core.types import GenerateRequest
from harness.states import WorkerHealth, WorkerRole

log = logging.getLogger(__name__)


@dataclass
class WorkerLost:
    """Stream event (never on the wire): a worker the attempt depends on is gone, or a migration
    left the request nowhere."""
    worker: str
    reason: str
    at: float


@dataclass
class ClientAbort:
    """Stream event (never on the wire): the client went away; the attempt ends with an abort."""


class EventLog:
    """The router's event timeline (``/admin/events``): numbered, timestamped, bounded."""

    def __init__(self, max_events: int) -> None:
        self._events: deque[dict] = deque(maxlen=max_events)
        self._seq = itertools.count(1)

    def record(self, kind: str, **detail: Any) -> None:
        event = {"seq": next(self._seq), "type": kind, "wall_time": time.time(), "monotonic": time.monotonic(),
                 **detail}
        self._events.append(event)
        log.info("event %s", event)

    def __iter__(self) -> Iterator[dict]:
        return iter(list(self._events))

    def __len__(self) -> int:
        return len(self._events)


@dataclass
class RouterWorker:
    id: str
    role: WorkerRole
    pid: int
    kv_addr: tuple[str, int]
    control_addr: tuple[str, int]
    writer: asyncio.StreamWriter
    kv_blocks_total: int
    block_size: int
    health: WorkerHealth = WorkerHealth.HEALTHY
    down_reason: str | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)  # last message of any kind
    steps: int | None = None      # the worker's progress counter (None: it sends no progress beats)
    joined_wall: float = field(default_factory=time.time)
    queue_depth: int = 0          # see the module docstring; only RoutingTable changes the counters
    kv_blocks_used: int = 0       # as the worker reported it
    stats: dict = field(default_factory=dict)
    transfer: dict = field(default_factory=dict)
    attempts: set[str] = field(default_factory=set)  # attempt ids placed here
    reserved_blocks: int = 0

    def send(self, msg: Message) -> None:
        if self.health == WorkerHealth.HEALTHY and not self.writer.is_closing():
            self.writer.write(encode(msg))

    def free_blocks(self) -> int:
        return self.kv_blocks_total - max(self.kv_blocks_used, self.reserved_blocks)

    def kv_used_ratio(self) -> float:
        """KV use, fill reservations included; derived from block counts for older workers."""
        ratio = self.stats.get("kv_used_ratio")
        if ratio is not None:
            return float(ratio)
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def block_bytes(self) -> int:
        return int(self.stats.get("kv_block_bytes") or 0) or 1

    def public(self) -> dict:
        return {"id": self.id, "role": self.role, "pid": self.pid, "health": self.health,
                "down_reason": self.down_reason,
                "addresses": {"control": "%s:%d" % self.control_addr, "kv": "%s:%d" % self.kv_addr},
                "queue_depth": self.queue_depth,
                "active_requests": len(self.attempts),
                "kv_blocks_used": self.kv_blocks_used, "kv_blocks_total": self.kv_blocks_total,
                "kv_blocks_reserved": self.reserved_blocks,
                "kv_used_ratio": self.stats.get("kv_used_ratio"),
                "kv_blocks_poisoned": int(self.stats.get("kv_blocks_poisoned", 0)),
                "kv_blocks_quarantined": int(self.stats.get("kv_blocks_quarantined", 0)),
                "spec_enabled": bool(self.stats.get("spec_enabled")),
                "offload": self.stats.get("offload") or {},
                "offload_enabled": self.stats.get("offload_enabled"),
                "num_running": int(self.stats.get("num_running", 0)),
                "generation_tokens_total": int(self.stats.get("generation_tokens_total", 0)),
                "heartbeat_age_s": round(time.monotonic() - self.last_heartbeat, 3), "steps": self.steps,
                "joined_at": self.joined_wall, "transfer": self.transfer}


@dataclass
class Attempt:
    """One placement of a request: prefill worker, decode worker and the KV blocks reserved there."""
    id: str                 # "<request id>#<n>": stale messages of an earlier attempt never match
    prefill: str
    decode: str
    blocks: int
    inbox: asyncio.Queue    # (worker id, message) from the workers, WorkerLost, ClientAbort
    request: GenerateRequest | None = None
    streamed: list[int] = field(default_factory=list)  # the request's stream so far (shared list)
    kv_arrived: bool = False
    last_active: float = field(default_factory=time.monotonic)  # last token (migration victim order)
    last_worker: str | None = None                               # who sent the last token
    gaps: deque = field(default_factory=lambda: deque(maxlen=16))  # recent inter-token gaps, seconds
    pending: list[tuple[str, Tokens]] = field(default_factory=list)  # (worker, tokens) not yet in order

    @property
    def priority(self) -> int:
        return self.request.params.priority if self.request else 0

    @property
    def request_id(self) -> str:
        return self.id.rsplit("#", 1)[0]

    @property
    def number(self) -> int:
        """0 for the first placement, n for the n-th after a lost or hung worker."""
        return int(self.id.rsplit("#", 1)[1])


class RoutingTable:
    """Workers and attempts, and every change to their counters (see the module docstring)."""

    def __init__(self, kv_headroom_factor: float, readmit_delay_s: float = 0.0) -> None:
        self.headroom = kv_headroom_factor
        self.readmit_delay_s = readmit_delay_s
        self.held_out: dict[str, float] = {}  # worker id -> monotonic time it may get placements again
        self.workers: dict[str, RouterWorker] = {}
        self.attempts: dict[str, Attempt] = {}
        self.draining: set[str] = set()   # decode workers taking no new placements (planned drain)
        self.waiting = 0                  # requests waiting for a placement (the admission queue)

    # -- asking
    def healthy(self, role: WorkerRole | None = None) -> list[RouterWorker]:
        return [w for w in self.workers.values() if w.health == WorkerHealth.HEALTHY and role in (None, w.role)]

    def healthy_worker(self, worker_id: str | None, role: WorkerRole) -> RouterWorker | None:
        w = self.workers.get(worker_id) if worker_id is not None else None
        return w if w is not None and w.health == WorkerHealth.HEALTHY and w.role == role else None

    def serves(self, w: RouterWorker) -> bool:
        """Whether requests wait on ``w``: it decodes them, or their KV has yet to come from it."""
        return bool(self._serving(w))

    def _serving(self, w: RouterWorker) -> list[str]:
        # a request ``w`` only holds a reservation for, as the target of a live migration in
        # flight, keeps running on its source (the migration fails): it is not ``w``'s to serve
        return [a for a in w.attempts if (att := self.attempts.get(a)) is None
                or att.decode == w.id or (att.prefill == w.id and not att.kv_arrived)]

    def pick(self, blocks_needed: Callable[[int], int]) -> tuple[RouterWorker, RouterWorker, int] | str:
        """Seed 5.3: the least-queued prefill worker, and the least-loaded decode worker whose
        free KV exceeds ``headroom`` x the request's (``blocks_needed(block_size)``); or why none."""
        now = time.monotonic()
        placeable = [w for w in self.healthy() if self.held_out.get(w.id, 0.0) <= now]
        prefills = [w for w in placeable if w.role == WorkerRole.PREFILL]
        decodes = [w for w in placeable if w.role == WorkerRole.DECODE and w.id not in self.draining]
        if not prefills or not decodes:
            return f"{len(prefills)} healthy prefill and {len(decodes)} healthy decode workers"
        fits = []
        for w in decodes:
            need = blocks_needed(w.block_size)
            if w.free_blocks() > self.headroom * need:
                fits.append((len(w.attempts), w.id, w, need))
        if not fits:
            return "no decode worker has KV headroom of %.1fx the request's KV" % self.headroom
        _, _, decode, need = min(fits)
        prefill = min(prefills, key=lambda w: (w.queue_depth, w.id))
        return prefill, decode, need

    @contextlib.contextmanager
    def waiting_for_placement(self) -> Iterator[None]:
        """A request waits in the admission queue while inside (``waiting`` counts it)."""
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    # -- workers telling
    def join(self, worker: RouterWorker) -> RouterWorker | None:
        """Add (or replace a dead) worker; returns the one it replaced."""
        old = self.workers.get(worker.id)
        self.workers[worker.id] = worker
        if old is not None and self.readmit_delay_s > 0:
            self.held_out[worker.id] = time.monotonic() + self.readmit_delay_s
        return old

    def heard_from(self, w: RouterWorker) -> None:
        w.last_heartbeat = time.monotonic()

    def progress(self, w: RouterWorker, steps: int) -> None:
        w.steps = steps

    def heartbeat(self, w: RouterWorker, stats: dict, transfer: dict) -> None:
        w.stats, w.transfer = stats, transfer
        w.kv_blocks_used = stats.get("kv_blocks_used", 0)

    def lose(self, w: RouterWorker, reason: str, at: float) -> list[str]:
        """``w`` is dead: every attempt on it hears so. Returns the attempts it was serving."""
        w.health, w.down_reason = WorkerHealth.DEAD, reason
        serving = self._serving(w)
        for att_id in list(w.attempts):
            att = self.attempts.get(att_id)
            if att is not None:
                att.inbox.put_nowait(WorkerLost(w.id, reason, at))
        return sorted(serving)

    def lose_attempt(self, att: Attempt, worker_id: str, reason: str) -> None:
        """Nobody can say where ``att`` lives now: its stream reschedules it (re-prefill)."""
        att.inbox.put_nowait(WorkerLost(worker_id, reason, time.monotonic()))

    def set_draining(self, worker_id: str, draining: bool) -> None:
        """A drained decode worker takes no new placements (nor migration targets) until undrained."""
        (self.draining.add if draining else self.draining.discard)(worker_id)

    # -- attempts telling
    def place(self, att: Attempt) -> None:
        prefill, decode = self.workers[att.prefill], self.workers[att.decode]
        self.attempts[att.id] = att
        prefill.attempts.add(att.id)
        decode.attempts.add(att.id)
        decode.reserved_blocks += att.blocks
        prefill.queue_depth += 1
        decode.queue_depth += 1

    def kv_arrived(self, att: Attempt) -> None:
        if not att.kv_arrived:
            att.kv_arrived = True
            prefill = self.workers.get(att.prefill)
            if prefill is not None and att.id in prefill.attempts:
                prefill.attempts.discard(att.id)
                prefill.queue_depth -= 1

    def release(self, att: Attempt) -> bool:
        """The attempt ended: its workers' shares are freed and they are told to drop it
        (a no-op on a worker that already finished it). False if it was released before."""
        if self.attempts.pop(att.id, None) is None:
            return False
        for wid in (att.prefill, att.decode):
            w = self.workers.get(wid)
            if w is not None and att.id in w.attempts:
                w.attempts.discard(att.id)
                if wid == att.decode or not att.kv_arrived:
                    w.queue_depth -= 1
                w.send(Abort(att.id))
                if wid == att.decode:
                    w.reserved_blocks -= att.blocks
        return True

    # -- live migration telling
    def reserve_target(self, att: Attempt, target: RouterWorker) -> None:
        target.attempts.add(att.id)
        target.reserved_blocks += att.blocks
        target.queue_depth += 1

    def undo_target(self, att: Attempt, target: RouterWorker) -> None:
        if att.id in target.attempts:
            target.attempts.discard(att.id)
            target.reserved_blocks -= att.blocks
            target.queue_depth -= 1
            target.send(Abort(att.id))

    def switch(self, att: Attempt, source: RouterWorker, target: RouterWorker) -> None:
        """The route now points at the target; the source's share is released."""
        att.decode = target.id
        if att.id in source.attempts:
            source.attempts.discard(att.id)
            source.reserved_blocks -= att.blocks
            source.queue_depth -= 1


__all__ = ["Attempt", "ClientAbort", "EventLog", "RoutingTable", "RouterWorker", "WorkerLost"]
