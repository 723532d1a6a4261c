"""PD worker process: ``python -m harness.engine.worker --role prefill|decode --id ID --router HOST:PORT``.

One EngineCore runs in a dedicated engine thread (the core is single-threaded); the main thread
runs asyncio for the control connection to the router (register, heartbeats every second,
commands down, tokens and transfer reports up, and a small progress beat every
``progress_interval_s`` carrying the engine's step counter: the router declares a worker that
serves requests and goes silent ``no_progress``, which catches a SIGSTOP within a second). A decode worker also listens for KV on its
fabric address (primary path) and on its control address (fallback path); the receiver's
threads hand verified layers to the engine thread through its command queue. A prefill worker
runs ``prefill_for_transfer`` for one queued request at a time and streams each layer to the
decode worker while later layers still compute.

When the control connection breaks (the router declared this worker dead, e.g. after a
SIGSTOP), the worker drops every request it holds and registers again, so it rejoins the
routing table without a router restart. It exits when the router stays unreachable for
``--router-grace-s`` or when its parent process is gone, so it never outlives its topology.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable

from harness.engine.config import EngineConfig
from harness.engine.core import EngineCore, ImportHandle
from harness.engine.messages import (FAULT_COMMANDS, Abort, CorruptFrames, Heartbeat, Import, ImportFailed,
                                     ImportReady, Message, MigrateIn, MigrateOut, Prefill, PrefillDone, PrefillFailed,
                                     Progress, Register, SetOffload, SetSpeculative, Tokens, TransferEvent, Welcome,
                                     MessageError, encode, read_message)
from harness.engine.kv_landing import ImportLanding
from harness.engine.worker_faults import WorkerFaults, kv_block_faults, kv_used_ratio
from harness.engine.worker_migration import LiveMigration
from harness.engine.worker_stats import RecentWindow
from harness.engine.transfer import (PATH_CONTROL, PATH_FABRIC, Endpoint, KVLayout, KVReceiver, KVSender,
                                     TransferConfig, TransferStats)
from harness.engine import DEFAULT_PRESET
from harness.errors import ConfigError, HarnessError

log = logging.getLogger(__name__)
# Heartbeats go out every second; the p99 over the TPOT window sorts thousands of samples, which
# is too much to redo after every decode step of a small model.
STATS_REFRESH_S = 0.1


class PDWorker:
    def __init__(self, worker_id: str, role: str, engine_config: EngineConfig) -> None:
        if role not in ("prefill", "decode"):
            raise ConfigError(f"worker role {role!r} is unknown", fix="use --role prefill or --role decode")
        self.id, self.role = worker_id, role
        self.core = EngineCore(engine_config)
        self.model = self.core.model_config
        self.transfer_stats = TransferStats()
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._imports: dict[str, ImportHandle] = {}   # decode: KV arriving
        self._layouts: dict[str, KVLayout] = {}
        self._jobs: deque[Prefill] = deque()          # prefill: queued requests
        self._senders: dict[str, KVSender] = {}       # prefill: transfers in flight
        self._corrupt_frames = 0                      # fault hook (admin API)
        self._finisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-finish")
        self.faults = WorkerFaults(self.core)
        self.landing = ImportLanding(self.core, self._cmds.put)  # KV frames land in the import's blocks
        self.migration = LiveMigration(self)
        self.window = RecentWindow()
        self._stats_cache: dict = self._stats()
        self._stats_at = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue | None = None
        self.receiver: KVReceiver | None = None
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._stop: asyncio.Event | None = None
        self.engine_failed = False
        self.steps = 0  # engine steps and prefill layers done (progress beats carry it)

    # -- engine thread
    def _engine_loop(self) -> None:
        try:
            self._engine_steps()
        except Exception:
            # Crash-only: a broken engine must not keep heartbeating while its requests hang.
            # Exiting closes the control connection, so the router reschedules them at once.
            log.exception("engine thread failed; worker %s exits", self.id)
            self.engine_failed = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._stop.set)

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
        self.publish(ImportReady(req.request_id))

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

    def _reset(self) -> None:
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

    # -- control plane (asyncio, main thread)
    def publish(self, msg: Message) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, msg)

    def _on_command(self, msg: Message) -> None:
        kind = type(msg)
        if kind is Import:
            self._cmds.put(lambda: self._import(msg))
        elif kind is Prefill:
            self._cmds.put(lambda: self._jobs.append(msg))
        elif kind is Abort:
            self._cmds.put(lambda: self._abort(msg.rid))
        elif kind is SetSpeculative:
            self._cmds.put(lambda: self.core.set_speculative(msg.enabled))
        elif kind in FAULT_COMMANDS:
            self._cmds.put(lambda: self.publish(self.faults.handle(msg)))
        elif kind is SetOffload:
            self._cmds.put(lambda: self.core.set_offload(bool(msg.enabled), msg.threshold))
        elif kind is MigrateIn:
            self._cmds.put(lambda: self.migration.migrate_in(msg))
        elif kind is MigrateOut:
            self._cmds.put(lambda: self.migration.migrate_out(msg))
        elif kind is CorruptFrames:
            self._corrupt_frames = msg.corrupt_frames
            log.warning("fault hook armed: corrupt the next %d KV frames", self._corrupt_frames)
        else:
            log.warning("refused a %s message: the router does not send it to workers", msg.TYPE)

    async def serve(self, router: tuple[str, int], kv_host: str, control_host: str, *, grace_s: float,
                    parent_pid: int, kv_port: int = 0) -> int:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        kv_addr, control_addr = (kv_host, 0), (control_host, 0)
        if self.role == "decode":
            self.receiver = KVReceiver(self, self.transfer_stats)
            kv_addr = self.receiver.listen(kv_host, kv_port, PATH_FABRIC)
            control_addr = self.receiver.listen(control_host, 0, PATH_CONTROL)
        self._thread.start()
        stop = self._stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(sig, stop.set)
        stopper = self._loop.create_task(stop.wait())
        last_ok, code = time.monotonic(), 0
        print(f"worker {self.id} ({self.role}) pid {os.getpid()} kv {kv_addr[0]}:{kv_addr[1]} "
              f"control {control_addr[0]}:{control_addr[1]}", file=sys.stderr, flush=True)
        try:
            while not stop.is_set():
                if parent_pid and os.getppid() != parent_pid:
                    log.warning("parent %d is gone; worker exits", parent_pid)
                    break
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(*router), 2.0)
                except (OSError, asyncio.TimeoutError) as exc:
                    if time.monotonic() - last_ok > grace_s:
                        log.error("router %s:%d unreachable for %.0f s (%s); exiting", *router, grace_s, exc)
                        code = 1
                        break
                    await asyncio.sleep(0.2)
                    continue
                await self._session(reader, writer, kv_addr, control_addr, stopper)
                last_ok = time.monotonic()
                self._cmds.put(self._reset)
        finally:
            stopper.cancel()
            for sender in list(self._senders.values()):
                sender.cancel()
            self._cmds.put(None)
            t0 = time.monotonic()
            self._thread.join(10)
            self._finisher.shutdown(wait=True, cancel_futures=True)
            if self.receiver:
                self.receiver.close()
            log.info("worker %s stopped in %.2f s", self.id, time.monotonic() - t0)
        return 70 if self.engine_failed else code

    async def _session(self, reader, writer, kv_addr, control_addr, stopper: asyncio.Task) -> None:
        writer.write(encode(Register(self.id, self.role, os.getpid(), list(kv_addr), list(control_addr),
                                     self.core.pool.num_blocks, self.core.config.block_size)))
        try:  # a router that is shutting down may still accept connections but never answer
            welcome = await asyncio.wait_for(read_message(reader, "router"), 5.0)
        except (asyncio.TimeoutError, MessageError):
            welcome = None
        if not isinstance(welcome, Welcome):
            log.warning("router refused registration: %s", welcome)
            writer.close()
            await asyncio.sleep(0.5)
            return
        interval = float(welcome.heartbeat_interval_s)
        progress_interval = float(welcome.progress_interval_s)
        log.info("registered with the router as %s", self.id)

        async def heartbeats() -> None:
            while True:
                writer.write(encode(Heartbeat(self._stats_cache, self.transfer_stats.snapshot(),
                                              len(self._jobs) + len(self._senders))))
                await asyncio.sleep(interval)

        async def progress() -> None:
            # From this event loop, not the engine thread: it runs while the engine is deep in a
            # long step, so only a stopped (or wedged) process goes silent.
            while progress_interval:
                writer.write(encode(Progress(self.steps)))
                await asyncio.sleep(progress_interval)

        async def pump_outbox() -> None:
            while True:
                writer.write(encode(await self._outbox.get()))
                await writer.drain()

        async def commands() -> None:
            try:
                while (msg := await read_message(reader, "router")) is not None:
                    self._on_command(msg)
            except MessageError as exc:  # the stream lost its framing: rejoin on a fresh connection
                log.warning("control connection to the router refused: %s", exc)

        tasks = [asyncio.ensure_future(t) for t in (commands(), heartbeats(), pump_outbox(), progress())]
        try:
            await asyncio.wait([tasks[0], stopper], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()
        log.warning("control connection to the router closed; dropping all requests and rejoining")


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.engine.worker", description="PD worker process")
    p.add_argument("--role", required=True, choices=("prefill", "decode"))
    p.add_argument("--id", required=True)
    p.add_argument("--router", required=True, type=_hostport, help="router control address HOST:PORT")
    p.add_argument("--preset", default=DEFAULT_PRESET)
    p.add_argument("--engine-json", default="{}", help="EngineConfig fields as JSON (kv_budget_bytes, ...)")
    p.add_argument("--kv-host", default="127.0.0.1", help="fabric address: KV data plane (primary path)")
    p.add_argument("--control-host", default="127.0.0.1", help="control address: fallback KV path")
    p.add_argument("--kv-port", type=int, default=0,
                   help="fabric KV port (0: any free port; a fixed port lets the fabric classify KV traffic)")
    p.add_argument("--router-grace-s", type=float, default=15.0)
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format=f"%(asctime)s %(levelname)s {args.id} %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to the log
    overrides = json.loads(args.engine_json)
    config = EngineConfig(preset=args.preset, name=args.id, **overrides)
    worker = PDWorker(args.id, args.role, config)
    # torch and the model are a large object graph that lives as long as the process: out of the
    # collector's sight, a full collection no longer walks it (one stalled a loaded worker's
    # progress beats long enough to be declared hung)
    gc.freeze()
    return asyncio.run(worker.serve(args.router, args.kv_host, args.control_host, grace_s=args.router_grace_s,
                                    parent_pid=args.parent_pid, kv_port=args.kv_port))


if __name__ == "__main__":
    code = main()
    # Everything was closed explicitly above. Skip interpreter finalization: its final garbage
    # collection over torch's object graph took more than 10 s on a loaded 2-core machine.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
