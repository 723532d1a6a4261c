"""Paged KV cache: a pool of fixed-size blocks (the "HBM tier") and attention over it.

Storage is one tensor ``[num_blocks, n_layers, 2 (K, V), block_size, n_kv_heads, head_dim]``,
so a block holds every layer's K and V of ``block_size`` consecutive tokens and moves as one
unit (PD transfer, migration, offload). Tokens are the outer dimension inside a block so that
gathering a sequence's K is one index copy that is already ``[ctx, n_kv_heads, head_dim]``. Blocks are handed out from a free-list deque and
reference counted.

Decode attention reads a contiguous copy of each running sequence's K/V (``SeqView``), kept in
step with every write made through ``PagedAttention``; any other write to a block (an import, a
swap-in, ECC poison, restore) or its release drops the views over it, and the next step rebuilds
them from the pool, so the blocks stay the single source of truth. Gathering the whole context
out of the blocks at every layer of every step cost 3-5x the attention itself.

Integrity: a block's crc32c is computed when it leaves the pool (``export_block``) and
verified whenever bytes come back (``import_block``); a mismatch raises ``KVIntegrityError``
before anything is written, so corrupt bytes are never attended to.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import crc32c
import torch
from torch import Tensor

from harness.engine.core.model import causal_attention
from harness.errors import KVCapacityError, KVIntegrityError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVBlockData:
    """One block's bytes outside the pool, with the checksum taken when it left."""

    data: bytes
    checksum: int

    def verify(self) -> None:
        actual = crc32c.crc32c(self.data)
        if actual != self.checksum:
            raise KVIntegrityError(f"KV block checksum mismatch: stored crc32c {self.checksum:#010x}, "
                                   f"bytes hash to {actual:#010x}; the block is discarded",
                                   fix="recompute the request's KV (re-prefill) or fetch an intact copy")


@dataclass
class SeqView:
    """Contiguous K/V of one sequence, keyed in the pool by its first block. ``table`` is the block
    table it was kept in step with; kv: [n_layers, 2 (K, V), capacity, n_kv_heads, head_dim]."""

    table: list[int]
    kv: Tensor


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>


def advise_huge_pages(t: Tensor) -> bool:
    """Ask Linux to back a large host tensor with 2 MiB pages (transparent huge pages in
    ``madvise`` mode, the common default). KV blocks are handed out across the whole pool and a
    received frame lands in scattered 16 KiB pieces of it: with 4 KiB pages every piece is a TLB
    miss and, on first use, a page fault, which made landing a frame slower than sending it.
    Call before the tensor is first written. False where it does not apply (not on a CPU,
    smaller than a huge page, another OS, or the kernel refused)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < 2 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return False
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # whole huge pages inside the tensor
    length = (t.data_ptr() + nbytes - start) // _HUGE_PAGE * _HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class KVBlockPool:
    def __init__(self, num_blocks: int, n_layers: int, n_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        # storage: [num_blocks, n_layers, 2, block_size, n_kv_heads, head_dim]
        self.storage = torch.empty(num_blocks, n_layers, 2, block_size, n_kv_heads, head_dim,
                                   dtype=dtype, device=device)
        advise_huge_pages(self.storage)  # before the first touch, which maps its pages
        self.storage.zero_()
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.quarantined: set[int] = set()   # out of service: never handed out
        self.poisoned: set[int] = set()      # memory bad now (an ECC fault), quarantined or not
        self.restore_on_free: set[int] = set()  # quarantined, restored while still referenced: back when freed
        self.num_held = 0  # allocated to no request (an HBM-fill fault): not usable for KV either
        self.views: dict[int, SeqView] = {}  # first block of a sequence -> its contiguous K/V

    # ---- accounting ---------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.storage.shape[0]

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - len(self.quarantined)

    @property
    def block_bytes(self) -> int:
        return self.storage[0].numel() * self.storage.element_size()

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise KVCapacityError(f"need {n} free KV blocks, only {len(self.free_blocks)} of "
                                  f"{self.num_blocks} are free", fix="wait for requests to finish or "
                                  "raise kv_budget_bytes")
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for b in blocks:
            assert self.ref_counts[b] == 0, f"block {b} on the free list is still referenced"
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"cannot share free block {b}"
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref_counts[b] > 0, f"double free of KV block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0 and b in self.restore_on_free:  # its page was replaced meanwhile
                self.restore_on_free.discard(b)
                self.storage[b].zero_()
                self.poisoned.discard(b)
                self.quarantined.discard(b)
        # freed blocks go to the front, in order: the next allocation takes the memory touched
        # last, still in cache (an import of 1 MiB landed 20 % faster than in blocks taken from
        # the far end of the pool, bench/bench_transfer.py); no block keeps meaning once freed
        back = [b for b in dict.fromkeys(blocks) if self.ref_counts[b] == 0 and b not in self.quarantined]
        self.free_blocks.extendleft(reversed(back))
        self.drop_views(b for b in blocks if self.ref_counts[b] == 0)

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise KVIntegrityError(f"no KV block {block} (the pool has {self.num_blocks})",
                                   fix=f"pick a block in [0, {self.num_blocks})")

    def quarantine(self, block: int) -> None:
        """Take a block out of service (e.g. its memory is ECC-poisoned) until ``restore``."""
        self._check_block(block)
        self.quarantined.add(block)
        if block in self.free_blocks:
            self.free_blocks.remove(block)

    def poison(self, block: int, quarantine: bool = True) -> None:
        """ECC poisoning: the block's bytes become NaN. ``quarantine=False`` leaves it in service
        (an engine that ignores the page-retirement signal): its owner and later users read NaN."""
        self._check_block(block)
        self.storage[block] = float("nan")
        self.drop_views([block])
        self.poisoned.add(block)
        # an earlier poisoning's revert may still wait for this block's holder: that replaced page
        # is bad again, so its release must not restore it (it erased this poisoning, issue 33)
        self.restore_on_free.discard(block)
        if quarantine:
            self.quarantine(block)

    def restore(self, blocks: list[int] | None = None) -> int:
        """The "replaced page": poisoned or quarantined blocks (all, or ``blocks``) get zeroed
        memory; quarantined ones that nobody references return to service, and those a request
        still references return when it frees them (never zeroed under a holder, never left out of
        service for good). A block left in service while poisoned is zeroed where it is. Returns how
        many blocks were restored or will be on their release."""
        wanted = self.quarantined | self.poisoned if blocks is None else set(blocks)
        held = {b for b in wanted & self.quarantined if self.ref_counts[b] > 0}
        self.restore_on_free |= held
        back = [b for b in wanted & self.quarantined if self.ref_counts[b] == 0]
        in_place = [b for b in wanted & self.poisoned if b not in self.quarantined]
        self.drop_views(back + in_place)
        for b in back + in_place:
            self.storage[b].zero_()
            self.poisoned.discard(b)
        for b in back:
            self.quarantined.discard(b)
            self.free_blocks.append(b)
        return len(back) + len(in_place) + len(held)

    def check_invariants(self) -> None:
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        for b, refs in enumerate(self.ref_counts):
            assert refs >= 0
            assert (b in free) == (refs == 0 and b not in self.quarantined), f"block {b}: refs={refs}"

    # ---- data ----------------------------------------------------------------------------

    def slots(self, block_table: list[int], start: int, end: int) -> tuple[Tensor, Tensor]:
        """(block index, offset) of token positions start..end-1: two [end-start] long tensors."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size].to(self.storage.device), (pos % self.block_size).to(
            self.storage.device)

    def write(self, layer: int, blocks: Tensor, offsets: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v: [T, KVH, hd] go to slots (blocks[t], offsets[t]) of ``layer`` (an import: the
        views over those blocks are dropped; ``PagedAttention`` writes its views itself)."""
        if self.views:
            self.drop_views(blocks.unique().tolist())
        self.write_slots(layer, blocks, offsets, k, v)

    def write_slots(self, layer: int, blocks: Tensor, offsets: Tensor, k: Tensor, v: Tensor) -> None:
        self.storage[blocks, layer, 0, offsets] = k
        self.storage[blocks, layer, 1, offsets] = v

    def drop_views(self, blocks: Iterable[int]) -> None:
        """Forget the contiguous views over ``blocks`` (their bytes changed or they were released)."""
        if not self.views:
            return
        changed = set(blocks)
        for key in [key for key, view in self.views.items() if changed.intersection(view.table)]:
            del self.views[key]

    def view(self, block_table: list[int], start: int, end: int) -> Tensor:
        """The contiguous K/V of the sequence on ``block_table``, holding positions 0..start-1 of
        every layer and room up to ``end``: [n_layers, 2, capacity >= end, KVH, hd]."""
        view = self.views.get(block_table[0])
        if view is not None and view.table != block_table[:len(view.table)]:
            view = None  # the first block was released and handed out again since
        if view is None:
            kv = self.storage.new_zeros(self._view_shape(end))
            if start:
                blocks = torch.tensor(block_table[:self.blocks_for(start)], device=self.storage.device)
                ctx = self.storage[blocks].transpose(0, 2).transpose(0, 1)   # [layers, 2, nb, bs, KVH, hd]
                kv[:, :, :start] = ctx.flatten(2, 3)[:, :, :start]
            view = self.views[block_table[0]] = SeqView(list(block_table), kv)
        elif view.kv.shape[2] < end:
            kv = self.storage.new_zeros(self._view_shape(max(end, 2 * view.kv.shape[2])))
            kv[:, :, :view.kv.shape[2]] = view.kv
            view.kv = kv
        if len(view.table) != len(block_table):
            view.table = list(block_table)
        return view.kv

    def _view_shape(self, tokens: int) -> tuple[int, ...]:
        _, n_layers, _, _, n_kv_heads, head_dim = self.storage.shape
        return n_layers, 2, max(64, self.blocks_for(tokens) * self.block_size), n_kv_heads, head_dim

    def gather(self, layer: int, block_table: list[int], length: int) -> tuple[Tensor, Tensor]:
        """Contiguous K, V of the first ``length`` tokens of a sequence: each [length, KVH, hd]."""
        blocks = torch.tensor(block_table[:self.blocks_for(length)], device=self.storage.device)
        k = self.storage[blocks, layer, 0].flatten(0, 1)[:length]   # [nb, bs, KVH, hd] -> [length, KVH, hd]
        v = self.storage[blocks, layer, 1].flatten(0, 1)[:length]
        return k, v

    def export_block(self, block: int) -> KVBlockData:
        assert self.ref_counts[block] > 0, f"exporting free block {block}"
        data = self.storage[block].contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return KVBlockData(data, crc32c.crc32c(data))

    def import_block(self, block: int, payload: KVBlockData) -> None:
        """Verify, then write; a corrupt payload raises and leaves the block untouched."""
        assert self.ref_counts[block] > 0, f"importing into free block {block}"
        payload.verify()
        if len(payload.data) != self.block_bytes:
            raise KVIntegrityError(f"KV block payload has {len(payload.data)} bytes, a block here has "
                                   f"{self.block_bytes}", fix="both sides must run the same preset, "
                                   "dtype and block_size")
        raw = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
        self.drop_views([block])
        self.storage[block] = raw.view(self.storage.dtype).view(self.storage.shape[1:]).to(
            self.storage.device)


# Segments of at most this many new tokens (decode: 1, speculative verify: k + 1) over at most
# VIEW_MIN_CONTEXT tokens are attended in padded batches gathered from the blocks: for short
# contexts one batched pass beats a loop of small per-sequence ops. Longer contexts (and prefill
# chunks) are attended per sequence over its contiguous view, without a gather.
BATCHED_MAX_NEW_TOKENS = 8
VIEW_MIN_CONTEXT = 256
# A padded batch holds at most about this much K (bytes): one big batch streams through DRAM
# several times and was slower than a per-sequence loop for long contexts.
BATCH_CHUNK_BYTES = 2 * 2**20


class PagedAttention:
    """AttentionBackend for one engine step over a packed batch of sequences.

    ``segments``: per sequence (block_table, start_pos, num_new_tokens), in packing order; the
    block table must already cover start_pos + num_new_tokens tokens. Each layer's new K/V go to
    the blocks and, for a sequence with a contiguous view, to its view, which attention then
    reads in place: the same ``causal_attention`` over the same bytes as the dense oracle.
    """

    def __init__(self, pool: KVBlockPool, segments: list[tuple[list[int], int, int]]) -> None:
        self.pool = pool
        parts = [pool.slots(table, start, start + n) for table, start, n in segments]
        self.blocks = torch.cat([p[0] for p in parts])   # [T]
        self.offsets = torch.cat([p[1] for p in parts])  # [T]
        self.viewed: list[tuple[Tensor, int, int, int]] = []  # (view, start, n, first packed index)
        self.long: list[tuple[list[int], int, int, int]] = []    # (table, start, n, first packed index)
        short: dict[int, list[tuple[list[int], int, int]]] = {}  # n -> [(table, start, first index)]
        t0 = 0
        for table, start, n in segments:
            if start + n > VIEW_MIN_CONTEXT or table[0] in pool.views:
                self.viewed.append((pool.view(table, start, start + n), start, n, t0))
            elif n <= BATCHED_MAX_NEW_TOKENS:
                short.setdefault(n, []).append((table, start, t0))
            else:  # a short prompt's prefill: no view (its decode steps go in padded batches)
                self.long.append((table, start, n, t0))
            t0 += n
        token_bytes = pool.storage[0, 0, 0, 0].numel() * pool.storage.element_size()
        self.batches = []
        for n, items in short.items():
            chunk: list[tuple[list[int], int, int]] = []
            for item in sorted(items, key=lambda s: s[1]):
                chunk.append(item)
                if len(chunk) * (item[1] + n) * token_bytes >= BATCH_CHUNK_BYTES:
                    self.batches.append(self._pack(chunk, n))
                    chunk = []
            if chunk:
                self.batches.append(self._pack(chunk, n))

    def _pack(self, items: list[tuple[list[int], int, int]], n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        pool, device = self.pool, self.pool.storage.device
        ctx = [start + n for _, start, _ in items]
        width = max(pool.blocks_for(c) for c in ctx)
        # pad every table to the same width with its own first block; padded slots are masked
        tables = [table[:pool.blocks_for(c)] + [table[0]] * (width - pool.blocks_for(c))
                  for (table, _, _), c in zip(items, ctx)]
        key_pos = torch.arange(width * pool.block_size, device=device)                  # [L]
        query_pos = torch.tensor([[start + i for i in range(n)] for _, start, _ in items],
                                 device=device)                                        # [B, n]
        return (torch.tensor(tables, device=device),                                   # [B, nb]
                query_pos - query_pos[:, :1] + torch.tensor([t for _, _, t in items], device=device)[:, None],
                key_pos[None, None, :] > query_pos[:, :, None],                        # [B, n, L] future
                key_pos[None, :] >= query_pos[:, -1:] + 1)                             # [B, L] past context

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [T, H, hd]; k, v: [T, KVH, hd]
        self.pool.write_slots(layer, self.blocks, self.offsets, k, v)
        out = torch.empty_like(q)                         # [T, H, hd]
        for kv, start, n, t0 in self.viewed:              # kv: [layers, 2, capacity, KVH, hd]
            end = start + n
            kv[layer, 0, start:end] = k[t0:t0 + n]
            kv[layer, 1, start:end] = v[t0:t0 + n]
            out[t0:t0 + n] = causal_attention(q[t0:t0 + n], kv[layer, 0, :end], kv[layer, 1, :end], start)
        for table, start, n, t0 in self.long:
            if start:
                ctx_k, ctx_v = self.pool.gather(layer, table, start + n)  # [start+n, KVH, hd]
            else:
                ctx_k, ctx_v = k[t0:t0 + n], v[t0:t0 + n]
            out[t0:t0 + n] = causal_attention(q[t0:t0 + n], ctx_k, ctx_v, start)
        for batch in self.batches:
            out[batch[1]] = self._attend_batch(layer, q[batch[1]], batch)
        return out

    def _attend_batch(self, layer: int, q: Tensor, batch: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        """n new tokens per sequence, padded and masked. q: [B, n, H, hd] -> [B, n, H, hd]."""
        tables, _, future, beyond = batch
        B, n, n_heads, head_dim = q.shape
        storage = self.pool.storage
        n_kv_heads = storage.shape[4]
        group = n_heads // n_kv_heads
        ks = storage[tables, layer, 0].flatten(1, 2)                        # [B, L, KVH, hd]
        # stale bytes past a context may be anything: zero them so that 0 * garbage stays 0
        vs = storage[tables, layer, 1].flatten(1, 2).masked_fill(beyond[:, :, None, None], 0.0)
        qg = q.view(B, n, n_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(
            B, n_kv_heads, group * n, head_dim)                             # [B, KVH, G*n, hd]
        scores = qg @ ks.permute(0, 2, 3, 1) / math.sqrt(head_dim)          # [B, KVH, G*n, L]
        scores = scores.masked_fill(future.repeat(1, group, 1)[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)                               # [B, KVH, G*n, L]
        out = probs @ vs.transpose(1, 2)                                    # [B, KVH, G*n, hd]
        return out.view(B, n_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4).reshape(
            B, n, n_heads, head_dim)
