"""PD router: the global scheduler in front of N prefill and M decode worker processes.

- Control plane: workers connect to the router's control port and register; each connection
  carries the typed messages of control/messages.py both ways (commands down, heartbeats and
  tokens up). worker_sessions.py runs those connections: registration, liveness (a broken
  connection, ``heartbeat_timeout_s``, or ``hang_timeout_s`` without progress beats while serving
  marks the worker dead) and handing each message on. Workers join and leave the routing table
  (control/routing.py: the one owner of worker state and counters) without a router restart.
- Scheduling (seed Section 5.3): the least-queued prefill worker; the decode target is the
  least-loaded worker whose free KV exceeds ``kv_headroom_factor`` (1.2) x the request's KV;
  when none fits the request waits in the admission queue.
- Rescheduling: a request whose decode worker dies, or whose prefill worker dies before its KV
  arrived, is placed again and re-prefilled with prompt + the tokens already streamed
  (``resume_token_ids``), so the client stream continues with no duplicated or missing token;
  when no worker can take it, it ends with an explicit error event.
- ``Router`` is the EngineClient handed to ``api.build_app``; router_server.py adds
  ``/admin/workers``, ``/admin/events``, fault hooks and metrics, and runs it as a process
  (``python -m harness.engine.pd.router_server``; ``topology.py`` does).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from harness.engine.core.config import EngineConfig
from harness.engine.control.messages import (CorruptFrames, Import, ImportFailed, ImportReady, Prefill, PrefillDone,
                                             PrefillFailed, SetSpeculativeCommand, Tokens, params_dict)
from harness.engine.core.types import EngineStats, FinishReason, GenerateRequest, TokenEvent
from harness.engine.resilience.control import ResilienceControl
from harness.engine.pd.router_config import RouterConfig
from harness.engine.pd.worker_sessions import WorkerSessions
from harness.engine.control.routing import Attempt, ClientAbort, EventLog, RoutingTable, RouterWorker, WorkerLost
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.kvtransfer.config import TransferConfig
from harness.errors import ConfigError, EngineError, InvalidRequestError
from harness.states import EventKind, WorkerHealth, WorkerRole

log = logging.getLogger(__name__)


class _Lost(Exception):
    """The attempt cannot continue (a worker died, the transfer failed); reschedule it."""

    def __init__(self, reason: str, worker: str, at: float) -> None:
        super().__init__(reason)
        self.reason, self.worker, self.at = reason, worker, at   # who was lost, when (monotonic)


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
        self.table = RoutingTable(self.config.kv_headroom_factor, self.config.readmit_delay_s)
        self.events = EventLog(self.config.max_events)
        self._capacity = asyncio.Condition()
        self.counters = {"reschedules": 0, "reschedule_failures": 0, "admission_timeouts": 0}
        self.resilience = ResilienceControl(self.config, self.table, self.events)
        self.sessions = WorkerSessions(self.config, self.table, self.events, self.resilience, self._notify_capacity)

    @property
    def workers(self) -> dict[str, RouterWorker]:
        return self.table.workers

    @property
    def waiting(self) -> int:
        """Requests waiting for a placement (the admission queue)."""
        return self.table.waiting

    def record_event(self, kind: EventKind, **detail: Any) -> None:
        self.events.record(kind, **detail)

    # -- EngineClient
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    def stats(self) -> EngineStats:
        s = EngineStats()
        for w in self.workers.values():
            if w.health != WorkerHealth.HEALTHY:
                continue
            for name in ("num_running", "num_waiting", "prompt_tokens_total", "generation_tokens_total",
                         "spec_draft_tokens", "spec_accepted_tokens"):
                setattr(s, name, getattr(s, name) + int(w.stats.get(name, 0)))
            if w.role == WorkerRole.DECODE:
                s.kv_blocks_used += w.kv_blocks_used
                s.kv_blocks_total += w.kv_blocks_total
                s.kv_block_bytes = int(w.stats.get("kv_block_bytes", s.kv_block_bytes))
                s.spec_enabled = s.spec_enabled or bool(w.stats.get("spec_enabled"))
        s.num_waiting += self.waiting
        s.extra = {"workers_healthy": sum(w.health == WorkerHealth.HEALTHY for w in self.workers.values()),
                   "admission_queue": self.waiting}
        return s

    async def set_speculative(self, enabled: bool) -> None:
        for w in self.workers.values():
            w.send(SetSpeculativeCommand(bool(enabled)))

    async def abort(self, request_id: str) -> None:
        for att in list(self.table.attempts.values()):
            if att.request_id == request_id:
                att.inbox.put_nowait(ClientAbort())

    async def close(self) -> None:
        self.resilience.stop()
        await self.sessions.close()

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
                    self.record_event(EventKind.RESCHEDULE_FAILED, request_id=request.request_id, error=str(exc))
                yield self._error(request, streamed, str(exc))
                return
            if resumed:
                self.record_event(EventKind.RESCHEDULE, request_id=request.request_id, from_worker=lost_worker,
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
                        self.record_event(EventKind.RESUMED, request_id=request.request_id, worker=att.decode,
                                    since_loss_s=round(time.monotonic() - lost_at, 4))
                    first = False
                    if ev.finished:
                        how = "finished"
                        self._release(att, how)  # before the last event leaves: a migration in flight is moot
                        yield ev
                        return
                    yield ev
            except _Lost as exc:
                lost_worker, lost_at, reason = exc.worker, exc.at, exc.reason
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

    async def _place(self, request: GenerateRequest, n: int, streamed: list[int], resumed: bool) -> Attempt:
        timeout = self.config.reschedule_wait_s if resumed else self.config.admission_timeout_s
        deadline = time.monotonic() + timeout
        with self.table.waiting_for_placement():
            async with self._capacity:
                while True:
                    picked = self.table.pick(lambda block_size: self._blocks_needed(request, streamed, block_size))
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
        prefill, decode, blocks = picked
        att = Attempt(f"{request.request_id}#{n}", prefill.id, decode.id, blocks, asyncio.Queue(), request, streamed)
        self.table.place(att)
        return att

    def _release(self, att: Attempt, how: str = "ended") -> None:
        if att.id not in self.table.attempts:
            return
        self.resilience.migration.cancel(att, how)
        self.table.release(att)
        asyncio.get_running_loop().create_task(self._notify_capacity())

    async def _notify_capacity(self) -> None:
        async with self._capacity:
            self._capacity.notify_all()

    # -- one placement of a request
    async def _run(self, att: Attempt, request: GenerateRequest, streamed: list[int]) -> AsyncIterator[TokenEvent]:
        decode, prefill = self.workers[att.decode], self.workers[att.prefill]
        body = dict(rid=att.id, prompt_token_ids=list(request.prompt_token_ids), resume_token_ids=list(streamed),
                    params=params_dict(request.params), attempt=att.number)
        decode.send(Import(**body))
        prefill_sent = False
        while True:
            item = await att.inbox.get()
            if isinstance(item, WorkerLost):
                if item.worker == att.decode or not att.kv_arrived:
                    raise _Lost(f"worker {item.worker} lost ({item.reason})", item.worker, item.at)
                continue
            if isinstance(item, ClientAbort):
                yield TokenEvent(request.request_id, [], "", True, FinishReason.ABORT,
                                 num_output_tokens=len(streamed))
                return
            worker, msg = item
            if isinstance(msg, ImportReady) and not prefill_sent:
                prefill.send(Prefill(**body, transfer=dict(self.config.transfer),
                                     target={"kv": list(decode.kv_addr), "control": list(decode.control_addr)}))
                prefill_sent = True
            elif isinstance(msg, Tokens):
                self.table.kv_arrived(att)
                att.pending.append((worker, msg))
                while (part := self._next_in_order(att, len(streamed))) is not None:
                    yield self._token_event(request, att, *part)
            elif isinstance(msg, PrefillDone):
                self.table.kv_arrived(att)
                self.record_event(EventKind.KV_TRANSFER, request_id=request.request_id, prefill=att.prefill, decode=att.decode,
                            mode=self.config.transfer.get("mode", "layerwise"), prefill_s=msg.prefill_s,
                            transfer_s=msg.seconds, bytes=msg.bytes, path=msg.path,
                            retries=msg.retries, fallback=msg.fallback)
            elif isinstance(msg, (ImportFailed, PrefillFailed)):
                raise _Lost(f"{msg.TYPE} on {worker}: {msg.error}", worker, time.monotonic())

    def _next_in_order(self, att: Attempt, have: int) -> tuple[str, Tokens] | None:
        """The next tokens message that continues the stream at ``have`` tokens. During a live
        migration both the source (until it paused) and the target may send the same positions,
        and the target's first tokens may overtake the source's last ones: duplicates are dropped,
        overlaps trimmed, and a message that starts past ``have`` waits for the gap to fill."""
        for item in list(att.pending):
            worker, m = item
            end = m.num_output_tokens
            start = end - len(m.token_ids)
            if end <= have and not (m.finished and start == end):
                att.pending.remove(item)  # everything in it was streamed already
                if m.finished:            # ...but the end of the stream still counts
                    return worker, replace(m, token_ids=[], text="")
            elif start <= have:
                att.pending.remove(item)
                if start < have:
                    tokens = m.token_ids[have - start:]
                    m = replace(m, token_ids=tokens, text=self._tokenizer.decode(tokens))
                return worker, m
        return None

    def _token_event(self, request: GenerateRequest, att: Attempt, worker: str, msg: Tokens) -> TokenEvent:
        now = time.monotonic()
        if msg.token_ids:
            if att.last_worker is not None and worker != att.last_worker:
                # the stall a migrated stream sees: last token from the source to first from the target
                gaps = sorted(att.gaps)
                self.record_event(EventKind.MIGRATION_RESUMED, request_id=request.request_id, from_worker=att.last_worker,
                                  to_worker=worker, stall_s=round(now - att.last_active, 6),
                                  at_token=msg.num_output_tokens - len(msg.token_ids),
                                  typical_gap_s=round(gaps[len(gaps) // 2], 6) if gaps else None)
            elif att.last_worker is not None:
                att.gaps.append(now - att.last_active)
            att.last_active, att.last_worker = now, worker
        return TokenEvent(request.request_id, msg.token_ids, msg.text, msg.finished,
                          FinishReason(msg.finish_reason) if msg.finish_reason else None,
                          num_output_tokens=msg.num_output_tokens, worker=worker, error=msg.error)

    # -- control plane
    async def start_control(self, host: str, port: int, sock=None) -> tuple[str, int]:
        """Listen for workers on ``host:port`` (or ``sock``); returns the address bound."""
        address = await self.sessions.start(host, port, sock)
        self.resilience.start()
        return address

    def fault(self, worker_id: str, spec: dict) -> dict:
        w = self.workers.get(worker_id)
        if w is None or w.health != WorkerHealth.HEALTHY:
            raise InvalidRequestError(f"no healthy worker {worker_id!r}", param="worker_id", status=404)
        allowed = {"corrupt_frames"}
        if not spec or set(spec) - allowed or not all(isinstance(v, int) and v >= 0 for v in spec.values()):
            raise InvalidRequestError(f"fault must be an object with {sorted(allowed)} as non-negative integers, "
                                      f"got {spec!r}", param="fault")
        w.send(CorruptFrames(**spec))
        self.record_event(EventKind.FAULT_HOOK, worker=worker_id, **spec)
        return {"worker": worker_id, **spec}

    def set_transfer(self, spec: dict) -> dict:
        """Replace the KV transfer settings sent with every later prefill (TransferConfig fields)."""
        try:
            TransferConfig.from_dict(spec)
        except ConfigError as exc:
            raise InvalidRequestError(str(exc), param="transfer") from None
        self.config.transfer = dict(spec)
        self.record_event(EventKind.TRANSFER_CONFIG, **spec)
        return dict(spec)
