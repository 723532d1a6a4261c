"""PD router: the global scheduler in front of N prefill and M decode worker processes.

- Control plane: workers connect to the router's control port and register; each connection
  carries length-prefixed JSON messages both ways (commands down, heartbeats and tokens up).
  A broken connection marks the worker dead at once; a silent one is marked dead after
  ``heartbeat_timeout_s`` (seed Section 5.1, layer 1), or after ``hang_timeout_s`` when it holds
  requests it serves (``no_progress``: a SIGSTOPped worker stops its progress beats, see
  ``_watch_heartbeats``). A worker that reconnects, or a new
  one, joins the routing table without a router restart.
- Scheduling (seed Section 5.3): the least-queued prefill worker; the decode target is the
  least-loaded worker whose free KV exceeds ``kv_headroom_factor`` (1.2) x the request's KV;
  when none fits the request waits in the admission queue.
- Rescheduling: a request whose decode worker dies, or whose prefill worker dies before its KV
  arrived, is placed again and re-prefilled with prompt + the tokens already streamed
  (``resume_token_ids``), so the client stream continues with no duplicated or missing token;
  when no worker can take it, it ends with an explicit error event.
- ``Router`` is the EngineClient handed to ``api.build_app``; router_server.py adds
  ``/admin/workers``, ``/admin/events``, fault hooks and metrics, and runs it as a process
  (``python -m harness.engine.router_server``; ``topology.py`` does).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import struct
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator

from harness.engine.config import EngineConfig
from harness.engine.degradation import DegradationConfig
from harness.engine.health import HealthConfig
from harness.engine.resilience import ResilienceControl
from harness.engine.protocol import EngineStats, FinishReason, GenerateRequest, TokenEvent
from harness.engine.tokenizer import ByteTokenizer
from harness.engine.transfer_config import TransferConfig, config_from_dict
from harness.errors import ConfigError, EngineError, InvalidRequestError

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- control protocol

_LEN = struct.Struct("!I")
MAX_MSG_BYTES = 64 << 20


def encode_msg(msg: dict) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(data)) + data


async def read_msg(reader: asyncio.StreamReader) -> dict | None:
    """One control message, or None when the peer closed the connection."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if n > MAX_MSG_BYTES:
            raise EngineError(f"control message of {n} bytes exceeds {MAX_MSG_BYTES}")
        return json.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


# ---------------------------------------------------------------- configuration


@dataclass
class RouterConfig:
    """Knobs a cluster file can set (docs/pd.md). The sabotage knobs (``reschedule_enabled=False``,
    ``reschedule_delay_s``) exist so the harness can prove its suites fail on a bad cluster."""

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 2.0
    # progress beats (worker.py) every progress_interval_s; a worker serving requests that sends
    # nothing for hang_timeout_s is declared down (no_progress), well before heartbeat_timeout_s
    progress_interval_s: float = 0.1
    hang_timeout_s: float = 0.8
    reschedule_enabled: bool = True
    reschedule_delay_s: float = 0.0
    max_reschedules: int = 3
    admission_timeout_s: float = 30.0   # a new request waits this long for KV headroom
    reschedule_wait_s: float = 5.0      # a rescheduled request waits this long for a worker
    kv_headroom_factor: float = 1.2     # seed 5.3: free KV must exceed 1.2 x the request's KV
    max_events: int = 10000
    transfer: dict = field(default_factory=dict)  # TransferConfig fields, sent to prefill workers
    # resilience (docs/pd.md); turning one off is how a suite proves it fails without the feature
    degradation_enabled: bool = True
    degradation: dict = field(default_factory=dict)  # DegradationConfig fields (thresholds, dwell, caps)
    offload_enabled: bool = True        # Level 3 turns KV offload on
    offload_threshold: float = 0.85     # seed 4.3
    migration_enabled: bool = True      # live KV migration (admin API, drain, health decisions)
    auto_migrate: bool = True           # health decisions (seed 5.3) migrate without an operator
    migration_timeout_s: float = 10.0
    health: dict = field(default_factory=dict)       # HealthConfig fields (window, weights, threshold)
    control_interval_s: float = 0.25    # how often the degradation level and health scores are evaluated

    def __post_init__(self) -> None:
        positive = ("heartbeat_interval_s", "heartbeat_timeout_s", "admission_timeout_s", "kv_headroom_factor",
                    "progress_interval_s", "hang_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)!r}",
                                  fix=f"set router.{name} to a positive number")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"router.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s})",
                              fix="use e.g. interval 1 s and timeout 2 s")
        if self.hang_timeout_s < 4 * self.progress_interval_s:
            raise ConfigError(f"router.hang_timeout_s ({self.hang_timeout_s}) must be at least 4 x "
                              f"progress_interval_s ({self.progress_interval_s}), or one late beat is a false alarm",
                              fix="use e.g. progress_interval_s 0.1 and hang_timeout_s 0.8")
        if self.reschedule_delay_s < 0 or self.reschedule_wait_s < 0 or self.max_reschedules < 0:
            raise ConfigError("router.reschedule_delay_s, reschedule_wait_s and max_reschedules must be >= 0",
                              fix="use non-negative values")
        TransferConfig.from_dict(self.transfer)  # validate now, not at the first request
        for name in ("migration_timeout_s", "control_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)!r}",
                                  fix=f"set router.{name} to a positive number")
        if not 0 < self.offload_threshold < 1:
            raise ConfigError(f"router.offload_threshold must be in (0, 1), got {self.offload_threshold!r}",
                              fix="use 0.85 (seed Section 4.3)")
        DegradationConfig.from_dict(self.degradation)
        try:
            HealthConfig(**self.health)
        except TypeError as exc:
            raise ConfigError(f"router.health: {exc}", fix="use HealthConfig fields (docs/pd.md)") from None

    @classmethod
    def from_dict(cls, data: dict | None) -> "RouterConfig":
        return config_from_dict(cls, data, "router")


# ---------------------------------------------------------------- state


@dataclass
class Worker:
    id: str
    role: str  # "prefill" | "decode"
    pid: int
    kv_addr: tuple[str, int]
    control_addr: tuple[str, int]
    writer: asyncio.StreamWriter
    kv_blocks_total: int
    block_size: int
    health: str = "healthy"  # "healthy" | "dead"
    down_reason: str | None = None
    last_heartbeat: float = field(default_factory=time.monotonic)  # last message of any kind
    steps: int | None = None      # the worker's progress counter (None: it sends no progress beats)
    joined_wall: float = field(default_factory=time.time)
    queue_depth: int = 0          # prefill: placed here, KV not yet delivered; decode: active requests
    kv_blocks_used: int = 0       # as the worker reported it
    stats: dict = field(default_factory=dict)
    transfer: dict = field(default_factory=dict)
    attempts: set[str] = field(default_factory=set)  # attempt ids placed here
    reserved_blocks: int = 0

    def send(self, msg: dict) -> None:
        if self.health == "healthy" and not self.writer.is_closing():
            self.writer.write(encode_msg(msg))

    def free_blocks(self) -> int:
        return self.kv_blocks_total - max(self.kv_blocks_used, self.reserved_blocks)

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
class _Attempt:
    id: str                 # "<request id>#<n>": stale messages of an earlier attempt never match
    prefill: str
    decode: str
    blocks: int
    inbox: asyncio.Queue
    request: GenerateRequest | None = None
    streamed: list[int] = field(default_factory=list)  # the request's stream so far (shared list)
    kv_arrived: bool = False
    last_active: float = field(default_factory=time.monotonic)  # last token (migration victim order)
    last_worker: str | None = None                               # who sent the last token
    gaps: deque = field(default_factory=lambda: deque(maxlen=16))  # recent inter-token gaps, seconds
    pending: list[dict] = field(default_factory=list)           # tokens messages not yet in order

    @property
    def priority(self) -> int:
        return self.request.params.priority if self.request else 0


class _Lost(Exception):
    """The attempt cannot continue (a worker died, the transfer failed); reschedule it."""


class _NoCapacity(EngineError):
    pass


class Router:
    """EngineClient over the PD worker processes (see module docstring)."""

    def __init__(self, preset: str, config: RouterConfig | None = None, *, max_model_len: int | None = None) -> None:
        self.config = config or RouterConfig()
        engine = EngineConfig(preset=preset, max_model_len=max_model_len)
        self.model_name = preset
        self.max_model_len = engine.context_len
        self._tokenizer = ByteTokenizer()
        self.workers: dict[str, Worker] = {}
        self.events: deque[dict] = deque(maxlen=self.config.max_events)
        self._event_seq = itertools.count(1)
        self._attempts: dict[str, _Attempt] = {}
        self._capacity = asyncio.Condition()
        self.waiting = 0
        self.counters = {"reschedules": 0, "reschedule_failures": 0, "admission_timeouts": 0}
        self._server: asyncio.AbstractServer | None = None
        self._monitor: asyncio.Task | None = None
        self._conn_tasks: set[asyncio.Task] = set()
        self.resilience = ResilienceControl(self)

    @property
    def attempts(self) -> dict[str, _Attempt]:
        """Placements in flight by attempt id (the migration manager reads them)."""
        return self._attempts

    # -- EngineClient
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    def stats(self) -> EngineStats:
        s = EngineStats()
        for w in self.workers.values():
            if w.health != "healthy":
                continue
            for name in ("num_running", "num_waiting", "prompt_tokens_total", "generation_tokens_total",
                         "spec_draft_tokens", "spec_accepted_tokens"):
                setattr(s, name, getattr(s, name) + int(w.stats.get(name, 0)))
            if w.role == "decode":
                s.kv_blocks_used += w.kv_blocks_used
                s.kv_blocks_total += w.kv_blocks_total
                s.kv_block_bytes = int(w.stats.get("kv_block_bytes", s.kv_block_bytes))
                s.spec_enabled = s.spec_enabled or bool(w.stats.get("spec_enabled"))
        s.num_waiting += self.waiting
        s.extra = {"workers_healthy": sum(w.health == "healthy" for w in self.workers.values()),
                   "admission_queue": self.waiting}
        return s

    async def set_speculative(self, enabled: bool) -> None:
        for w in self.workers.values():
            w.send({"type": "set_speculative", "enabled": bool(enabled)})

    async def abort(self, request_id: str) -> None:
        for att in list(self._attempts.values()):
            if att.id.rsplit("#", 1)[0] == request_id:
                att.inbox.put_nowait({"type": "client_abort"})

    async def close(self) -> None:
        if self._monitor:
            self._monitor.cancel()
        self.resilience.stop()
        if self._server:
            self._server.close()
        for w in self.workers.values():
            w.writer.close()  # each connection task then reads EOF and ends by itself
        if self._conn_tasks:
            await asyncio.wait(list(self._conn_tasks), timeout=2.0)

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self._tokenizer.validate(request.prompt_token_ids)
        if len(request.prompt_token_ids) + len(request.resume_token_ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt of {len(request.prompt_token_ids)} tokens does not fit "
                                      f"max_model_len {self.max_model_len}", param="prompt",
                                      code="context_length_exceeded")
        request, degraded = self.resilience.admit(request)  # 429/503 at Levels 1/5, capped at Level 4
        return self._generate(request, degraded)

    async def _generate(self, request: GenerateRequest, degraded: str | None = None) -> AsyncIterator[TokenEvent]:
        streamed: list[int] = list(request.resume_token_ids)
        n_prompt = len(request.prompt_token_ids)
        lost_worker: str | None = None
        lost_at: float | None = None
        for n in itertools.count():
            resumed = n > 0
            try:
                att = await self._place(request, n, streamed, resumed)
            except _NoCapacity as exc:
                if resumed:
                    self.counters["reschedule_failures"] += 1
                    self.record_event("reschedule_failed", request_id=request.request_id, error=str(exc))
                yield self._error(request, streamed, str(exc))
                return
            if resumed:
                self.record_event("reschedule", request_id=request.request_id, from_worker=lost_worker,
                            to_prefill=att.prefill, to_decode=att.decode, resumed_tokens=len(streamed) -
                            len(request.resume_token_ids), since_loss_s=round(time.monotonic() - lost_at, 4))
            how = "ended"  # how the attempt ended, for a migration in flight (finished / was lost / ended)
            try:
                first = True
                async for ev in self._run(att, request, streamed):
                    streamed.extend(ev.token_ids)
                    ev.num_prompt_tokens = n_prompt
                    ev.degraded = degraded
                    if resumed and first:
                        self.record_event("resumed", request_id=request.request_id, worker=att.decode,
                                    since_loss_s=round(time.monotonic() - lost_at, 4))
                    first = False
                    if ev.finished:
                        how = "finished"
                        self._release(att, how)  # before the last event leaves: a migration in flight is moot
                        yield ev
                        return
                    yield ev
            except _Lost as exc:
                lost_worker, lost_at = exc.args[1], exc.args[2]
                reason = exc.args[0]
                how = f"was lost ({reason})"
                log.warning("%s lost on %s: %s", att.id, lost_worker, reason)  # why a request was re-placed
                if not self.config.reschedule_enabled:
                    yield self._error(request, streamed, f"{reason}; rescheduling is disabled")
                    return
                if n >= self.config.max_reschedules:
                    yield self._error(request, streamed, f"{reason}; gave up after {n + 1} placements")
                    return
                self.counters["reschedules"] += 1
            finally:
                self._release(att, how)
            if self.config.reschedule_delay_s:
                await asyncio.sleep(self.config.reschedule_delay_s)  # sabotage knob, see docs/pd.md

    def _error(self, request: GenerateRequest, streamed: list[int], message: str) -> TokenEvent:
        log.warning("%s ends with an error: %s", request.request_id, message)
        return TokenEvent(request.request_id, [], "", finished=True, finish_reason=FinishReason.ERROR,
                          num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=len(streamed),
                          error=message)

    # -- placement
    def _blocks_needed(self, request: GenerateRequest, streamed: list[int], block_size: int) -> int:
        total = min(len(request.prompt_token_ids) + max(request.params.max_tokens, len(streamed) + 1),
                    self.max_model_len)
        return math.ceil(total / block_size)

    async def _place(self, request: GenerateRequest, n: int, streamed: list[int], resumed: bool) -> _Attempt:
        timeout = self.config.reschedule_wait_s if resumed else self.config.admission_timeout_s
        deadline = time.monotonic() + timeout
        self.waiting += 1
        try:
            async with self._capacity:
                while True:
                    picked = self._pick(request, streamed)
                    if isinstance(picked, tuple):
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        if not resumed:
                            self.counters["admission_timeouts"] += 1
                        raise _NoCapacity(f"no worker could take the request within {timeout:.1f} s: {picked}")
                    try:
                        await asyncio.wait_for(self._capacity.wait(), remaining)
                    except asyncio.TimeoutError:
                        pass
        finally:
            self.waiting -= 1
        prefill, decode, blocks = picked
        att = _Attempt(f"{request.request_id}#{n}", prefill.id, decode.id, blocks, asyncio.Queue(), request, streamed)
        self._attempts[att.id] = att
        prefill.attempts.add(att.id)
        decode.attempts.add(att.id)
        decode.reserved_blocks += blocks
        prefill.queue_depth += 1
        decode.queue_depth += 1
        return att

    def _pick(self, request: GenerateRequest, streamed: list[int]) -> tuple[Worker, Worker, int] | str:
        healthy = [w for w in self.workers.values() if w.health == "healthy"]
        prefills = [w for w in healthy if w.role == "prefill"]
        decodes = [w for w in healthy if w.role == "decode" and w.id not in self.resilience.migration.draining]
        if not prefills or not decodes:
            return f"{len(prefills)} healthy prefill and {len(decodes)} healthy decode workers"
        fits = []
        for w in decodes:
            need = self._blocks_needed(request, streamed, w.block_size)
            if w.free_blocks() > self.config.kv_headroom_factor * need:
                fits.append((len(w.attempts), w.id, w, need))
        if not fits:
            return "no decode worker has KV headroom of %.1fx the request's KV" % self.config.kv_headroom_factor
        _, _, decode, need = min(fits)
        prefill = min(prefills, key=lambda w: (w.queue_depth, w.id))
        return prefill, decode, need

    def _release(self, att: _Attempt, how: str = "ended") -> None:
        if self._attempts.pop(att.id, None) is None:
            return
        self.resilience.migration.cancel(att, how)
        for wid in (att.prefill, att.decode):
            w = self.workers.get(wid)
            if w is not None and att.id in w.attempts:
                w.attempts.discard(att.id)
                if wid == att.decode or not att.kv_arrived:
                    w.queue_depth -= 1
                w.send({"type": "abort", "rid": att.id})  # no-op on the worker when already finished
                if wid == att.decode:
                    w.reserved_blocks -= att.blocks
        asyncio.get_running_loop().create_task(self._notify_capacity())

    async def _notify_capacity(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    # -- one placement of a request
    async def _run(self, att: _Attempt, request: GenerateRequest, streamed: list[int]) -> AsyncIterator[TokenEvent]:
        decode, prefill = self.workers[att.decode], self.workers[att.prefill]
        body = {"rid": att.id, "prompt_token_ids": request.prompt_token_ids, "resume_token_ids": streamed,
                "params": asdict(request.params)}
        decode.send({"type": "import", **body})
        prefill_sent = False
        while True:
            msg = await att.inbox.get()
            kind = msg["type"]
            if kind == "import_ready" and not prefill_sent:
                prefill.send({"type": "prefill", **body, "transfer": self.config.transfer,
                              "target": {"kv": list(decode.kv_addr), "control": list(decode.control_addr)}})
                prefill_sent = True
            elif kind == "tokens":
                self._kv_arrived(att)
                att.pending.append(msg)
                while (part := self._next_in_order(att, len(streamed))) is not None:
                    yield self._token_event(request, att, part)
            elif kind == "prefill_done":
                self._kv_arrived(att)
                self.record_event("kv_transfer", request_id=request.request_id, prefill=att.prefill, decode=att.decode,
                            mode=self.config.transfer.get("mode", "layerwise"), prefill_s=msg["prefill_s"],
                            transfer_s=msg["seconds"], bytes=msg["bytes"], path=msg["path"],
                            retries=msg["retries"], fallback=msg["fallback"])
            elif kind in ("import_failed", "prefill_failed"):
                raise _Lost(f"{kind} on {msg.get('worker')}: {msg.get('error')}", msg.get("worker"), time.monotonic())
            elif kind == "worker_lost":
                if msg["worker"] == att.decode or not att.kv_arrived:
                    raise _Lost(f"worker {msg['worker']} lost ({msg['reason']})", msg["worker"], msg["at"])
            elif kind == "client_abort":
                yield TokenEvent(request.request_id, [], "", True, FinishReason.ABORT,
                                 num_output_tokens=len(streamed))
                return

    def _next_in_order(self, att: _Attempt, have: int) -> dict | None:
        """The next tokens message that continues the stream at ``have`` tokens. During a live
        migration both the source (until it paused) and the target may send the same positions,
        and the target's first tokens may overtake the source's last ones: duplicates are dropped,
        overlaps trimmed, and a message that starts past ``have`` waits for the gap to fill."""
        for m in list(att.pending):
            end = m["num_output_tokens"]
            start = end - len(m["token_ids"])
            if end <= have and not (m["finished"] and start == end):
                att.pending.remove(m)  # everything in it was streamed already
                if m["finished"]:      # ...but the end of the stream still counts
                    return {**m, "token_ids": [], "text": ""}
            elif start <= have:
                att.pending.remove(m)
                if start < have:
                    tokens = m["token_ids"][have - start:]
                    m = {**m, "token_ids": tokens, "text": self._tokenizer.decode(tokens)}
                return m
        return None

    def _token_event(self, request: GenerateRequest, att: _Attempt, msg: dict) -> TokenEvent:
        now, worker = time.monotonic(), msg["worker"]
        if msg["token_ids"]:
            if att.last_worker is not None and worker != att.last_worker:
                # the stall a migrated stream sees: last token from the source to first from the target
                gaps = sorted(att.gaps)
                self.record_event("migration_resumed", request_id=request.request_id, from_worker=att.last_worker,
                                  to_worker=worker, stall_s=round(now - att.last_active, 6),
                                  at_token=msg["num_output_tokens"] - len(msg["token_ids"]),
                                  typical_gap_s=round(gaps[len(gaps) // 2], 6) if gaps else None)
            elif att.last_worker is not None:
                att.gaps.append(now - att.last_active)
            att.last_active, att.last_worker = now, worker
        return TokenEvent(request.request_id, msg["token_ids"], msg["text"], msg["finished"],
                          FinishReason(msg["finish_reason"]) if msg["finish_reason"] else None,
                          num_output_tokens=msg["num_output_tokens"], worker=worker, error=msg.get("error"))

    def _kv_arrived(self, att: _Attempt) -> None:
        if not att.kv_arrived:
            att.kv_arrived = True
            prefill = self.workers.get(att.prefill)
            if prefill is not None and att.id in prefill.attempts:
                prefill.attempts.discard(att.id)
                prefill.queue_depth -= 1

    # -- control plane
    async def start_control(self, host: str, port: int, sock=None) -> tuple[str, int]:
        if sock is not None:
            self._server = await asyncio.start_server(self._on_connect, sock=sock)
        else:
            self._server = await asyncio.start_server(self._on_connect, host, port)
        self._monitor = asyncio.get_running_loop().create_task(self._watch_heartbeats())
        self.resilience.start()
        return self._server.sockets[0].getsockname()[:2]

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conn_tasks.add(task)
        worker = None
        try:
            hello = await read_msg(reader)
            if not hello or hello.get("type") != "register":
                return
            old = self.workers.get(hello["id"])
            if old is not None and old.health == "healthy":
                writer.write(encode_msg({"type": "refused", "error": f"worker id {hello['id']} is already "
                                         "registered and healthy"}))
                return
            worker = Worker(hello["id"], hello["role"], hello["pid"], tuple(hello["kv_addr"]),
                            tuple(hello["control_addr"]), writer, hello["kv_blocks_total"], hello["block_size"])
            self.workers[worker.id] = worker
            writer.write(encode_msg({"type": "welcome", "heartbeat_interval_s": self.config.heartbeat_interval_s,
                                     "progress_interval_s": self.config.progress_interval_s}))
            self.record_event("worker_up", worker=worker.id, role=worker.role, pid=worker.pid,
                        rejoined=old is not None)
            await self._notify_capacity()
            while (msg := await read_msg(reader)) is not None:
                self._on_message(worker, msg)
            self._worker_lost(worker, "connection_lost")
        except Exception:
            log.exception("control connection failed")
            if worker is not None:
                self._worker_lost(worker, "protocol_error")
        finally:
            writer.close()
            self._conn_tasks.discard(task)

    def _on_message(self, w: Worker, msg: dict) -> None:
        if w.health != "healthy":
            return  # a worker declared dead stays dead until it reconnects
        kind = msg["type"]
        w.last_heartbeat = time.monotonic()  # any message proves liveness
        if kind == "progress":
            w.steps = msg["steps"]
            return
        if kind == "heartbeat":
            w.stats, w.transfer = msg["stats"], msg["transfer"]
            w.kv_blocks_used = msg["stats"].get("kv_blocks_used", 0)
            self.resilience.on_heartbeat(w)
            return
        if self.resilience.on_message(w, msg):
            return  # a fault or migration reply, not part of a request's stream
        if kind == "transfer_event":
            self.record_event(f"transfer_{msg['event']}", worker=w.id, request_id=msg["rid"].rsplit("#", 1)[0],
                        **msg.get("detail", {}))
        att = self._attempts.get(msg.get("rid", ""))
        if att is not None and kind != "transfer_event":
            att.inbox.put_nowait({**msg, "worker": w.id})

    def _worker_lost(self, w: Worker, reason: str, **detail) -> None:
        if w.health != "healthy":
            return
        now = time.monotonic()
        w.health, w.down_reason = "dead", reason
        self.resilience.on_worker_lost(w)
        # affected: the requests this worker was serving (their prefill, or their decode). A request
        # it only held a reservation for, as the target of a live migration in flight, keeps running
        # on its source (the migration fails) and is not the worker's to reschedule
        serving = [a for a in w.attempts if (att := self._attempts.get(a)) is None
                   or att.decode == w.id or (att.prefill == w.id and not att.kv_arrived)]
        self.record_event("worker_down", worker=w.id, role=w.role, pid=w.pid, reason=reason,
                    affected=sorted(serving), **detail)
        for att_id in list(w.attempts):
            att = self._attempts.get(att_id)
            if att is not None:
                att.inbox.put_nowait({"type": "worker_lost", "worker": w.id, "reason": reason, "at": now})
        w.writer.close()  # a hung worker that wakes up finds its connection gone and rejoins

    def _serves(self, w: Worker) -> bool:
        """Whether requests wait on ``w``: it decodes them, or their KV has yet to come from it."""
        for att_id in w.attempts:
            att = self._attempts.get(att_id)
            if att is not None and (att.decode == w.id or not att.kv_arrived):
                return True
        return False

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
            for w in list(self.workers.values()):
                if w.health != "healthy":
                    continue
                silent = now - w.last_heartbeat
                if silent > self.config.heartbeat_timeout_s:
                    self._worker_lost(w, "heartbeat_timeout", silent_s=round(silent, 4))
                elif (on_time and w.steps is not None and silent > self.config.hang_timeout_s
                      and self._serves(w)):
                    self._worker_lost(w, "no_progress", silent_s=round(silent, 4), steps=w.steps)

    def record_event(self, kind: str, **detail) -> None:
        event = {"seq": next(self._event_seq), "type": kind, "wall_time": time.time(),
                 "monotonic": time.monotonic(), **detail}
        self.events.append(event)
        log.info("event %s", event)

    def fault(self, worker_id: str, spec: dict) -> dict:
        w = self.workers.get(worker_id)
        if w is None or w.health != "healthy":
            raise InvalidRequestError(f"no healthy worker {worker_id!r}", param="worker_id", status=404)
        allowed = {"corrupt_frames"}
        if not spec or set(spec) - allowed or not all(isinstance(v, int) and v >= 0 for v in spec.values()):
            raise InvalidRequestError(f"fault must be an object with {sorted(allowed)} as non-negative integers, "
                                      f"got {spec!r}", param="fault")
        w.send({"type": "fault", **spec})
        self.record_event("fault_hook", worker=worker_id, **spec)
        return {"worker": worker_id, **spec}

    def set_transfer(self, spec: dict) -> dict:
        """Replace the KV transfer settings sent with every later prefill (TransferConfig fields)."""
        try:
            TransferConfig.from_dict(spec)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc), param="transfer") from None
        self.config.transfer = dict(spec)
        self.record_event("transfer_config", **spec)
        return dict(spec)
