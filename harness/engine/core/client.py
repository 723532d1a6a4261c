"""Engine clients: the ``EngineClient`` protocol over an EngineCore in a thread or in a process.

Both run the same busy loop (``serve_engine``) fed by the same typed messages; only the pipe
differs. ``InProcessClient`` runs it in one dedicated thread (unit tests, single-process
server); ``QueueClient`` runs it in a spawned child process and turns the child's death into
an explicit error event on every open stream. Events reach asyncio through
``loop.call_soon_threadsafe``. Pick one with ``make_client(config, mode)``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore, validate_request
from harness.engine.core.types import EngineStats, FinishReason, GenerateRequest, TokenEvent
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import ConfigError, HarnessError, InvalidRequestError, WorkerDeadError

logger = logging.getLogger(__name__)


# ---- typed messages (client -> engine loop) ------------------------------------------------

@dataclass
class AddRequest:
    request: GenerateRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class SetSpeculative:
    enabled: bool


@dataclass
class Shutdown:
    pass


# ---- (engine loop -> client) ---------------------------------------------------------------

@dataclass
class Ready:
    pass


@dataclass
class StepOutput:
    events: list[TokenEvent]
    stats: EngineStats


@dataclass
class LoopFailed:
    error: str


def error_event(request_id: str, message: str) -> TokenEvent:
    return TokenEvent(request_id=request_id, token_ids=[], text="", finished=True,
                      finish_reason=FinishReason.ERROR, error=message)


def serve_engine(engine: EngineCore, inbox: Any, emit: Callable[[Any], None],
                 keep_going: Callable[[], bool] = lambda: True) -> None:
    """The engine's busy loop: apply messages, step while there is work, emit what happened.
    Blocks on ``inbox.get`` only when idle. Returns on Shutdown, or when ``keep_going()`` turns
    false (checked while idle)."""
    while True:
        messages = []
        if not engine.has_work():
            try:
                messages.append(inbox.get(timeout=0.5))
            except queue.Empty:
                if not keep_going():
                    return
                continue
        while True:
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        events: list[TokenEvent] = []
        for msg in messages:
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequest):
                try:
                    engine.add_request(msg.request)
                except HarnessError as exc:
                    events.append(error_event(msg.request.request_id, str(exc)))
            elif isinstance(msg, AbortRequest):
                engine.abort(msg.request_id)
            elif isinstance(msg, SetSpeculative):
                engine.set_speculative(msg.enabled)
        if engine.has_work():
            events.extend(engine.step())
        emit(StepOutput(events, engine.stats()))


class _StreamingClient:
    """Stream bookkeeping shared by both clients: one asyncio.Queue per open request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_name = config.preset
        self.max_model_len = config.context_len
        self._tokenizer = ByteTokenizer()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._dead: str | None = None   # why the engine can no longer serve
        self._closed = False

    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> "_StreamingClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def alive(self) -> bool:
        """False once the engine died or the client was closed (the API's /health answers 503)."""
        return self._dead is None and not self._closed

    def _send(self, msg: Any) -> None:
        raise NotImplementedError

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        validate_request(self.config, request)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request id {request.request_id!r} is already streaming",
                                          param="request_id")
            self._streams[request.request_id] = (loop, events)
        finished = False
        try:
            if self._dead or self._closed:
                finished = True
                yield error_event(request.request_id, self._dead or "the engine client is closed")
                return
            self._send(AddRequest(request))
            while True:
                event = await events.get()
                finished = event.finished
                yield event
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished and not self._dead and not self._closed:
                self._send(AbortRequest(request.request_id))  # client went away: free its KV

    async def abort(self, request_id: str) -> None:
        if not self._dead and not self._closed:
            self._send(AbortRequest(request_id))

    async def set_speculative(self, enabled: bool) -> None:
        if self._dead:
            raise WorkerDeadError(self._dead)
        self._send(SetSpeculative(bool(enabled)))

    def _dispatch(self, out: StepOutput) -> None:
        self._stats = out.stats
        for event in out.events:
            with self._lock:
                stream = self._streams.get(event.request_id)
            if stream is not None:
                loop, events = stream
                loop.call_soon_threadsafe(events.put_nowait, event)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for request_id, (loop, events) in streams:
            try:
                loop.call_soon_threadsafe(events.put_nowait, error_event(request_id, message))
            except RuntimeError:  # that event loop is already closed; nobody is listening
                pass


class InProcessClient(_StreamingClient):
    """EngineCore in one background thread of this process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._engine = EngineCore(config)
        self._tokenizer = self._engine.tokenizer
        self._stats = self._engine.stats()
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"engine-{config.name or config.preset}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            serve_engine(self._engine, self._inbox, self._dispatch)
        except Exception as exc:  # an engine bug: every open stream must end, not hang
            logger.exception("engine loop crashed")
            self._dead = f"engine loop crashed: {exc!r}"
            self._fail_all(self._dead)

    def _send(self, msg: Any) -> None:
        self._inbox.put(msg)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(Shutdown())
            await asyncio.to_thread(self._thread.join)
            self._fail_all("the engine client was closed")


def _child_main(config: EngineConfig, inbox: Any, outbox: Any, parent_pid: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        engine = EngineCore(config)
    except Exception as exc:
        outbox.put(LoopFailed(f"engine failed to start: {exc!r}"))
        return
    outbox.put(Ready())
    try:
        # a SIGKILLed parent never sends Shutdown: leave instead of idling as an orphan
        serve_engine(engine, inbox, outbox.put, keep_going=lambda: os.getppid() == parent_pid)
    except Exception as exc:
        logger.exception("engine loop crashed")
        outbox.put(LoopFailed(f"engine loop crashed: {exc!r}"))


class QueueClient(_StreamingClient):
    """EngineCore in a spawned child process, talking over two multiprocessing queues."""

    def __init__(self, config: EngineConfig, start_timeout_s: float = 300.0) -> None:
        super().__init__(config)
        ctx = mp.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self.process = ctx.Process(target=_child_main, args=(config, self._inbox, self._outbox, os.getpid()),
                                   name=f"engine-{config.name or config.preset}", daemon=True)
        self.process.start()
        first = self._wait_ready(start_timeout_s)
        if not isinstance(first, Ready):
            self._reap(timeout=5.0)
            raise WorkerDeadError(first.error, fix="check the engine config; run with -v for the child's log")
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self._outbox.get(timeout=0.2)
            except queue.Empty:
                if not self.process.is_alive():
                    return LoopFailed(f"engine process died while starting (exit code {self.process.exitcode})")
        return LoopFailed(f"engine process did not start within {timeout_s:.0f} s")

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _read(self) -> None:
        while True:
            try:
                out = self._outbox.get(timeout=0.2)
            except queue.Empty:
                if self._closed:
                    return
                if not self.process.is_alive():
                    self._mark_dead(f"engine process {self.process.pid} died "
                                    f"(exit code {self.process.exitcode})")
                    return
                continue
            except (EOFError, OSError) as exc:
                self._mark_dead(f"engine process pipe broke: {exc!r}")
                return
            if isinstance(out, StepOutput):
                self._dispatch(out)
            elif isinstance(out, LoopFailed):
                self._mark_dead(out.error)
                return

    def _mark_dead(self, message: str) -> None:
        logger.error("%s", message)
        self._dead = message
        self._fail_all(message)

    def _send(self, msg: Any) -> None:
        if self._dead:
            raise WorkerDeadError(self._dead)
        self._inbox.put(msg)

    def _reap(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._dead and self.process.is_alive():
            self._inbox.put(Shutdown())
        await asyncio.to_thread(self._reap, 10.0)
        await asyncio.to_thread(self._reader.join)
        self._fail_all(self._dead or "the engine client was closed")
        self._inbox.close()
        self._outbox.close()


def make_client(config: EngineConfig, mode: str = "inproc") -> _StreamingClient:
    if mode == "inproc":
        return InProcessClient(config)
    if mode == "process":
        return QueueClient(config)
    raise ConfigError(f"unknown engine client mode {mode!r}", fix="use 'inproc' or 'process'")
