"""KV offload tiers below the block pool (seed Section 4.3): HBM -> CPU memory -> NVMe files.

When the pool's use (requests, HBM-fill holds and quarantined blocks) passes ``threshold``
(0.85), whole requests are swapped out, least recently brought into HBM first, never one whose
priority is ``protect_priority`` or more: their blocks leave the pool as checksummed bytes
(``KVBlockPool.export_block``) to CPU memory while it has room, then to files on the NVMe tier.
Every resident request's KV is read on every decode step, so "least recently used" is the
order in which requests last entered HBM; that also makes the tiers a fair rotation: a swapped
request waits at most until a resident that has run ``min_resident_steps`` steps gives way.

A swapped request is fetched back before its next decode step. Fetching verifies each block's
checksum (``import_block``); a damaged copy raises KVIntegrityError, and the request is
recomputed from its tokens instead, so a bad tier is never served. Runs on the engine thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections import deque

from harness.engine.core.kv_cache import KVBlockData, KVBlockPool
from harness.engine.core.scheduler import RequestStatus, Scheduler, Sequence
from harness.errors import ConfigError, KVCapacityError, KVIntegrityError

logger = logging.getLogger(__name__)


class TieredKVStore:
    """Swapped-out requests' blocks: CPU memory first, then one file per request on NVMe."""

    def __init__(self, cpu_bytes: int, nvme_bytes: int, nvme_dir: str | None = None) -> None:
        if cpu_bytes < 0 or nvme_bytes < 0:
            raise ConfigError("offload tier sizes must be >= 0 bytes", fix="set offload_cpu_bytes/offload_nvme_bytes")
        self.capacity = {"cpu": cpu_bytes, "nvme": nvme_bytes}
        self.used = {"cpu": 0, "nvme": 0}
        self._own_dir = nvme_dir is None
        self.nvme_dir = nvme_dir  # created on the first NVMe write
        self._cpu: dict[str, list[KVBlockData]] = {}
        self._serial = 0
        self._nvme: dict[str, tuple[str, list[int], int]] = {}  # rid -> (file, checksums, block bytes)

    def put(self, rid: str, blocks: list[KVBlockData]) -> str:
        """Store one request's blocks; returns the tier. Raises KVCapacityError when both are full."""
        size = sum(len(b.data) for b in blocks)
        if self.used["cpu"] + size <= self.capacity["cpu"]:
            self._cpu[rid] = blocks
            self.used["cpu"] += size
            return "cpu"
        if self.used["nvme"] + size <= self.capacity["nvme"]:
            if self.nvme_dir is None:
                self.nvme_dir = tempfile.mkdtemp(prefix="pdh-kv-offload-")
            os.makedirs(self.nvme_dir, exist_ok=True)
            self._serial += 1
            path = os.path.join(self.nvme_dir, f"{os.getpid()}-{self._serial}.kv")
            with open(path, "wb") as f:
                for b in blocks:
                    f.write(b.data)
            self._nvme[rid] = (path, [b.checksum for b in blocks], len(blocks[0].data) if blocks else 0)
            self.used["nvme"] += size
            return "nvme"
        raise KVCapacityError(f"offload tiers are full (cpu {self.used['cpu']}/{self.capacity['cpu']} B, "
                              f"nvme {self.used['nvme']}/{self.capacity['nvme']} B)",
                              fix="raise offload_cpu_bytes or offload_nvme_bytes, or shed load (Level 5)")

    def get(self, rid: str) -> list[KVBlockData]:
        """Take a request's blocks back out (checksums as stored when they left the pool)."""
        if rid in self._cpu:
            blocks = self._cpu.pop(rid)
            self.used["cpu"] -= sum(len(b.data) for b in blocks)
            return blocks
        path, checksums, block_bytes = self._nvme.pop(rid)
        with open(path, "rb") as f:
            data = f.read()
        os.unlink(path)
        self.used["nvme"] -= block_bytes * len(checksums)
        return [KVBlockData(data[i * block_bytes:(i + 1) * block_bytes], c) for i, c in enumerate(checksums)]

    def tier_of(self, rid: str) -> str | None:
        return "cpu" if rid in self._cpu else "nvme" if rid in self._nvme else None

    def nvme_path(self, rid: str) -> str | None:
        return self._nvme[rid][0] if rid in self._nvme else None

    def discard(self, rid: str) -> None:
        if self.tier_of(rid) is not None:
            self.get(rid)

    def close(self) -> None:
        for rid in list(self._nvme):
            self.discard(rid)
        if self._own_dir and self.nvme_dir:
            shutil.rmtree(self.nvme_dir, ignore_errors=True)


class OffloadManager:
    def __init__(self, pool: KVBlockPool, scheduler: Scheduler, *, enabled: bool, threshold: float,
                 cpu_bytes: int, nvme_bytes: int, nvme_dir: str | None, protect_priority: int,
                 min_resident_steps: int) -> None:
        self.pool, self.scheduler = pool, scheduler
        self.enabled, self.threshold = enabled, threshold
        self.protect_priority, self.min_resident_steps = protect_priority, min_resident_steps
        self.store = TieredKVStore(cpu_bytes, nvme_bytes, nvme_dir)
        self.swapped: deque[Sequence] = deque()
        self._entered: dict[str, int] = {}        # rid -> step it last entered HBM (the LRU order)
        self._fetch_s: deque[float] = deque(maxlen=64)
        self._step = 0
        self.offloads_total = self.fetches_total = self.corrupt_total = 0

    def set_enabled(self, enabled: bool, threshold: float | None = None) -> None:
        if threshold is not None:
            if not 0.0 < float(threshold) <= 1.0:
                raise ConfigError(f"offload threshold must be in (0, 1], got {threshold}", fix="use 0.85")
            self.threshold = float(threshold)
        self.enabled = bool(enabled)

    # ---- per step ------------------------------------------------------------------------

    def rebalance(self) -> None:
        """Before a step: evict down to the threshold, then fetch swapped requests back (oldest
        first), making room by rotating out residents that had their turn."""
        self._step += 1
        running = {s.req.request_id for s in self.scheduler.running}
        self._entered = {rid: t for rid, t in self._entered.items() if rid in running}
        for rid in running - self._entered.keys():
            self._entered[rid] = self._step
        if self.enabled:
            # keep one request resident: when holds or quarantine alone pass the threshold,
            # emptying HBM every step would only thrash
            while self._over(0) and len(self.scheduler.running) > 1 and self._evict(self._victims(min_steps=0)):
                pass
        while self.swapped:
            need = self.pool.blocks_for(self.swapped[0].num_computed + 1)
            if self._fits(need):
                self._fetch(self.swapped.popleft())
            elif not (self.enabled and self._evict(self._victims(self.min_resident_steps))):
                break

    def _used(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def _over(self, extra: int) -> bool:
        return self._used() + extra > self.threshold * self.pool.num_blocks

    def _fits(self, need: int) -> bool:
        if need > self.pool.num_free:
            return False
        # below the threshold, or alone: a request bigger than the threshold must still run
        return not self.enabled or not self._over(need) or not self.scheduler.running

    def _victims(self, min_steps: int) -> list[Sequence]:
        eligible = [s for s in self.scheduler.running
                    if s.req.params.priority < self.protect_priority and s.pending_token is None
                    and s.num_tokens - s.num_computed == 1 and s.block_table
                    and self._step - self._entered.get(s.req.request_id, self._step) >= min_steps]
        return sorted(eligible, key=lambda s: self._entered.get(s.req.request_id, self._step))

    def _evict(self, victims: list[Sequence]) -> bool:
        """Swap out the first victim the tiers can hold; False if none."""
        for seq in victims:
            blocks = [self.pool.export_block(b) for b in seq.block_table[:self.pool.blocks_for(seq.num_computed)]]
            try:
                tier = self.store.put(seq.req.request_id, blocks)
            except KVCapacityError as exc:
                logger.info("cannot offload %s: %s", seq.req.request_id, exc)
                return False
            self.scheduler.running.remove(seq)
            self.pool.free(seq.block_table)
            seq.block_table = []
            seq.status = RequestStatus.SWAPPED
            self.swapped.append(seq)
            self._entered.pop(seq.req.request_id, None)
            self.offloads_total += 1
            logger.debug("offloaded %s (%d blocks) to %s", seq.req.request_id, len(blocks), tier)
            return True
        return False

    def _fetch(self, seq: Sequence) -> None:
        t0 = time.perf_counter()
        rid = seq.req.request_id
        payloads = self.store.get(rid)
        blocks = self.pool.allocate(self.pool.blocks_for(seq.num_computed + 1))
        try:
            for b, payload in zip(blocks, payloads):
                self.pool.import_block(b, payload)   # verifies the checksum before writing
        except KVIntegrityError as exc:
            # never decode from a damaged copy: recompute this request from its tokens
            logger.warning("offloaded KV of %s failed verification (%s); recomputing it", rid, exc)
            self.pool.free(blocks)
            self.corrupt_total += 1
            seq.num_computed = 0
            seq.status = RequestStatus.WAITING
            self.scheduler.waiting.appendleft(seq)
            return
        seq.block_table = blocks
        self.scheduler.join_running(seq)
        self._entered[rid] = self._step
        self.fetches_total += 1
        self._fetch_s.append(time.perf_counter() - t0)

    def fetch_now(self, seq: Sequence) -> bool:
        """Bring one swapped request back out of turn (live migration reads its KV from HBM);
        False when the free blocks cannot hold it or its copy failed verification."""
        if seq not in self.swapped or self.pool.blocks_for(seq.num_computed + 1) > self.pool.num_free:
            return False
        self.swapped.remove(seq)
        self._fetch(seq)
        return seq.status is RequestStatus.RUNNING

    def discard(self, seq: Sequence) -> None:
        """A swapped request finished or was aborted: drop its offloaded copy."""
        if seq in self.swapped:
            self.swapped.remove(seq)
        self.store.discard(seq.req.request_id)

    def stats(self) -> dict:
        return {"offload": {"hbm": self._used() * self.pool.block_bytes, **self.store.used},
                "offload_fetch_s": sum(self._fetch_s) / len(self._fetch_s) if self._fetch_s else 0.0,
                "offload_enabled": self.enabled, "kv_requests_swapped": len(self.swapped),
                "offloads_total": self.offloads_total, "offload_fetches_total": self.fetches_total,
                "offload_corrupt_total": self.corrupt_total}
