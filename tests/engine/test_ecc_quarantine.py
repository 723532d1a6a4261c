"""ECC quarantine bookkeeping that the ECC suite's false fail (issue 33 item 8) went through: what a
heartbeat says right after a poisoning, and poisonings that meet an earlier one's pending revert.
In-process, tiny preset, no timing: each test drives the pool, the fault hooks or a WorkerEngine."""

from __future__ import annotations

import threading

import pytest
import torch

from harness.engine.control.codec import VERSION, from_dict
from harness.engine.control.messages import EccClearCommand, EccPoisonCommand, FaultStateReport, Message
from harness.engine.core.config import EngineConfig, ModelConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.kv_cache import KVBlockPool
from harness.engine.pd.worker_engine import WorkerEngine
from harness.engine.resilience.worker_faults import WorkerFaults
from harness.waiting import wait_until

CFG = ModelConfig.from_name("tiny")


def _pool(num_blocks: int = 4) -> KVBlockPool:
    return KVBlockPool(num_blocks, CFG.n_layers, CFG.n_kv_heads, 4, CFG.head_dim, torch.float64)


def _handle(faults: WorkerFaults, command: dict) -> dict:
    return faults.handle(from_dict({"v": VERSION, **command})).public()


def test_a_block_poisoned_again_while_its_earlier_revert_waits_stays_quarantined_after_its_holder_frees_it():
    """Planted defect: ``poison`` leaves the block in ``restore_on_free`` (the unfixed pool), so the
    old holder's ``free`` un-quarantines, un-poisons and zeroes a block whose new poisoning is active:
    ``kv_blocks_quarantined`` reads 0 while the fault is on (hypothesis (a) of issue 33)."""
    pool = _pool(4)
    a, b = pool.allocate(2)
    pool.poison(a)                     # fault 1, its request keeps the block (e.g. paused for a migration)
    assert pool.restore([a]) == 1 and a in pool.restore_on_free  # fault 1 reverted under the holder
    pool.poison(a)                     # fault 2 hits the same page before the holder lets go
    pool.free([a, b])
    assert a in pool.quarantined and a in pool.poisoned and a not in pool.free_blocks
    assert torch.isnan(pool.storage[a]).all()  # still the bad page, not a zeroed one
    pool.check_invariants()
    assert pool.restore([a]) == 1      # fault 2's revert brings it back, zeroed
    assert not pool.quarantined and not pool.poisoned and pool.num_free == 4
    assert (pool.storage[a] == 0).all()


def test_clearing_one_of_two_poisonings_of_the_same_held_block_keeps_it_out_of_service():
    """Planted defect: ``ecc_clear`` restores every block of its fault, even one another active
    poisoning also hit; the block (held by an HBM fill here) then goes back to service when its
    holder frees it while that other poisoning is still on."""
    core = EngineCore(EngineConfig(preset="tiny", kv_budget_bytes=40 * 16 * 2048))
    faults = WorkerFaults(core)
    core.hold_kv_blocks(2)
    block = core.held_blocks[0]
    _handle(faults, {"type": "ecc_poison", "fault_id": "a", "blocks": [block]})
    _handle(faults, {"type": "ecc_poison", "fault_id": "b", "blocks": [block]})
    _handle(faults, {"type": "ecc_clear", "fault_id": "a"})
    core.release_kv_blocks()
    assert block in core.pool.quarantined and block in core.pool.poisoned  # fault b is still on
    assert block not in core.pool.free_blocks
    cleared = _handle(faults, {"type": "ecc_clear", "fault_id": "b"})
    assert cleared["kv_blocks_quarantined"] == 0 and block in core.pool.free_blocks
    core.pool.check_invariants()


class _Worker:
    """A decode WorkerEngine with its engine thread running; at each fault_state it publishes, the
    stats a heartbeat sent at that moment would carry are kept (the earliest heartbeat the router
    can read after the fault's reply)."""

    def __init__(self) -> None:
        self.replies: list[tuple[FaultStateReport, dict]] = []
        self._lock = threading.Lock()
        self.engine = WorkerEngine("decode-0", "decode", EngineConfig(preset="tiny"), publish=self.publish,
                                   on_failure=lambda: None)
        self.engine.start()

    def publish(self, msg: Message) -> None:
        if isinstance(msg, FaultStateReport):
            with self._lock:
                self.replies.append((msg, dict(self.engine.heartbeat().stats)))

    def send(self, msg: Message) -> tuple[FaultStateReport, dict]:
        n = len(self.replies)
        self.engine.submit(msg)
        wait_until(lambda: len(self.replies) > n, 30, 0.01, what=f"the worker's answer to {msg.TYPE}")
        with self._lock:
            return self.replies[n]


@pytest.fixture
def worker():
    w = _Worker()
    yield w
    w.engine.stop()


def test_a_heartbeat_sent_after_a_fault_reply_shows_the_fault(worker):
    """Planted defect: the worker publishes the fault_state before refreshing its heartbeat's stats
    cache (the unfixed worker_engine.py), so a heartbeat read after the reply still says 0
    quarantined; the ECC suite's poll took that for the poisoned blocks being back in service.
    Poison, clear, poison again: the suite's cycle."""
    for fault_id in ("e1", "e2"):
        reply, stats = worker.send(EccPoisonCommand(fault_id=fault_id, blocks=[3, 4]))
        assert reply.active and reply.kv_blocks_quarantined == 2
        assert stats["kv_blocks_poisoned"] == stats["kv_blocks_quarantined"] == 2, stats
        reply, stats = worker.send(EccClearCommand(fault_id=fault_id))
        assert not reply.active and reply.kv_blocks_quarantined == 0
        assert stats["kv_blocks_poisoned"] == stats["kv_blocks_quarantined"] == 0, stats


def test_poisoning_a_block_two_running_requests_share_recomputes_both_token_exact():
    """The engine shares no blocks today (``KVBlockPool.share`` has no caller outside tests); a
    prefix cache would. Planted defect: ``poison_kv_block`` preempts only the first request found on
    the block (the unfixed engine_core.py), so the second keeps decoding over NaN KV it still holds."""
    from harness.engine.core.oracle import greedy_reference
    from harness.engine.core.scheduler import RequestStatus
    from harness.engine.core.tokenizer import ByteTokenizer
    from harness.engine.core.types import GenerateRequest, SamplingParams

    tok = ByteTokenizer()
    prompt = tok.encode("the same prefix " * 3)
    core = EngineCore(EngineConfig(preset="tiny", kv_budget_bytes=40 * 16 * 2048))
    for rid in ("a", "b"):
        core.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    out: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(3):
        for ev in core.step():
            out[ev.request_id] += ev.token_ids
    a, b = core.requests["a"], core.requests["b"]
    shared = a.block_table[0]  # identical prompts: b's first block holds the same KV, as a prefix cache would share
    core.pool.share([shared])
    core.pool.free([b.block_table[0]])
    b.block_table[0] = shared
    report = core.poison_kv_blocks(blocks=[shared])
    assert report["request_ids"] == ["a", "b"]
    assert a.status is RequestStatus.WAITING and b.status is RequestStatus.WAITING  # both recompute
    assert shared in core.pool.quarantined and shared not in core.pool.free_blocks
    for events in core.run_to_completion().values():
        for ev in events:
            out[ev.request_id] += ev.token_ids
    want = greedy_reference("tiny", prompt, 20, ignore_eos=True)
    assert out == {"a": want, "b": want}
    core.pool.check_invariants()
