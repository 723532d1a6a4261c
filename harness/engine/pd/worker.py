"""PD worker process: ``python -m harness.engine.pd.worker --role prefill|decode --id ID --router HOST:PORT``.

Two halves. The engine half (worker_engine.py) runs one EngineCore in a dedicated engine thread
(the core is single-threaded) with a command handler table. This module is the control-session
half: the main thread runs asyncio for the control connection to the router (register, heartbeats every second,
commands down, tokens and transfer reports up, and a small progress beat every
``progress_interval_s`` carrying the engine's step counter: the router declares a worker that
serves requests and goes silent ``no_progress``, which catches a SIGSTOP within a second). A
decode worker also listens for KV on its fabric address (primary path) and on its control address (fallback path); the receiver's
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
import signal
import sys
import time

from harness.engine import DEFAULT_PRESET
from harness.engine.core.config import EngineConfig
from harness.engine.control.codec import MessageError, encode, read_message
from harness.engine.control.messages import Message, Progress, Register, Welcome
from harness.engine.pd.worker_engine import WorkerEngine
from harness.states import PD_ROLES

log = logging.getLogger(__name__)


class PDWorker:
    """The control-session half: registers with the router, beats, forwards commands to the
    engine half (``WorkerEngine.submit``) and its replies back up."""

    def __init__(self, worker_id: str, role: str, engine_config: EngineConfig) -> None:
        self.id, self.role = worker_id, role
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue | None = None
        self._stop: asyncio.Event | None = None
        self.engine = WorkerEngine(worker_id, role, engine_config, publish=self.publish,
                                   on_failure=self._engine_failed)

    def publish(self, msg: Message) -> None:
        """Any thread: send ``msg`` up the control connection (dropped while none is open)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, msg)

    def _engine_failed(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def serve(self, router: tuple[str, int], kv_host: str, control_host: str, *, grace_s: float,
                    parent_pid: int, kv_port: int = 0) -> int:
        self._loop = asyncio.get_running_loop()
        self._outbox = asyncio.Queue()
        kv_addr, control_addr = self.engine.listen(kv_host, kv_port, control_host)
        self.engine.start()
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
                self.engine.reset()
        finally:
            stopper.cancel()
            t0 = time.monotonic()
            self.engine.stop()
            log.info("worker %s stopped in %.2f s", self.id, time.monotonic() - t0)
        return 70 if self.engine.failed else code

    async def _session(self, reader, writer, kv_addr, control_addr, stopper: asyncio.Task) -> None:
        writer.write(encode(Register(self.id, self.role, os.getpid(), list(kv_addr), list(control_addr),
                                     self.engine.core.pool.num_blocks, self.engine.core.config.block_size)))
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
                writer.write(encode(self.engine.heartbeat()))
                await asyncio.sleep(interval)

        async def progress() -> None:
            # From this event loop, not the engine thread: it runs while the engine is deep in a
            # long step, so only a stopped (or wedged) process goes silent.
            while progress_interval:
                writer.write(encode(Progress(self.engine.steps)))
                await asyncio.sleep(progress_interval)

        async def pump_outbox() -> None:
            while True:
                writer.write(encode(await self._outbox.get()))
                await writer.drain()

        async def commands() -> None:
            try:
                while (msg := await read_message(reader, "router")) is not None:
                    self.engine.submit(msg)
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
    p = argparse.ArgumentParser(prog="python -m harness.engine.pd.worker", description="PD worker process")
    p.add_argument("--role", required=True, choices=[str(r) for r in PD_ROLES])
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
