"""EngineCore: continuous batching over the paged KV cache, one synchronous ``step()`` at a time.

Each step: emit first tokens of requests imported from a prefill worker, let the scheduler
(``scheduler.py``) pick prefill chunks and admissions, then run ONE packed forward pass holding
those prefill chunks and one decode token of every running request (greedy requests go through
the speculative decoder instead when it is on), sample, and apply the stop rules. A request's
next token is always computed by feeding ``tokens[num_computed:]``: a fresh request feeds its
prompt (+ resumed tokens), a running one its last token, a preempted one everything again
(recompute), so all three paths are the same code.

The engine is not thread-safe: call it from one thread (clients run it in a dedicated thread
or process). PD entry points (``prefill_for_transfer``, ``begin_import`` ...) and fault hooks are methods here
too, live migration's (``export_request``, ``pause_request`` ...) come from request_migration.py (what they
hand over: handoff.py); see docs/engine.md.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable

import torch
from torch import Tensor

from harness.engine.core.config import EngineConfig
from harness.engine.core.handoff import ExportedRequest, ImportHandle, PrefillResult
from harness.engine.core.kv_cache import KVBlockPool, PagedAttention
from harness.engine.core.request_migration import RequestMigration
from harness.engine.core.model import DenseKV, load_model
from harness.engine.core.offload import OffloadManager
from harness.engine.core.output import OutputTracker
from harness.engine.core.types import EngineStats, FinishReason, GenerateRequest, TokenEvent
from harness.engine.core.sampling import resolve_seed, sample_token
from harness.engine.core.scheduler import RequestStatus, Scheduler, Sequence
from harness.engine.core.spec_decode import SpeculativeDecoder
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import EngineError, InvalidRequestError, KVCapacityError, KVIntegrityError

logger = logging.getLogger(__name__)


def validate_request(config: EngineConfig, req: GenerateRequest) -> None:
    """Reject malformed requests before they reach the engine (raises InvalidRequestError)."""
    tok = ByteTokenizer()
    if not req.prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    tok.validate(req.prompt_token_ids)
    tok.validate(req.resume_token_ids, "resume_token_ids")
    n = len(req.prompt_token_ids) + len(req.resume_token_ids)
    if n >= config.context_len:
        raise InvalidRequestError(f"prompt of {n} tokens leaves no room to generate: max_model_len is "
                                  f"{config.context_len}", param="prompt", code="context_length_exceeded")


class EngineCore(RequestMigration):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model
        self.tokenizer = ByteTokenizer()
        self.device = config.torch_device()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = load_model(self.model_config, self.device)
        cfg = self.model_config
        self.pool = KVBlockPool(config.num_blocks, cfg.n_layers, cfg.n_kv_heads, config.block_size,
                                cfg.head_dim, cfg.torch_dtype, self.device)
        self.spec = SpeculativeDecoder(self.model, self.pool, config.spec_draft_layers, config.spec_num_tokens)
        self.spec_enabled = config.speculative
        self.scheduler = Scheduler(self.pool, config.max_batch, config.max_prefill_tokens, config.context_len,
                                   cfg.max_seq_len)
        self.requests: dict[str, Sequence] = {}
        self._events: list[TokenEvent] = []   # produced outside step(), returned by the next step()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.held_blocks: list[int] = []  # taken out of service by an HBM-fill fault
        self.offload = OffloadManager(self.pool, self.scheduler, enabled=config.offload,
                                      threshold=config.offload_threshold, cpu_bytes=config.offload_cpu_bytes,
                                      nvme_bytes=config.offload_nvme_bytes, nvme_dir=config.offload_dir,
                                      protect_priority=config.offload_protect_priority,
                                      min_resident_steps=config.offload_min_resident_steps)
        logger.info("engine %s: preset %s on %s, %d KV blocks of %d bytes", config.name, cfg.name,
                    self.device, config.num_blocks, self.pool.block_bytes)

    # ---- request lifecycle ---------------------------------------------------------------

    def add_request(self, req: GenerateRequest) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        validate_request(self.config, req)
        seq = self._new_sequence(req, resolve_seed(req.params), list(req.resume_token_ids))
        if seq.tracker.finished:  # resumed tokens already reach max_tokens
            self._events.append(self._event(seq, [], ""))
            return
        self.requests[req.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None:
            return
        seq.tracker.finish_reason = FinishReason.ABORT
        self._finish(seq)
        self._events.append(self._event(seq, [], ""))

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._events or self.offload.swapped)

    def set_speculative(self, enabled: bool) -> None:
        self.spec_enabled = bool(enabled)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.pool.num_used, kv_blocks_total=self.pool.num_blocks,
            kv_block_bytes=self.pool.block_bytes, spec_enabled=self.spec_enabled,
            spec_draft_tokens=self.spec.draft_tokens_total, spec_accepted_tokens=self.spec.accepted_tokens_total,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            extra={"preemptions_total": float(self.scheduler.preemptions_total),
                   "kv_blocks_free": float(self.pool.num_free),
                   "kv_blocks_quarantined": float(len(self.pool.quarantined)),
                   "kv_blocks_poisoned": float(len(self.pool.poisoned)),
                   "kv_blocks_held": float(len(self.held_blocks)),
                   **{f"offload_{tier}_bytes": float(n) for tier, n in self.offload.store.used.items()},
                   "offload_fetch_seconds_mean": self.offload.stats()["offload_fetch_s"],
                   "kv_requests_swapped": float(len(self.offload.swapped))})

    def set_offload(self, enabled: bool, threshold: float | None = None) -> None:
        """Level 3: swap KV to the CPU/NVMe tiers above ``threshold`` of the pool (offload.py)."""
        self.offload.set_enabled(enabled, threshold)

    def offload_stats(self) -> dict:
        return self.offload.stats()

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        events, self._events = self._events, []
        if self.offload.enabled or self.offload.swapped:
            self.offload.rebalance()  # swapped requests come back before their next decode
        running = self.scheduler.running
        for seq in [s for s in running if s.pending_token is not None]:
            events.append(self._emit_pending(seq))
        prefills, rejected = self.scheduler.plan_prefills()  # [(seq, tokens to feed this step)]
        self.prompt_tokens_total += sum(n for _, n in prefills)
        for seq, reason in rejected:
            seq.tracker.finish_reason = FinishReason.ERROR
            self._finish(seq)
            events.append(self._event(seq, [], "", error=reason))
        prefilling = {id(seq) for seq, _ in prefills}
        decodes = [s for s in running if id(s) not in prefilling and s.num_tokens - s.num_computed == 1]
        # greedy requests take the speculative path when it is on and their blocks can hold
        # the draft tokens; the rest decode one token (preempting the newest when KV is short)
        spec = [s for s in decodes if self.spec_enabled and s.req.params.greedy
                and self.scheduler.reserve(s, self.config.spec_num_tokens + 1, preempt=False)]
        plain = [s for s in decodes if s not in spec and s.status is RequestStatus.RUNNING
                 and self.scheduler.reserve(s, 1, preempt=True)]
        # a later reservation may have preempted an earlier request, even one admitted above
        batch = [(s, n) for s, n in prefills + [(s, 1) for s in plain] if s.status is RequestStatus.RUNNING]
        spec = [s for s in spec if s.status is RequestStatus.RUNNING]
        if batch:
            events.extend(self._run_batch(batch))
        if spec:
            results = self.spec.step([(s.block_table, s.num_computed, s.tokens[-1]) for s in spec])
            for seq, tokens in zip(spec, results):
                events.append(self._emit(seq, tokens, computed=True))
        return events

    def run_to_completion(self) -> dict[str, list[TokenEvent]]:
        """Step until idle; returns every event, grouped by request (benchmarks, tests, tools)."""
        events: dict[str, list[TokenEvent]] = {}
        while self.has_work():
            for event in self.step():
                events.setdefault(event.request_id, []).append(event)
        return events

    def _run_batch(self, batch: list[tuple[Sequence, int]]) -> list[TokenEvent]:
        """One packed forward pass feeding n tokens of each sequence from num_computed on; a
        sequence whose fed tokens reach its end samples its next token."""
        segments, tokens, positions, last = [], [], [], []
        for seq, n in batch:
            start = seq.num_computed
            segments.append((seq.block_table, start, n))
            tokens += seq.tokens[start:start + n]
            positions += range(start, start + n)
            last.append(len(tokens) - 1)
        model = self.model
        hidden = model.forward(model.tensor(tokens), model.tensor(positions),
                               PagedAttention(self.pool, segments))          # [T, d]
        logits = model.logits(hidden[model.tensor(last)])                       # [B, V]
        events = []
        for (seq, n), row in zip(batch, logits):
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                token = sample_token(row, seq.req.params, seq.seed, len(seq.tracker.output_ids))
                events.append(self._emit(seq, [token]))
        return events

    def _emit(self, seq: Sequence, tokens: list[int], computed: bool = False) -> TokenEvent:
        """Append new tokens until a stop rule fires; ``computed``: all but the last have K/V."""
        appended = []
        for token in tokens:
            appended.append(token)
            if seq.tracker.append(token):
                break
        if computed:
            seq.num_computed += len(appended)
        self.generation_tokens_total += len(appended)
        text = seq.tracker.take_text()
        if seq.tracker.finished:
            self._finish(seq)
        return self._event(seq, appended, text)

    def _emit_pending(self, seq: Sequence) -> TokenEvent:
        token, seq.pending_token = seq.pending_token, None
        return self._emit(seq, [token])

    def _finish(self, seq: Sequence) -> None:
        if seq.status is RequestStatus.SWAPPED:
            self.offload.discard(seq)
        self.scheduler.remove(seq)
        self.requests.pop(seq.req.request_id, None)

    def _event(self, seq: Sequence, tokens: list[int], text: str, error: str | None = None) -> TokenEvent:
        return TokenEvent(request_id=seq.req.request_id, token_ids=tokens, text=text,
                          finished=seq.tracker.finished, finish_reason=seq.tracker.finish_reason,
                          num_prompt_tokens=len(seq.req.prompt_token_ids),
                          num_output_tokens=len(seq.tracker.output_ids), worker=self.config.name, error=error)

    def _new_sequence(self, req: GenerateRequest, seed: int, output_ids: list[int]) -> Sequence:
        tracker = OutputTracker(self.tokenizer, req.params, len(req.prompt_token_ids), self.config.context_len,
                                output_ids)
        return Sequence(req=req, tracker=tracker, seed=seed)

    # ---- PD: prefill side ----------------------------------------------------------------

    def prefill_for_transfer(self, req: GenerateRequest,
                             on_layer: Callable[[int, Tensor, Tensor], None] | None = None) -> PrefillResult:
        """Prefill prompt (+ resume tokens) densely, calling ``on_layer(i, k, v)`` as each layer's
        K/V ([num_tokens, KVH, hd]) is ready; keeps nothing in this engine's KV cache."""
        validate_request(self.config, req)
        tokens = req.prompt_token_ids + list(req.resume_token_ids)
        kv = DenseKV(self.model_config.n_layers)
        model = self.model
        hidden = model.forward(model.tensor(tokens), model.tensor(list(range(len(tokens)))), kv,
                               on_layer=on_layer)
        seed = resolve_seed(req.params)
        if req.params.seed is None and not req.params.greedy:
            logger.warning("request %s samples without a seed: the decode side cannot reproduce it",
                           req.request_id)
        first = sample_token(model.logits(hidden[-1:])[0], req.params, seed, len(req.resume_token_ids))
        self.prompt_tokens_total += len(tokens)
        return PrefillResult(first_token_id=first, num_tokens=len(tokens), kv=list(zip(kv.k, kv.v)))

    # ---- PD: decode side -----------------------------------------------------------------

    def begin_import(self, req: GenerateRequest, num_tokens: int, extra_tokens: int = 0) -> ImportHandle:
        """Reserve blocks for ``num_tokens`` of KV plus the first decode, and for up to
        ``extra_tokens`` more when that many blocks are free (see ``ImportHandle.resize``)."""
        validate_request(self.config, req)
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        expected = len(req.prompt_token_ids) + len(req.resume_token_ids)
        if num_tokens != expected:
            raise KVIntegrityError(f"import of {num_tokens} tokens for a request with {expected} prompt+resume "
                                   "tokens", fix="send the KV of exactly prompt + resume tokens")
        need = self.pool.blocks_for(num_tokens + 1)  # +1: room for the first decode
        extra_tokens = max(0, min(extra_tokens, self.config.context_len - 1 - num_tokens))
        more = self.pool.blocks_for(num_tokens + 1 + extra_tokens) - need
        blocks = self.pool.allocate(need + (more if self.pool.num_free >= need + more else 0))
        return ImportHandle(self.pool, self.model_config, req, num_tokens, blocks)

    def commit_import(self, handle: ImportHandle, first_token_id: int, *, stream_first: bool = True) -> None:
        """Join the imported request. ``stream_first=False`` (live migration): the first token was
        already streamed by the source, so it only becomes the next token to feed."""
        missing = set(range(self.model_config.n_layers)) - handle.layers_written
        if missing:
            self.cancel_import(handle)
            raise KVIntegrityError(f"import of {handle.req.request_id} committed with layers {sorted(missing)} "
                                   "missing; its blocks were freed", fix="resend every layer, then commit")
        self.tokenizer.validate([first_token_id], "first_token_id")
        streamed = list(handle.req.resume_token_ids) + ([] if stream_first else [first_token_id])
        seq = self._new_sequence(handle.req, resolve_seed(handle.req.params), streamed)
        seq.block_table, handle.blocks = handle.blocks, []
        seq.num_computed = handle.num_tokens
        if stream_first:
            seq.pending_token = first_token_id
        self._join_running(seq)

    def cancel_import(self, handle: ImportHandle) -> None:
        if handle.blocks:
            self.pool.free(handle.blocks)
            handle.blocks = []

    # ---- fault hooks (chaos faults reach these through a worker's admin API) ---------------

    def hold_kv_blocks(self, n: int) -> int:
        """HBM fill: take n free blocks out of service as if another tenant used the memory.
        Returns how many blocks are held in all; raises KVCapacityError when fewer are free."""
        self.held_blocks += self.pool.allocate(n)
        self.pool.num_held = len(self.held_blocks)
        return len(self.held_blocks)

    def release_kv_blocks(self, blocks: list[int] | None = None) -> int:
        """Revert holds (all, or just ``blocks``); returns how many blocks went back to the pool."""
        released = self.held_blocks if blocks is None else [b for b in blocks if b in self.held_blocks]
        self.held_blocks = [b for b in self.held_blocks if b not in set(released)]
        self.pool.num_held = len(self.held_blocks)
        self.pool.free(released)
        return len(released)

    def poison_kv_block(self, block: int | None = None) -> dict:
        """ECC poisoning: one block's memory goes bad (its bytes become NaN). With ``ecc_handling``
        the block is quarantined and the request whose KV it held is preempted and recomputed from
        its tokens, so that request's output stays exact; without it the block stays in service
        and its request keeps decoding from the bad KV (its output goes wrong). ``block=None``
        picks the first block of the oldest running request. Returns {"block", "request_id",
        "request_ids"} (the requests whose KV was on it; request_id the first, None if unused)."""
        if block is None:
            owners = [s for s in self.scheduler.running if s.block_table]
            if not owners:
                raise EngineError("no running request holds KV to poison",
                                  fix="poison while requests are decoding, or name a block")
            block = owners[0].block_table[0]
        handling = self.config.ecc_handling
        self.pool.poison(block, quarantine=handling)
        # every request on the block (a shared block has several; each must recompute)
        owners = [s for s in self.requests.values() if block in s.block_table]
        for owner in owners:
            if not handling:
                logger.warning("KV block %d is poisoned and ECC handling is off: request %s keeps reading it",
                               block, owner.req.request_id)
            elif owner.status is RequestStatus.RUNNING:
                logger.warning("KV block %d is poisoned: recomputing request %s", block, owner.req.request_id)
                if owner.pending_token is not None:  # an imported first token: stream it first
                    self._events.append(self._emit_pending(owner))
                if owner.status is RequestStatus.RUNNING:
                    self.scheduler.preempt(owner)
        ids = [s.req.request_id for s in owners]
        return {"block": block, "request_id": ids[0] if ids else None, "request_ids": ids}

    def poison_kv_blocks(self, count: int = 0, blocks: list[int] | None = None) -> dict:
        """Poison ``blocks``, or ``count`` blocks chosen among the running requests' KV first
        (so the fault bites), then free ones. Returns {"blocks", "request_ids"} (affected)."""
        if blocks is None:
            tables = [s.block_table[:self.pool.blocks_for(s.num_computed)] for s in self.scheduler.running]
            # round-robin over requests: the first block of each, then the second ... (bite many)
            in_use = [b for layer in itertools.zip_longest(*tables) for b in layer if b is not None]
            candidates = list(dict.fromkeys(in_use + list(self.pool.free_blocks)))
            if count > len(candidates):
                raise KVCapacityError(f"cannot poison {count} KV blocks: {len(candidates)} are in service",
                                      fix="poison fewer blocks or clear earlier poisoning")
            blocks = candidates[:count]
        affected = [rid for b in blocks for rid in self.poison_kv_block(b)["request_ids"]]
        return {"blocks": list(blocks), "request_ids": sorted({r for r in affected if r is not None})}

    def restore_quarantined_blocks(self, blocks: list[int] | None = None) -> int:
        """Revert poisoning (the page is replaced): poisoned blocks (all, or ``blocks``) get zeroed
        memory; quarantined ones that nothing references return to service."""
        return self.pool.restore(blocks)

    def _join_running(self, seq: Sequence) -> None:
        self.requests[seq.req.request_id] = seq
        self.scheduler.join_running(seq)


__all__ = ["EngineCore", "ExportedRequest", "ImportHandle", "PrefillResult", "RequestStatus",
           "validate_request", "KVCapacityError"]
