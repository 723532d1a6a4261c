"""Fault hooks of one worker (issue 6): HBM fill and ECC poisoning, per fault id, reversible.

The router sends ``hbm_fill`` / ``hbm_release`` / ``ecc_poison`` / ``ecc_clear``; each answer is
a ``fault_state`` event the harness uses to verify the fault took effect (and was undone).
HBM fill holds a share of the KV block pool out of the free list (and, on CUDA, the same number
of bytes of real device memory, so a real allocator sees the pressure too); ECC poisoning
ruins physical blocks and, with ``ecc_handling`` on, quarantines them and recomputes the requests
whose KV they held (EngineCore hooks). Stats keep the two facts apart: ``kv_blocks_poisoned``
(memory bad now, whatever the engine does about it) and ``kv_blocks_quarantined`` (out of service).
Runs on the engine thread, like every other engine call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from harness.engine.core.engine_core import EngineCore
from harness.engine.control.messages import (EccClearCommand, EccPoisonCommand, FaultStateReport, HbmFillCommand,
                                             HbmReleaseCommand)
from harness.errors import EngineError, HarnessError

log = logging.getLogger(__name__)


def kv_used_ratio(core: EngineCore) -> float:
    """Share of the block pool not available for new KV: requests' blocks, HBM-fill holds and
    quarantined (poisoned) blocks."""
    pool = core.pool
    return (pool.num_blocks - pool.num_free) / pool.num_blocks


def kv_block_faults(core: EngineCore) -> dict[str, int]:
    """Heartbeat / fault-reply counts: blocks whose memory is poisoned, blocks out of service."""
    return {"kv_blocks_poisoned": len(core.pool.poisoned), "kv_blocks_quarantined": len(core.pool.quarantined)}


@dataclass
class _Fill:
    blocks: list[int]
    device_memory: torch.Tensor | None = None   # [blocks * block_bytes] uint8 on CUDA


@dataclass
class WorkerFaults:
    core: EngineCore
    fills: dict[str, _Fill] = field(default_factory=dict)
    poisons: dict[str, list[int]] = field(default_factory=dict)

    def handle(self, msg: HbmFillCommand | HbmReleaseCommand | EccPoisonCommand | EccClearCommand) -> FaultStateReport:
        """Apply one fault command; returns its ``FaultStateReport`` (``error`` set on refusal)."""
        kind, fault_id = msg.TYPE, msg.fault_id
        try:
            if not fault_id:
                raise EngineError(f"{kind} needs a fault_id", fix="send a unique fault_id with every fault")
            state = {HbmFillCommand: self.hbm_fill, HbmReleaseCommand: self.hbm_release,
                     EccPoisonCommand: self.ecc_poison, EccClearCommand: self.ecc_clear}[type(msg)](fault_id, msg)
        except (HarnessError, ValueError, TypeError, KeyError) as exc:
            log.warning("fault %s %s refused: %s", kind, fault_id, exc)
            state = {"active": False, "error": str(exc)}
        return FaultStateReport(fault_id, "hbm_fill" if kind.startswith("hbm") else "ecc_poison", **state,
                          kv_used_ratio=kv_used_ratio(self.core), **kv_block_faults(self.core))

    def hbm_fill(self, fault_id: str, msg: HbmFillCommand) -> dict:
        if fault_id in self.fills:  # a repeated inject is answered, not applied twice
            return {"active": True, "blocks": len(self.fills[fault_id].blocks)}
        share = float(msg.share)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"hbm_fill share must be in (0, 1], got {share}; e.g. 0.5 fills half the KV pool")
        pool = self.core.pool
        wanted = round(share * pool.num_blocks)
        # Another tenant's allocation cannot take memory that live requests hold: fill what is
        # free and say how much that was, so the harness can judge the fault honestly.
        n = min(wanted, pool.num_free)
        before = set(self.core.held_blocks)
        if n:
            self.core.hold_kv_blocks(n)
        blocks = [b for b in self.core.held_blocks if b not in before]
        memory = None
        if self.core.device.type == "cuda" and blocks:
            memory = torch.empty(len(blocks) * pool.block_bytes, dtype=torch.uint8, device=self.core.device)
        self.fills[fault_id] = _Fill(blocks, memory)
        log.warning("HBM fill %s: holding %d of %d KV blocks (%d wanted)%s", fault_id, len(blocks),
                    pool.num_blocks, wanted, " and their bytes of device memory" if memory is not None else "")
        return {"active": True, "blocks": len(blocks), "requested_blocks": wanted,
                "device_bytes": memory.numel() if memory is not None else 0}

    def hbm_release(self, fault_id: str, msg: HbmReleaseCommand) -> dict:
        fill = self.fills.pop(fault_id, None)
        released = self.core.release_kv_blocks(fill.blocks) if fill else 0
        if fill is not None and fill.device_memory is not None:
            del fill.device_memory
            torch.cuda.empty_cache()  # give the bytes back to the device, not only to torch's cache
        return {"active": False, "blocks": released}

    def ecc_poison(self, fault_id: str, msg: EccPoisonCommand) -> dict:
        handling = self.core.config.ecc_handling
        if fault_id in self.poisons:
            return {"active": True, "blocks": self.poisons[fault_id], "affected": [], "ecc_handling": handling}
        if msg.blocks is not None:
            result = self.core.poison_kv_blocks(blocks=[int(b) for b in msg.blocks])
        else:
            count = 1 if msg.count is None else msg.count
            if count < 1:
                raise ValueError(f"ecc_poison count must be >= 1, got {count}")
            result = self.core.poison_kv_blocks(count=count)
        self.poisons[fault_id] = result["blocks"]
        if handling:
            log.warning("ECC poison %s: blocks %s quarantined, recomputing %s", fault_id, result["blocks"],
                        result["request_ids"])
        else:
            log.warning("ECC poison %s: blocks %s poisoned, ECC handling is off: left in service, %s keep "
                        "reading them", fault_id, result["blocks"], result["request_ids"])
        # "affected": the requests whose KV was on the blocks, recomputed or not, so the harness
        # can judge their outputs either way
        return {"active": True, "blocks": result["blocks"], "affected": result["request_ids"],
                "ecc_handling": handling}

    def ecc_clear(self, fault_id: str, msg: EccClearCommand) -> dict:
        blocks = self.poisons.pop(fault_id, [])
        # a block another active poisoning also hit stays bad until that one is cleared too
        still = {b for other in self.poisons.values() for b in other}
        mine = [b for b in blocks if b not in still]
        if len(mine) < len(blocks):
            log.warning("ECC clear %s: blocks %s stay poisoned under another active poisoning", fault_id,
                        sorted(set(blocks) & still))
        restored = self.core.restore_quarantined_blocks(mine) if mine else 0
        return {"active": False, "blocks": blocks, "restored": restored}
