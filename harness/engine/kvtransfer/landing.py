"""Receive KV straight into an import's reserved blocks (decode side).

The receiver asks, once a DATA frame's header is verified, where its payload should land; the
answer is one writable view per (layer, K/V, block) of the import, in wire order
([layers, 2, tokens, kv_heads, head_dim]), so the bytes go from the socket into the KV pool with
no receive buffer and no copy. The payload's crc32c is checked as it lands; a frame that fails
leaves its layers missing (the sender resends them over the same bytes) and the blocks are not
committed until every layer landed verified, so corrupt bytes are never attended to.

Blocks must not change hands while bytes land in them: each landing pins its import, and an
import cancelled meanwhile is freed by the last landing to finish (``release``), on the engine
thread. A commit waits until no landing of its request is in flight (``wait_idle``).
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

import torch

from harness.engine.core.engine_core import EngineCore, ImportHandle


def layer_views(views: list[memoryview], num_layers: int, layer_start: int, layer_end: int) -> list[memoryview]:
    """Layers [layer_start, layer_end) of the views ``block_views`` gave for all ``num_layers``."""
    per_layer = len(views) // num_layers
    return views[layer_start * per_layer:layer_end * per_layer]


def block_views(storage: torch.Tensor, blocks: list[int], num_tokens: int, layer_start: int,
                layer_end: int) -> list[memoryview]:
    """Writable views of layers [layer_start, layer_end) of a sequence's first ``num_tokens``
    tokens in ``storage`` ([blocks, layers, 2, block_size, KVH, hd], contiguous, on the CPU), in
    wire order. Sliced out of one view of the whole pool by byte offset: indexing the tensor once
    per (layer, K/V, block) cost more than receiving the bytes."""
    _, n_layers, _, block_size, n_kv_heads, head_dim = storage.shape
    row = n_kv_heads * head_dim * storage.element_size()   # one token of one layer's K (or V)
    whole = memoryview(storage.view(-1).view(torch.uint8).numpy())
    used = blocks[:-(-num_tokens // block_size)]
    last_rows = num_tokens - (len(used) - 1) * block_size
    views = []
    for layer in range(layer_start, layer_end):
        for kv in (0, 1):
            for j, block in enumerate(used):
                off = ((block * n_layers + layer) * 2 + kv) * block_size * row
                views.append(whole[off:off + (block_size if j < len(used) - 1 else last_rows) * row])
    return views


class ImportLanding:
    """The worker's side of landing frames in its imports (see the module docstring)."""

    def __init__(self, core: EngineCore, run_on_engine: Callable[[Callable[[], None]], None]) -> None:
        self.core = core
        self._run_on_engine = run_on_engine
        self._cond = threading.Condition()
        self._handles: dict[str, ImportHandle] = {}
        self._pins: collections.Counter[str] = collections.Counter()
        self._deferred: dict[str, ImportHandle] = {}  # cancelled while pinned: freed on the last unpin
        self._views: dict[str, tuple[int, list[memoryview]]] = {}  # rid -> (num_tokens, every layer's views)

    def register(self, rid: str, handle: ImportHandle) -> None:
        """An import begins: its views are worked out now, before its KV arrives, so a frame
        lands as soon as its header is read (working them out took longer than landing 256 KiB)."""
        views = self._all_views(handle)
        with self._cond:
            self._handles[rid] = handle
            if views is not None:
                self._views[rid] = (handle.num_tokens, views)

    def _all_views(self, handle: ImportHandle) -> list[memoryview] | None:
        storage = self.core.pool.storage
        if storage.device.type != "cpu":
            return None
        return block_views(storage, handle.blocks, handle.num_tokens, 0, storage.shape[1])

    def take(self, rid: str, layer_start: int, layer_end: int,
             nbytes: int) -> tuple[list[memoryview], Callable[[bool], None]] | None:
        """Where layers [layer_start, layer_end) of ``rid`` land, and the callback the receiver
        calls with whether the payload verified; None: receive into a buffer as before."""
        storage = self.core.pool.storage
        if storage.device.type != "cpu":
            return None
        with self._cond:
            handle = self._handles.get(rid)
            if handle is None:
                return None
            self._pins[rid] += 1
            cached = self._views.get(rid)
        if cached is None or cached[0] != handle.num_tokens:  # resized since it registered (live migration)
            cached = (handle.num_tokens, self._all_views(handle))
            with self._cond:
                if self._handles.get(rid) is handle:  # not released meanwhile (release drops its views)
                    self._views[rid] = cached
        views = layer_views(cached[1], storage.shape[1], layer_start, layer_end)
        if sum(map(len, views)) != nbytes:
            self._unpin(rid)
            return None

        def done(ok: bool) -> None:
            if ok:
                handle.layers_written.update(range(layer_start, layer_end))
            self._unpin(rid)

        return views, done

    def _unpin(self, rid: str) -> None:
        with self._cond:
            self._pins[rid] -= 1
            if self._pins[rid] > 0:
                return
            del self._pins[rid]
            handle = self._deferred.pop(rid, None)
            self._cond.notify_all()
        if handle is not None:
            self._run_on_engine(lambda: self.core.cancel_import(handle))

    def release(self, rid: str, handle: ImportHandle) -> bool:
        """The import ends (engine thread). True: its blocks may be freed now; False: a landing is
        in flight and frees them when it finishes."""
        with self._cond:
            self._handles.pop(rid, None)
            self._views.pop(rid, None)
            if self._pins[rid] > 0:
                self._deferred[rid] = handle
                return False
            self._pins.pop(rid, None)
            return True

    def wait_idle(self, rid: str, timeout_s: float = 30.0) -> bool:
        """Block until no frame of ``rid`` is landing (before its commit)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._pins[rid] <= 0, timeout_s)
            if ok:
                self._pins.pop(rid, None)
            return ok
