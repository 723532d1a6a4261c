"""Live KV migration of a running request between two decode workers (seed Section 3.1), worker side.

Protocol (the router orchestrates; ``num_tokens`` = prompt + every output token streamed so far):

1. target gets ``MigrateIn`` {rid, request, num_tokens, generated} (messages.py): it reserves
   blocks for the KV of all tokens but the last generated one, plus ``EXTRA_KV_TOKENS`` more, and
   answers ``migrate_ready`` {max_kv_tokens}.
2. source gets ``MigrateOut`` {rid, num_tokens, max_kv_tokens, target_kv: [host,
   port], "target_control": [host, port] (optional fallback), "target_id", "transfer": {...}}``: it
   pauses the request (no more tokens), reads its KV out of the blocks and sends it with the PD
   sender (checksummed frames, retries, fallback path). The source kept decoding while the target
   prepared, so it holds more tokens than the router's ``num_tokens``: it sends the KV of all it
   holds but its last token (up to ``max_kv_tokens``), so the target never recomputes tokens the
   client already has. The END frame carries the output tokens from the router's last one on;
   the target checks the first against its own ``generated`` before it commits, so the two sides
   can never disagree silently about where the stream is.
3. once the target has every layer it commits (``migrate_committed``) and decodes the next
   token; the source then frees the request's KV and reports ``migrated`` {export_s,
   transfer_s, bytes, path, retries, fallback}. On any failure the source resumes the request
   and reports ``migrate_failed`` {error}: the stream continues on the source.

The transfer is keyed ``{rid}@m{kv_tokens}`` so it never collides with the PD import of the
same request, nor with an earlier migration of it; the target learns ``kv_tokens`` from that key
when the first frame arrives.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from harness.engine.core.engine_core import EngineCore, ImportHandle
from harness.engine.control.messages import (Message, MigrateCommitted, MigrateFailed, MigrateIn, MigrateOut,
                                             MigrateReady, Migrated, TransferEvent, request_from_dict)
from harness.engine.kvtransfer.transfer import (PATH_CONTROL, PATH_FABRIC, Endpoint, KVLayout, KVSender, TransferConfig,
                                     TransferStats)
from harness.engine.control.worker_stats import RecentWindow
from harness.errors import EngineError, HarnessError, KVIntegrityError

log = logging.getLogger(__name__)


# Tokens the source may decode between the router's snapshot and its pause (a few steps; more
# with speculative decoding); beyond them the target recomputes, which the router deduplicates.
EXTRA_KV_TOKENS = 32


def transfer_id(rid: str, kv_tokens: int) -> str:
    return f"{rid}@m{kv_tokens}"


def parse_transfer_id(tid: str) -> tuple[str, int] | None:
    rid, sep, n = tid.rpartition("@m")
    return (rid, int(n)) if sep and n.isdigit() else None


@dataclass
class _Incoming:
    rid: str
    handle: ImportHandle
    generated: list[int]        # the router's view: every output token streamed so far
    started: float
    tid: str | None = None      # bound when the source's first frame names its KV length


class MigrationHost(Protocol):
    """What live migration needs from the worker's engine half (worker_engine.WorkerEngine)."""
    id: str
    transfer_stats: TransferStats
    window: RecentWindow

    def publish(self, msg: Message) -> None: ...
    def run_on_engine(self, fn: Callable[[], None]) -> None: ...
    def run_in_background(self, fn: Callable, *args) -> None: ...
    def bind_import(self, tid: str, handle: ImportHandle, num_tokens: int) -> KVLayout: ...
    def take_import(self, tid: str) -> ImportHandle | None: ...
    def layout(self, tid: str) -> KVLayout | None: ...


class WorkerLiveMigration:
    def __init__(self, core: EngineCore, host: MigrationHost) -> None:
        self.worker = host
        self.core = core
        self._incoming: dict[str, _Incoming] = {}   # attempt id -> import in progress
        self._bind_lock = threading.Lock()           # receiver threads bind transfers

    # ---- target side (engine thread) -----------------------------------------------------

    def migrate_in(self, msg: MigrateIn) -> None:
        rid = msg.rid
        try:
            req = request_from_dict(msg.request, rid)
            generated = list(msg.generated)
            if not generated:
                raise EngineError(f"migrate_in {rid}: no generated token yet",
                                  fix="migrate a request after its first token")
            num_tokens = len(req.prompt_token_ids) + len(generated)
            if msg.num_tokens != num_tokens:
                raise EngineError(f"migrate_in {rid}: num_tokens {msg.num_tokens} != prompt "
                                  f"{len(req.prompt_token_ids)} + generated {len(generated)}",
                                  fix="num_tokens counts the prompt and every output token streamed so far")
            if rid in self._incoming:
                raise EngineError(f"migrate_in {rid}: a migration of it into this worker is in progress",
                                  fix="wait for the first migration to finish")
            req.resume_token_ids = generated[:-1]
            handle = self.core.begin_import(req, num_tokens - 1, extra_tokens=EXTRA_KV_TOKENS)
        except (HarnessError, KeyError, TypeError, ValueError) as exc:
            self.worker.publish(MigrateFailed(rid, str(exc), side="target"))
            return
        self._incoming[rid] = _Incoming(rid, handle, generated, time.perf_counter())
        self.worker.publish(MigrateReady(rid, num_tokens, handle.capacity))

    def layout(self, tid: str) -> KVLayout | None:
        """Receiver thread: the layout of migration transfer ``tid`` (``{rid}@m{kv_tokens}``),
        bound to its import on first sight; None when no migration of that size is expected."""
        parsed = parse_transfer_id(tid)
        incoming = self._incoming.get(parsed[0]) if parsed else None
        if incoming is None:
            return None
        with self._bind_lock:
            if incoming.tid is None:
                base = incoming.handle.num_tokens
                if not base <= parsed[1] <= incoming.handle.capacity:
                    log.warning("%s: the source sends %d tokens of KV; %d..%d were reserved", incoming.rid,
                                parsed[1], base, incoming.handle.capacity)
                    return None
                incoming.handle.resize(parsed[1])
                self.worker.bind_import(tid, incoming.handle, parsed[1])
                incoming.tid = tid
        return self.worker.layout(tid) if incoming.tid == tid else None

    def check_complete(self, tid: str, last_token: int, tokens: list[int] | None) -> None:
        """Receiver thread, before the END reply: refuse a stream that ends elsewhere than expected.
        ``tokens``: the source's output tokens from the router's last one through ``last_token``."""
        parsed = parse_transfer_id(tid)
        incoming = self._incoming.get(parsed[0]) if parsed else None
        if incoming is None or incoming.tid != tid:
            return
        tokens = [last_token] if tokens is None else tokens
        base = len(incoming.handle.req.prompt_token_ids) + len(incoming.generated) - 1
        if (not tokens or tokens[0] != incoming.generated[-1] or tokens[-1] != last_token
                or len(tokens) != parsed[1] - base + 1):
            raise KVIntegrityError(f"{incoming.rid}: the source's tokens {tokens[:4]}... (ending {last_token}) "
                                   f"do not continue the router's stream (last token {incoming.generated[-1]}, "
                                   f"{parsed[1] - base} more expected)", fix="migrate with the router's token count")
        # the tokens the source decoded while the import was prepared join the resumed ones
        incoming.handle.req.resume_token_ids = incoming.generated[:-1] + tokens[:-1]

    def commit(self, tid: str, first_token_id: int) -> bool:
        """Engine thread: join the migrated request; False if ``tid`` is not a migration."""
        parsed = parse_transfer_id(tid)
        incoming = self._incoming.get(parsed[0]) if parsed else None
        if incoming is None or incoming.tid != tid:
            return False
        del self._incoming[incoming.rid]
        self.worker.take_import(tid)
        try:
            self.core.commit_import(incoming.handle, first_token_id, stream_first=False)
        except HarnessError as exc:
            self.worker.publish(MigrateFailed(incoming.rid, str(exc), side="target"))
            return True
        self.worker.publish(MigrateCommitted(incoming.rid, time.perf_counter() - incoming.started))
        return True

    def pending(self) -> list[str]:
        """Attempt ids of the migrations into this worker not committed yet."""
        return list(self._incoming)

    def forget(self, rid: str) -> list[str]:
        """Engine thread: drop ``rid``'s pending import; returns the transfer ids the worker must
        cancel (the import itself is cancelled here when no transfer was bound yet)."""
        incoming = self._incoming.pop(rid, None)
        if incoming is None:
            return []
        with self._bind_lock:
            tid, incoming.tid = incoming.tid, ""   # "" binds nothing any more
        if tid:
            return [tid]
        self.core.cancel_import(incoming.handle)
        return []

    # ---- source side ---------------------------------------------------------------------

    def migrate_out(self, msg: MigrateOut) -> None:
        """Engine thread: pause, read the KV out, hand the delivery to a finisher thread."""
        rid, t0 = msg.rid, time.perf_counter()
        try:
            tokens = self.core.pause_request(rid)
        except HarnessError as exc:
            self.worker.publish(MigrateFailed(rid, str(exc), side="source"))
            return
        num_tokens = msg.num_tokens
        if not 1 < num_tokens <= len(tokens):
            self.core.resume_request(rid)
            self.worker.publish(MigrateFailed(rid, side="source", error=(
                f"num_tokens {num_tokens} is outside (1, {len(tokens)}]: the source holds {len(tokens)} tokens")))
            return
        # everything decoded here since the router's snapshot goes along, as far as the target reserved
        max_kv = num_tokens - 1 if msg.max_kv_tokens is None else msg.max_kv_tokens
        kv_tokens = max(num_tokens - 1, min(len(tokens) - 1, max_kv))
        control = msg.target_control
        sender = KVSender(transfer_id(rid, kv_tokens), self.core.model_config.n_layers,
                          Endpoint(*msg.target_kv, PATH_FABRIC),
                          Endpoint(*control, PATH_CONTROL) if control else None,
                          TransferConfig.from_dict(msg.transfer), self.worker.transfer_stats,
                          on_event=lambda kind, **d: self.worker.publish(TransferEvent(rid, kind, d)))
        try:
            for layer, (k, v) in enumerate(self.core.read_kv(rid, kv_tokens)):  # k, v: [kv_tokens, KVH, hd]
                sender.send_layer(layer, k, v)
        except Exception as exc:
            sender.cancel()
            self.core.resume_request(rid)
            self.worker.publish(MigrateFailed(rid, str(exc), side="source"))
            return
        export_s = time.perf_counter() - t0
        self.worker.run_in_background(self._deliver, rid, sender, tokens[num_tokens - 1:kv_tokens + 1],
                                     msg.target_id, export_s)

    def _deliver(self, rid: str, sender: KVSender, tail: list[int], target: str | None, export_s: float) -> None:
        """Finisher thread: wait for the target's confirmation, then free or resume on the engine thread.
        ``tail``: output tokens from the router's last one through the target's first to feed."""
        try:
            res = sender.finish(tail[-1], tokens=tail)
        except Exception as exc:  # whatever went wrong, the stream must go on here
            error = str(exc)
            log.warning("migration of %s to %s failed (%s); it continues here", rid, target, error)
            self.worker.run_on_engine(lambda: self._resume(rid, error))
            return
        done = Migrated(rid, self.worker.id, target, export_s, res.seconds, res.bytes, res.path, res.retries,
                        res.fallback, len(tail) - 1)
        self.worker.run_on_engine(lambda: self._release(rid, done))

    def _release(self, rid: str, done: Migrated) -> None:
        self.core.release_paused(rid)
        self.worker.window.forget(rid)
        self.worker.publish(done)

    def _resume(self, rid: str, error: str) -> None:
        resumed = self.core.resume_request(rid)
        self.worker.publish(MigrateFailed(rid, error, side="source", resumed=resumed))
