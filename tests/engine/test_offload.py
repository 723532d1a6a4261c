"""KV offload tiers (seed 4.3): swap-out above the threshold, LRU rotation, priority protection,
checksum-verified fetch back, and token-exactness against the dense oracle (tiny preset)."""

import os

import pytest

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import ConfigError, EngineError

tok = ByteTokenizer()
BLOCK_BYTES = 16 * 2048  # tiny: 2048 KV bytes per token, 16 tokens per block
PROMPTS = [f"request {i}: offload me " * 2 for i in range(6)]
MAX_TOKENS = 40  # prompt ~44 + 40 tokens = 6 blocks each; 6 requests need 36 blocks


def engine(blocks: int = 24, **overrides) -> EngineCore:
    overrides.setdefault("offload", True)
    return EngineCore(EngineConfig(preset="tiny", kv_budget_bytes=blocks * BLOCK_BYTES, **overrides))


def req(rid: str, prompt: str, priority: int = 0) -> GenerateRequest:
    return GenerateRequest(rid, tok.encode(prompt), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                                   priority=priority))


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    return {f"r{i}": greedy_reference("tiny", tok.encode(p), MAX_TOKENS, ignore_eos=True)
            for i, p in enumerate(PROMPTS)}


def test_offload_keeps_outputs_token_exact_and_uses_the_cpu_tier(expected, drive):
    eng = engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p))
    peak = {"cpu": 0, "swapped": 0}

    def watch(e):
        s = e.offload_stats()
        peak["cpu"] = max(peak["cpu"], s["offload"]["cpu"])
        peak["swapped"] = max(peak["swapped"], s["kv_requests_swapped"])
        # after the rebalance at the top of each step the pool may grow only by this step's work
        e.pool.check_invariants()

    assert drive(eng, watch) == expected
    stats = eng.offload_stats()
    assert stats["offloads_total"] > 0 and stats["offload_fetches_total"] == stats["offloads_total"]
    assert peak["cpu"] > 0 and peak["swapped"] > 0
    assert stats["offload"]["cpu"] == 0 and stats["offload"]["nvme"] == 0  # everything came back
    assert stats["offload_fetch_s"] > 0
    assert eng.pool.num_free == eng.pool.num_blocks


def test_offload_off_recomputes_instead_and_matches(expected, drive):
    eng = engine(offload=False)
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p))
    assert drive(eng) == expected
    assert eng.offload_stats()["offloads_total"] == 0


def test_nvme_tier_takes_what_cpu_cannot_hold(tmp_path, expected, drive):
    eng = engine(offload_cpu_bytes=0, offload_dir=str(tmp_path))
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p))
    seen = []
    assert drive(eng, lambda e: seen.append(len(os.listdir(tmp_path)))) == expected
    assert max(seen) > 0 and os.listdir(tmp_path) == []  # files written, then removed on fetch
    assert eng.offload_stats()["offloads_total"] > 0


def test_corrupted_offloaded_block_is_detected_and_the_request_recomputed(tmp_path, expected, drive):
    eng = engine(offload_cpu_bytes=0, offload_dir=str(tmp_path))
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p))
    damaged = []

    def corrupt_once(e):
        if damaged or not e.offload.swapped:
            return
        rid = e.offload.swapped[-1].req.request_id
        path = e.offload.store.nvme_path(rid)
        with open(path, "r+b") as f:  # flip one byte of the first block on "disk"
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
        damaged.append(rid)

    assert drive(eng, corrupt_once) == expected  # never served from the damaged copy
    assert damaged and eng.offload_stats()["offload_corrupt_total"] == 1


def test_high_priority_requests_are_never_offloaded(expected, drive):
    eng = engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p, priority=1 if i == 0 else 0))
    swapped_ids = set()
    out = drive(eng, lambda e: swapped_ids.update(s.req.request_id for s in e.offload.swapped))
    assert out == expected
    assert swapped_ids and "r0" not in swapped_ids


def test_offload_starts_only_above_the_threshold_for_example_under_an_hbm_fill(expected, drive):
    calm = engine(blocks=40)
    for i in range(3):  # 18 of 40 blocks: below 85 %
        calm.add_request(req(f"r{i}", PROMPTS[i]))
    assert drive(calm) == {f"r{i}": expected[f"r{i}"] for i in range(3)}
    assert calm.offload_stats()["offloads_total"] == 0
    filled = engine(blocks=40)
    filled.hold_kv_blocks(20)  # another tenant takes half the HBM: 38 of 40 blocks in use
    for i in range(3):
        filled.add_request(req(f"r{i}", PROMPTS[i]))
    swapped_per_step = []
    assert drive(filled, lambda e: swapped_per_step.append(e.offload_stats()["kv_requests_swapped"])) == {
        f"r{i}": expected[f"r{i}"] for i in range(3)}
    assert filled.offload_stats()["offloads_total"] > 0 and max(swapped_per_step) > 0


def test_a_fill_above_the_threshold_still_lets_requests_progress_in_turn(expected, drive):
    eng = engine(blocks=40)
    eng.hold_kv_blocks(32)  # 80 %: with any request resident the pool is above 85 %
    for i in range(3):
        eng.add_request(req(f"r{i}", PROMPTS[i]))
    resident = []
    assert drive(eng, lambda e: resident.append(len(e.scheduler.running))) == {
        f"r{i}": expected[f"r{i}"] for i in range(3)}
    assert eng.offload_stats()["offloads_total"] > 0 and resident.count(1) > len(resident) // 2  # one at a time


def test_set_offload_switches_at_run_time_and_rejects_bad_thresholds():
    eng = engine(offload=False)
    eng.set_offload(True, 0.6)
    assert eng.offload.enabled and eng.offload.threshold == 0.6
    with pytest.raises(ConfigError, match="threshold"):
        eng.set_offload(True, 1.5)


@pytest.mark.parametrize("field,value", [("offload_threshold", 0.0), ("offload_cpu_bytes", -1),
                                         ("offload_min_resident_steps", 0)])
def test_offload_config_is_validated(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(preset="tiny", **{field: value})


def test_an_offloaded_request_can_be_paused_for_migration_when_blocks_are_free(expected, drive):
    eng = engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p))
    out: dict[str, list[int]] = {}
    while not eng.offload.swapped:
        for ev in eng.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
    swapped = eng.offload.swapped[0].req.request_id
    eng.hold_kv_blocks(eng.pool.num_free)  # no room: the pause is refused with the reason
    with pytest.raises(EngineError, match="offloaded"):
        eng.pause_request(swapped)
    eng.release_kv_blocks()
    tokens = eng.pause_request(swapped)      # fetched back (checksums verified), then paused
    assert tokens[-len(out[swapped]):] == out[swapped]
    assert eng.resume_request(swapped)       # e.g. the migration failed: it simply continues here
    rest = drive(eng)
    assert {rid: out.get(rid, []) + rest.get(rid, []) for rid in expected} == expected
