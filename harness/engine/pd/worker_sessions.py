"""The router's side of the worker control connections: registration, the messages workers
send, and liveness.

A worker connects to the router's control port and sends ``Register``; a valid one joins the
routing table (a reconnecting worker replaces its dead entry, without a router restart) and gets
``Welcome``. Heartbeats, progress beats, fault and migration replies and a request's messages
arrive here and go to the routing table, resilience control, or the attempt they name. A broken
connection marks the worker dead at once; a silent one is marked dead after
``heartbeat_timeout_s`` (seed Section 5.1, layer 1), or after ``hang_timeout_s`` when it holds
requests it serves (``no_progress``, see ``_watch_heartbeats``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from harness.engine.control.codec import MessageError, encode, read_message
from harness.engine.control.messages import (Heartbeat, ImportFailed, ImportReady, Message, PrefillDone,
                                             PrefillFailed, Progress, Refused, Register, Tokens, TransferEvent,
                                             Welcome)
from harness.engine.control.routing import EventLog, RouterWorker, RoutingTable
from harness.engine.pd.router_config import RouterConfig
from harness.engine.resilience.control import ResilienceControl
from harness.states import PD_ROLES, EventKind, WorkerHealth, WorkerRole

log = logging.getLogger(__name__)


class WorkerSessions:
    """The control server and one session per connected worker (see the module docstring).
    ``capacity_changed`` is awaited when a worker joins (requests waiting for one may go on)."""

    def __init__(self, config: RouterConfig, table: RoutingTable, events: EventLog, resilience: ResilienceControl,
                 capacity_changed: Callable[[], Awaitable[None]]) -> None:
        self.config, self.table, self.events, self.resilience = config, table, events, resilience
        self._capacity_changed = capacity_changed
        self._server: asyncio.AbstractServer | None = None
        self._monitor: asyncio.Task | None = None
        self._conn_tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int, sock=None) -> tuple[str, int]:
        if sock is not None:
            self._server = await asyncio.start_server(self._on_connect, sock=sock)
        else:
            self._server = await asyncio.start_server(self._on_connect, host, port)
        self._monitor = asyncio.get_running_loop().create_task(self._watch_heartbeats())
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self._monitor:
            self._monitor.cancel()
        if self._server:
            self._server.close()
        for w in self.table.workers.values():
            w.writer.close()  # each connection task then reads EOF and ends by itself
        if self._conn_tasks:
            await asyncio.wait(list(self._conn_tasks), timeout=2.0)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conn_tasks.add(task)
        worker = None
        peer = "%s:%s" % (writer.get_extra_info("peername") or ("?", "?"))[:2]
        try:
            hello = await read_message(reader, peer)
            if not isinstance(hello, Register):
                if hello is not None:
                    log.warning("refused control connection from %s: it sent %s before register", peer, hello.TYPE)
                    writer.write(encode(Refused(f"the first message must be register, got {hello.TYPE}")))
                return
            if hello.role not in PD_ROLES:
                log.warning("refused worker %s from %s: role %r", hello.id, peer, hello.role)
                writer.write(encode(Refused(f"worker role {hello.role!r} is not prefill or decode")))
                return
            if any(w.id == hello.id for w in self.table.healthy()):
                writer.write(encode(Refused(f"worker id {hello.id} is already registered and healthy")))
                return
            worker = RouterWorker(hello.id, WorkerRole(hello.role), hello.pid, tuple(hello.kv_addr),
                                  tuple(hello.control_addr), writer, hello.kv_blocks_total, hello.block_size)
            old = self.table.join(worker)
            writer.write(encode(Welcome(self.config.heartbeat_interval_s, self.config.progress_interval_s)))
            self.events.record(EventKind.WORKER_UP, worker=worker.id, role=worker.role, pid=worker.pid,
                               rejoined=old is not None)
            await self._capacity_changed()
            while (msg := await read_message(reader, worker.id)) is not None:
                self._on_message(worker, msg)
            self._worker_lost(worker, "connection_lost")
        except MessageError as exc:  # the stream lost its framing: hang up
            log.warning("control connection from %s refused: %s", worker.id if worker else peer, exc)
            if worker is not None:
                self._worker_lost(worker, "protocol_error")
        except Exception:
            log.exception("control connection failed")
            if worker is not None:
                self._worker_lost(worker, "protocol_error")
        finally:
            writer.close()
            self._conn_tasks.discard(task)

    def _on_message(self, w: RouterWorker, msg: Message) -> None:
        if w.health != WorkerHealth.HEALTHY:
            return  # a worker declared dead stays dead until it reconnects
        self.table.heard_from(w)  # any message proves liveness
        if isinstance(msg, Progress):
            self.table.progress(w, msg.steps)
            return
        if isinstance(msg, Heartbeat):
            self.table.heartbeat(w, msg.stats, msg.transfer)
            self.resilience.on_heartbeat(w)
            return
        if self.resilience.on_message(w, msg):
            return  # a fault or migration reply, not part of a request's stream
        if isinstance(msg, TransferEvent):
            self.events.record(EventKind.of_transfer(msg.event), worker=w.id,
                               request_id=msg.rid.rsplit("#", 1)[0], **msg.detail)
            return
        if not isinstance(msg, (ImportReady, ImportFailed, PrefillDone, PrefillFailed, Tokens)):
            log.warning("refused a %s message from worker %s: workers do not send it", msg.TYPE, w.id)
            return
        att = self.table.attempts.get(msg.rid)
        if att is not None:
            att.inbox.put_nowait((w.id, msg))

    def _worker_lost(self, w: RouterWorker, reason: str, **detail) -> None:
        if w.health != WorkerHealth.HEALTHY:
            return
        # affected: the requests this worker was serving (their prefill, or their decode)
        affected = self.table.lose(w, reason, time.monotonic())
        self.resilience.on_worker_lost(w)
        self.events.record(EventKind.WORKER_DOWN, worker=w.id, role=w.role, pid=w.pid, reason=reason,
                           affected=affected, **detail)
        w.writer.close()  # a hung worker that wakes up finds its connection gone and rejoins

    async def _watch_heartbeats(self) -> None:
        """Declares silent workers down. Progress beats come from the worker's event loop, which runs
        while its engine thread is deep in a long prefill chunk (torch releases the GIL) but not
        under SIGSTOP, which stops every thread: so silence, not a still step counter, is the hang
        signal, and a slow but running worker is never a false alarm. Silence is only judged
        when this loop itself ran on time, since a stalled router has not read what was sent."""
        tick = min(0.1, self.config.heartbeat_interval_s / 4, self.config.progress_interval_s)
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            on_time, last = now - last < 3 * tick, now
            for w in list(self.table.workers.values()):
                if w.health != WorkerHealth.HEALTHY:
                    continue
                silent = now - w.last_heartbeat
                if silent > self.config.heartbeat_timeout_s:
                    self._worker_lost(w, "heartbeat_timeout", silent_s=round(silent, 4))
                elif (on_time and w.steps is not None and silent > self.config.hang_timeout_s
                      and self.table.serves(w)):
                    self._worker_lost(w, "no_progress", silent_s=round(silent, 4), steps=w.steps)


__all__ = ["WorkerSessions"]
