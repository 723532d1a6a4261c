"""The engine-thread half of a PD worker: one EngineCore driven by one thread.

Every command from the router reaches the engine through ``submit``: a handler table maps each
message type (messages.py) to the method that runs it on the engine thread, in arrival order
(the core is single-threaded). KV receiver threads hand verified layers over the same queue
(``KVSink``: ``kv_layout``, ``kv_write``, ``kv_recv_into``, ``kv_complete``). Replies, tokens and
transfer reports leave through the ``publish`` callback the control session (worker.py) gives.
Live migration (worker_migration.py) talks to this half through the ``MigrationHost`` methods
(``bind_import``, ``take_import``, ``layout``, ``run_on_engine``, ``run_in_background``).
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore, ImportHandle
from harness.engine.kvtransfer.landing import ImportLanding
from harness.engine.control.messages import (FAULT_COMMANDS, Abort, CorruptFrames, Heartbeat, Import, ImportFailed,
                                             ImportReady, Message, MigrateIn, MigrateOut, Prefill, PrefillDone,
                                             PrefillFailed, SetOffloadCommand, SetSpeculativeCommand, Tokens,
                                             TransferEvent)
from harness.engine.kvtransfer.transfer import (PATH_CONTROL, PATH_FABRIC, Endpoint, KVLayout, KVReceiver, KVSender,
                                     TransferConfig, TransferStats)
from harness.engine.resilience.worker_faults import WorkerFaults, kv_block_faults, kv_used_ratio
from harness.engine.resilience.worker_migration import WorkerLiveMigration
from harness.engine.control.worker_stats import RecentWindow
from harness.errors import ConfigError, HarnessError
from harness.states import PD_ROLES, WorkerRole

log = logging.getLogger(__name__)
# Heartbeats go out every second; the p99 over the TPOT window sorts thousands of samples, which
# is too much to redo after every decode step of a small model.
STATS_REFRESH_S = 0.1
LEAK_MEMORY_CAP_BYTES = 1 << 30   # sabotage leak_kib_per_request: what one process keeps, at most


class WorkerEngine:
    def __init__(self, worker_id: str, role: str, engine_config: EngineConfig, *,
                 publish: Callable[[Message], None], on_failure: Callable[[], None]) -> None:
        if role not in PD_ROLES:
            raise ConfigError(f"worker role {role!r} is unknown", fix="use --role prefill or --role decode")
        self.id, self.role = worker_id, role
        self.publish = publish
        self._on_failure = on_failure
        self.core = EngineCore(engine_config)
        self.model = self.core.model_config
        self.transfer_stats = TransferStats()
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._imports: dict[str, ImportHandle] = {}   # decode: KV arriving
        self._layouts: dict[str, KVLayout] = {}
        self._jobs: deque[Prefill] = deque()          # prefill: queued requests
        self._senders: dict[str, KVSender] = {}       # prefill: transfers in flight
        self._corrupt_frames = 0                      # fault hook (admin API)
        self.leaked_blocks: list[int] = []            # sabotage: leak_kv_blocks_per_recovery
        self.leaked_memory: list[bytearray] = []      # sabotage: leak_kib_per_request ...
        self.leaked_fds: list[int] = []               # ... and one fd per finished request
        self._leaked_requests, self._leak_capped = 0, False
        self._finisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-finish")
        self.faults = WorkerFaults(self.core)
        self.landing = ImportLanding(self.core, self._cmds.put)  # KV frames land in the import's blocks
        self.migration = WorkerLiveMigration(self.core, self)
        self.window = RecentWindow()
        self._stats_cache: dict = self._stats()
        self._stats_at = time.monotonic()
        self.receiver: KVReceiver | None = None
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self.failed = False
        self.steps = 0  # engine steps and prefill layers done (progress beats carry it)
        # the command handler table: what each router command does, on the engine thread
        self._handlers: dict[type[Message], Callable] = {
            Import: self._import, Prefill: self._jobs_append, Abort: lambda m: self._abort(m.rid),
            SetSpeculativeCommand: lambda m: self.core.set_speculative(m.enabled),
            SetOffloadCommand: lambda m: self.core.set_offload(bool(m.enabled), m.threshold),
            **{kind: self._fault for kind in FAULT_COMMANDS},
            MigrateIn: self._migrate_in, MigrateOut: self.migration.migrate_out,
            CorruptFrames: self._arm_corrupt_frames,
        }

    # -- the control session's side
    def listen(self, kv_host: str, kv_port: int, control_host: str) -> tuple[tuple[str, int], tuple[str, int]]:
        """Decode: receive KV on the fabric address (primary path) and the control address
        (fallback path). Returns the (kv, control) addresses to register with."""
        if self.role != WorkerRole.DECODE:
            return (kv_host, 0), (control_host, 0)
        self.receiver = KVReceiver(self, self.transfer_stats)
        return (self.receiver.listen(kv_host, kv_port, PATH_FABRIC),
                self.receiver.listen(control_host, 0, PATH_CONTROL))

    def start(self) -> None:
        self._thread.start()

    def submit(self, msg: Message) -> None:
        """Queue a router command for the engine thread; a kind workers do not take is refused."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("refused a %s message: the router does not send it to workers", msg.TYPE)
            return
        self._cmds.put(lambda: handler(msg))

    def reset(self) -> None:
        """The control connection broke: drop every request (on the engine thread) before rejoining."""
        self._cmds.put(self._reset)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(self._stats_cache, self.transfer_stats.snapshot(), len(self._jobs) + len(self._senders))

    def stop(self) -> None:
        for sender in list(self._senders.values()):
            sender.cancel()
        self._cmds.put(None)
        self._thread.join(10)
        self._finisher.shutdown(wait=True, cancel_futures=True)
        if self.receiver:
            self.receiver.close()
        for fd in self.leaked_fds:   # the planted leak lasts while the worker runs, not past it
            os.close(fd)
        self.leaked_fds.clear()
        self.leaked_memory.clear()

    # -- MigrationHost (worker_migration.py)
    def run_on_engine(self, fn: Callable[[], None]) -> None:
        self._cmds.put(fn)

    def run_in_background(self, fn: Callable, *args) -> None:
        self._finisher.submit(fn, *args)

    def bind_import(self, tid: str, handle: ImportHandle, num_tokens: int) -> KVLayout:
        """Receiver thread: KV frames of transfer ``tid`` now land in ``handle`` (a migration's import)."""
        self._imports[tid] = handle
        layout = self._layouts[tid] = KVLayout(self.model.n_layers, num_tokens, self.model.n_kv_heads,
                                               self.model.head_dim, self.core.pool.storage.dtype)
        return layout

    def take_import(self, tid: str) -> ImportHandle | None:
        """Engine thread: the import of ``tid`` is being committed; no more frames land in it."""
        return self._imports.pop(tid, None)

    def layout(self, tid: str) -> KVLayout | None:
        return self._layouts.get(tid)

    # -- command handlers
    def _jobs_append(self, msg: Prefill) -> None:
        self._jobs.append(msg)

    def _fault(self, msg: Message) -> None:
        """A fault hook. The heartbeat's stats are refreshed BEFORE its fault_state goes out: a
        heartbeat the router reads after the reply must show the fault. With a cache up to
        STATS_REFRESH_S old, one sent just after an ECC poisoning said 0 quarantined blocks once the
        poisoning had been verified on the previous one's stale heartbeat (a false fail, issue 33)."""
        report = self.faults.handle(msg)
        self._stats_cache, self._stats_at = self._stats(), time.monotonic()
        self.publish(report)

    def _arm_corrupt_frames(self, msg: CorruptFrames) -> None:
        self._corrupt_frames = msg.corrupt_frames
        log.warning("fault hook armed: corrupt the next %d KV frames", self._corrupt_frames)

    # -- the engine thread
    def _engine_loop(self) -> None:
        try:
            self._engine_steps()
        except Exception:
            # Crash-only: a broken engine must not keep heartbeating while its requests hang.
            # Exiting closes the control connection, so the router reschedules them at once.
            log.exception("engine thread failed; worker %s exits", self.id)
            self.failed = True
            self._on_failure()

    def _engine_steps(self) -> None:
        stalled = False  # the last step did nothing and nothing runs: only a command can change that
        while True:
            busy = (self.core.has_work() and not stalled) or bool(self._jobs)
            try:
                cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=0.2)
            except queue.Empty:
                cmd = ...
            while cmd is not ...:
                if cmd is None:
                    return
                try:
                    cmd()
                except Exception:
                    log.exception("engine command failed")
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = ...
            if self._jobs:
                self._run_prefill(self._jobs.popleft())
            elif self.core.has_work():
                events = self.core.step()
                self.steps += 1
                # e.g. a request waiting for an HBM fill's release: idle instead of spinning a core
                stalled = not events and not self.core.scheduler.running
                for ev in events:
                    self.window.on_tokens(ev.request_id, len(ev.token_ids), ev.finished)
                    self.publish(Tokens(ev.request_id, list(ev.token_ids), ev.text, ev.finished,
                                        ev.finish_reason.value if ev.finish_reason else None,
                                        ev.num_output_tokens, ev.error))
                    if ev.finished:
                        self._leak_on_finish(ev.request_id)
            if time.monotonic() - self._stats_at >= STATS_REFRESH_S:
                self._stats_cache, self._stats_at = self._stats(), time.monotonic()

    def _stats(self) -> dict:
        """Heartbeat stats: the engine's plus the health detector's and degradation controller's inputs."""
        stats = asdict(self.core.stats())
        stats.update(kv_used_ratio=kv_used_ratio(self.core), **kv_block_faults(self.core),
                     tpot_p99_ms=self.window.tpot_p99_ms(),
                     # work this worker cannot start yet: waiting (or preempted) requests, queued
                     # prefills. KV imports in flight are not counted: every new request passes
                     # through one, so counting them made a load ramp from idle read as a
                     # worsening queue trend (health score) and migrated streams for nothing.
                     queue_depth=stats["num_waiting"] + len(self._jobs),
                     retrans_rate=self.window.retrans_rate(self.transfer_stats.snapshot()),
                     **self.core.offload_stats())
        return stats

    def _run_prefill(self, job: Prefill) -> None:
        rid = job.rid
        target = job.target
        sender = KVSender(rid, self.model.n_layers, Endpoint(*target["kv"], PATH_FABRIC),
                          Endpoint(*target["control"], PATH_CONTROL), TransferConfig.from_dict(job.transfer),
                          self.transfer_stats, corrupt_frames=self._corrupt_frames,
                          on_event=lambda kind, **d: self.publish(TransferEvent(rid, kind, d)))
        self._corrupt_frames = 0
        self._senders[rid] = sender
        t0 = time.perf_counter()
        try:
            result = self.core.prefill_for_transfer(job.request(), on_layer=lambda *a: self._layer_done(sender, *a))
        except Exception as exc:
            sender.cancel()
            self._senders.pop(rid, None)
            self.publish(PrefillFailed(rid, f"prefill: {exc}"))
            return
        self._finisher.submit(self._finish_transfer, rid, sender, result.first_token_id,
                              time.perf_counter() - t0)

    def _layer_done(self, sender: KVSender, *layer) -> None:
        self.steps += 1
        sender.send_layer(*layer)

    def _finish_transfer(self, rid: str, sender: KVSender, first_token_id: int, prefill_s: float) -> None:
        try:
            res = sender.finish(first_token_id)
            self.publish(PrefillDone(rid, prefill_s, res.path, res.bytes, res.seconds, res.retries, res.fallback))
        except HarnessError as exc:
            self.publish(PrefillFailed(rid, str(exc)))
        finally:
            self._senders.pop(rid, None)

    def _import(self, msg: Import) -> None:
        req = msg.request()
        n = len(req.prompt_token_ids) + len(req.resume_token_ids)
        try:
            handle = self.core.begin_import(req, n)
        except HarnessError as exc:
            self.publish(ImportFailed(req.request_id, str(exc)))
            return
        self._imports[req.request_id] = handle
        self.landing.register(req.request_id, handle)
        self._layouts[req.request_id] = KVLayout(self.model.n_layers, n, self.model.n_kv_heads, self.model.head_dim,
                                                 self.core.pool.storage.dtype)
        # re-placed after its worker was lost or hung, whether or not it had streamed a token (a soak's
        # kill may find only requests before their first one)
        if msg.attempt > 0 or req.resume_token_ids:
            self._leak_on_recovery(req.request_id)
        self.publish(ImportReady(req.request_id))

    def _migrate_in(self, msg: MigrateIn) -> None:
        known = msg.rid in self.migration.pending()   # a second MigrateIn of it is refused
        self.migration.migrate_in(msg)
        if not known and msg.rid in self.migration.pending():  # accepted: its KV is on the way
            self._leak_on_recovery(msg.rid)

    def _leak_on_recovery(self, rid: str) -> None:
        """Sabotage knob ``leak_kv_blocks_per_recovery``: take that many free blocks (fewer when
        fewer are free: the leak never fails the request) and never free them, so the soak leak
        check (soak.leaks) has a cluster it must fail. They count as used, like a real leak's."""
        want = self.core.config.leak_kv_blocks_per_recovery
        if want <= 0:
            return
        blocks = self.core.pool.allocate(min(want, self.core.pool.num_free))
        self.leaked_blocks += blocks
        log.warning("sabotage: leaking %d KV blocks (leak_kv_blocks_per_recovery) on recovered request %s; "
                    "%d leaked so far", len(blocks), rid, len(self.leaked_blocks))

    def _leak_on_finish(self, rid: str) -> None:
        """Sabotage knob ``leak_kib_per_request``: a decode worker keeps that many KiB (written, so
        resident) and one open file descriptor per finished request, never freed while it runs, so
        soak.leaks has a process leak (RSS and fds growing with the requests served) it must fail.
        Bounded so a long soak cannot take the machine or the worker down: memory up to
        LEAK_MEMORY_CAP_BYTES a process, fds up to half its soft fd limit (the worker keeps the rest
        for its sockets: the leak never fails a request); past a cap that part stops, logged once."""
        kib = self.core.config.leak_kib_per_request
        if kib <= 0 or self.role != WorkerRole.DECODE:
            return
        n = len(self.leaked_memory)
        if n * kib * 1024 + kib * 1024 <= LEAK_MEMORY_CAP_BYTES:
            self.leaked_memory.append(bytearray(b"\x5a") * (kib * 1024))
        elif not self._leak_capped:
            self._leak_capped = True
            log.warning("sabotage: leak_kib_per_request keeps %d KiB, its cap: no more memory leaked", n * kib)
        if len(self.leaked_fds) < resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2:
            try:
                self.leaked_fds.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:   # EMFILE: out of fds
                log.debug("sabotage: no fd leaked for %s: %s", rid, exc)
        self._leaked_requests += 1
        if self._leaked_requests == 1 or self._leaked_requests % 1000 == 0:
            log.warning("sabotage: leaking %d KiB and an fd per finished request (leak_kib_per_request); "
                        "%d requests, %d fds so far", kib, self._leaked_requests, len(self.leaked_fds))

    def _write(self, rid: str, layer_start: int, kv, release) -> None:
        try:
            handle = self._imports.get(rid)
            if handle is not None:
                for i in range(kv.shape[0]):  # kv: [layers, 2, T, H, D]
                    handle.write_layer(layer_start + i, kv[i, 0], kv[i, 1])
        finally:
            release()  # the receive buffer takes later frames

    def _commit(self, rid: str, first_token_id: int) -> None:
        if self.migration.commit(rid, first_token_id):
            return
        handle = self._imports.pop(rid, None)
        if handle is None:
            return
        self.landing.release(rid, handle)  # kv_complete waited until nothing lands in it
        try:
            self.core.commit_import(handle, first_token_id)
        except HarnessError as exc:
            self.publish(ImportFailed(rid, str(exc)))

    def _abort(self, rid: str) -> None:
        for tid in self.migration.forget(rid):  # a migration into this worker that was called off
            self._abort(tid)
        self.window.forget(rid)
        self._jobs = deque(j for j in self._jobs if j.rid != rid)
        sender = self._senders.get(rid)
        if sender is not None:
            sender.cancel()
        handle = self._imports.pop(rid, None)
        if handle is not None:
            self._layouts.pop(rid, None)
            if self.receiver:
                self.receiver.forget(rid)
            if self.landing.release(rid, handle):  # else the landing in flight frees it when done
                self.core.cancel_import(handle)
        self.core.abort(rid)

    def _reset(self, _msg: Message | None = None) -> None:
        """The router forgot us: drop every request so nothing stale is streamed after rejoining."""
        for rid in {*self._imports, *self.core.requests, *self._senders, *(j.rid for j in self._jobs),
                    *self.migration.pending()}:
            self._abort(rid)

    # -- KVSink, called from receiver threads
    def kv_layout(self, rid: str) -> KVLayout | None:
        return self._layouts.get(rid) or self.migration.layout(rid)

    def kv_write(self, rid: str, layer_start: int, kv, release) -> None:
        self._cmds.put(lambda: self._write(rid, layer_start, kv, release))

    def kv_recv_into(self, rid: str, layer_start: int, layer_end: int, nbytes: int):
        return self.landing.take(rid, layer_start, layer_end, nbytes)

    def kv_complete(self, rid: str, first_token_id: int, tokens: list[int] | None = None) -> None:
        self.landing.wait_idle(rid)  # a duplicate frame may still be landing on another connection
        try:
            self.migration.check_complete(rid, first_token_id, tokens)
        except HarnessError:
            self._cmds.put(lambda: self._abort(rid))
            raise
        if self._layouts.pop(rid, None) is None:
            raise HarnessError(f"import of {rid} was cancelled")
        self._cmds.put(lambda: self._commit(rid, first_token_id))


__all__ = ["WorkerEngine"]
