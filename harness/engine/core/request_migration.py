"""EngineCore's live-migration entry points: lift a request out with its KV (``export_request``),
join one (``import_request``), and the pause / read / resume / release steps of a live migration's
source side. A mixin of EngineCore: it works on the engine's requests, KV pool and scheduler."""

from __future__ import annotations

import logging
from dataclasses import replace

from harness.engine.core.config import ModelConfig
from harness.engine.core.handoff import ExportedRequest
from harness.engine.core.kv_cache import KVBlockPool
from harness.engine.core.offload import OffloadManager
from harness.engine.core.scheduler import RequestStatus, Scheduler, Sequence
from harness.errors import EngineError, InvalidRequestError, KVIntegrityError

logger = logging.getLogger(__name__)


class RequestMigration:
    """Migration methods of EngineCore (which provides the attributes below and ``_finish``,
    ``_new_sequence``, ``_join_running``)."""

    requests: dict[str, Sequence]
    pool: KVBlockPool
    scheduler: Scheduler
    offload: OffloadManager
    model_config: ModelConfig

    def export_request(self, request_id: str) -> ExportedRequest:
        """Lift a request (and its KV, checksummed) out of this engine; emits no event."""
        seq = self.requests.get(request_id)
        if seq is None:
            raise EngineError(f"no active request {request_id!r} to export",
                              fix="export a request that is running on this engine")
        nb = self.pool.blocks_for(seq.num_computed)
        blocks = [self.pool.export_block(b) for b in seq.block_table[:nb]]
        exported = ExportedRequest(request=seq.req, output_token_ids=list(seq.tracker.output_ids), seed=seq.seed,
                                   num_computed=seq.num_computed, blocks=blocks, pending_token=seq.pending_token)
        self._finish(seq)
        return exported

    def import_request(self, exported: ExportedRequest) -> None:
        """Join a migrated request to this engine; every block's checksum is verified first."""
        for payload in exported.blocks:
            payload.verify()
        req = exported.request
        if req.request_id in self.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        if len(exported.blocks) != self.pool.blocks_for(exported.num_computed):
            raise KVIntegrityError(f"{len(exported.blocks)} blocks cannot hold {exported.num_computed} tokens",
                                   fix="export and import with the same block_size")
        blocks = self.pool.allocate(self.pool.blocks_for(exported.num_computed + 1))
        try:
            for b, payload in zip(blocks, exported.blocks):
                self.pool.import_block(b, payload)
        except KVIntegrityError:
            self.pool.free(blocks)
            raise
        seq = self._new_sequence(replace(req), exported.seed, list(exported.output_token_ids))
        seq.block_table, seq.num_computed, seq.pending_token = blocks, exported.num_computed, exported.pending_token
        self._join_running(seq)

    def pause_request(self, request_id: str) -> list[int]:
        """Live migration, source side: take a decoding request out of the batch but keep its
        KV (blocks) until ``release_paused`` or ``resume_request``. Returns its tokens (prompt +
        output); the KV of all but the last is cached."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.status is RequestStatus.SWAPPED and not self.offload.fetch_now(seq):
            raise EngineError(f"request {request_id!r} is offloaded and its KV cannot come back to HBM now",
                              fix="migrate a resident request, or retry when blocks are free")
        if seq is None or seq.status is not RequestStatus.RUNNING:
            raise EngineError(f"request {request_id!r} is not running here "
                              f"({seq.status.value if seq else 'unknown'})",
                              fix="migrate a request while it decodes on this worker")
        if seq.pending_token is not None or seq.num_tokens - seq.num_computed != 1:
            raise EngineError(f"request {request_id!r} is not decoding yet (prefill or first token pending)",
                              fix="retry the migration after its first token")
        self.scheduler.running.remove(seq)
        seq.status = RequestStatus.PAUSED
        return list(seq.tokens)

    def read_kv(self, request_id: str, num_tokens: int):
        """Yield (k, v) per layer, each [num_tokens, KVH, hd], copied out of the request's blocks."""
        seq = self.requests[request_id]
        assert num_tokens <= seq.num_computed, "reading KV that is not computed"
        for layer in range(self.model_config.n_layers):
            yield self.pool.gather(layer, seq.block_table, num_tokens)

    def resume_request(self, request_id: str) -> bool:
        """Undo ``pause_request`` (the migration failed): the request decodes here again."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not RequestStatus.PAUSED:
            return False
        self.scheduler.join_running(seq)
        if self.pool.quarantined & set(seq.block_table):  # poisoned while paused: never decode from it
            logger.warning("request %s lost KV to poisoning while paused; recomputing it", request_id)
            self.scheduler.preempt(seq)
        return True

    def release_paused(self, request_id: str) -> bool:
        """The target took over: drop the paused request and free its KV, emitting no event."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not RequestStatus.PAUSED:
            return False
        self._finish(seq)
        return True


__all__ = ["RequestMigration"]
