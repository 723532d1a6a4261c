"""What one engine hands another: a prefill's KV (PD), the blocks an arriving request's KV lands in
(``ImportHandle``), a running request lifted out with its KV (live migration). EngineCore makes
and consumes them (``prefill_for_transfer``, ``begin_import`` / ``commit_import``,
``export_request`` / ``import_request``)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from harness.engine.core.config import ModelConfig
from harness.engine.core.kv_cache import KVBlockData, KVBlockPool
from harness.engine.core.types import GenerateRequest
from harness.errors import KVIntegrityError


@dataclass
class PrefillResult:
    first_token_id: int
    num_tokens: int                        # prompt + resume tokens whose K/V are in ``kv``
    kv: list[tuple[Tensor, Tensor]]        # per layer (k, v), each [num_tokens, KVH, hd]


@dataclass
class ExportedRequest:
    """A running request lifted out of an engine with its KV (live migration)."""

    request: GenerateRequest
    output_token_ids: list[int]            # everything already streamed (incl. resumed tokens)
    seed: int
    num_computed: int                      # tokens covered by ``blocks``
    blocks: list[KVBlockData]
    pending_token: int | None = None


class ImportHandle:
    """Blocks reserved on the decode side while a request's KV arrives layer by layer."""

    def __init__(self, pool: KVBlockPool, model_config: ModelConfig, req: GenerateRequest, num_tokens: int,
                 blocks: list[int]) -> None:
        self.pool, self.model_config = pool, model_config
        self.req = req
        self.num_tokens = num_tokens
        self.blocks = blocks
        self.layers_written: set[int] = set()
        self._slots = pool.slots(blocks, 0, num_tokens)

    @property
    def capacity(self) -> int:
        """KV tokens the reserved blocks can take (one slot stays free for the first decode)."""
        return len(self.blocks) * self.pool.block_size - 1

    def resize(self, num_tokens: int) -> None:
        """Expect ``num_tokens`` tokens of KV instead (live migration: the source decoded on while
        the import was being prepared); only before any layer is written."""
        if self.layers_written or not 1 <= num_tokens <= self.capacity:
            raise KVIntegrityError(f"cannot resize the import of {self.req.request_id} to {num_tokens} tokens "
                                   f"(capacity {self.capacity}, {len(self.layers_written)} layers written)",
                                   fix="send at most the reserved number of tokens, before any layer")
        self.num_tokens = num_tokens
        self._slots = self.pool.slots(self.blocks, 0, num_tokens)

    def write_layer(self, layer_idx: int, k: Tensor, v: Tensor) -> None:
        """k, v: [num_tokens, n_kv_heads, head_dim] of layer ``layer_idx``."""
        cfg = self.model_config
        expected = (self.num_tokens, cfg.n_kv_heads, cfg.head_dim)
        if not 0 <= layer_idx < cfg.n_layers:
            raise KVIntegrityError(f"layer index {layer_idx} outside [0, {cfg.n_layers})",
                                   fix="sender and receiver must run the same preset")
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise KVIntegrityError(f"layer {layer_idx} K/V shapes {tuple(k.shape)}/{tuple(v.shape)} "
                                   f"differ from the expected {expected}",
                                   fix="sender and receiver must run the same preset")
        dtype = self.pool.storage.dtype
        if k.dtype != dtype or v.dtype != dtype:
            raise KVIntegrityError(f"layer {layer_idx} K/V dtype {k.dtype} differs from the cache's {dtype}",
                                   fix="run both sides with the same dtype")
        device = self.pool.storage.device
        self.pool.write(layer_idx, *self._slots, k.to(device), v.to(device))
        self.layers_written.add(layer_idx)


__all__ = ["ExportedRequest", "ImportHandle", "PrefillResult"]
