"""Worker fault hooks (HBM fill, ECC poisoning) on a real engine: they take effect, bite, keep
outputs token-exact, and revert exactly (tiny preset, in-process)."""

import pytest
import torch

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.control.codec import VERSION, from_dict
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.resilience.worker_faults import WorkerFaults, kv_used_ratio
from harness.errors import ConfigError

tok = ByteTokenizer()
BLOCK_BYTES = 16 * 2048
PROMPTS = ["poison " * 5, "fill the pool", "abc " * 9]
MAX_TOKENS = 24


@pytest.fixture
def core() -> EngineCore:
    return EngineCore(EngineConfig(preset="tiny", kv_budget_bytes=40 * BLOCK_BYTES))


def handle(faults: WorkerFaults, command: dict) -> dict:
    """Send ``command`` as the router would (through the typed decoder); the reply as a dict."""
    return faults.handle(from_dict({"v": VERSION, **command})).public()


def add_all(core: EngineCore) -> None:
    for i, p in enumerate(PROMPTS):
        core.add_request(GenerateRequest(f"r{i}", tok.encode(p), SamplingParams(max_tokens=MAX_TOKENS,
                                                                                ignore_eos=True)))


def expected() -> dict[str, list[int]]:
    return {f"r{i}": greedy_reference("tiny", tok.encode(p), MAX_TOKENS, ignore_eos=True)
            for i, p in enumerate(PROMPTS)}


def test_hbm_fill_raises_used_ratio_by_the_share_and_release_restores_it_exactly(core):
    faults = WorkerFaults(core)
    before = kv_used_ratio(core)
    state = handle(faults, {"type": "hbm_fill", "fault_id": "f1", "share": 0.5})
    assert state["type"] == "fault_state" and state["kind"] == "hbm_fill" and state["active"]
    assert state["blocks"] == 20 and state["kv_used_ratio"] == pytest.approx(before + 0.5)
    assert handle(faults, {"type": "hbm_fill", "fault_id": "f1", "share": 0.5})["blocks"] == 20  # not twice
    assert kv_used_ratio(core) == pytest.approx(before + 0.5)
    released = handle(faults, {"type": "hbm_release", "fault_id": "f1"})
    assert not released["active"] and released["blocks"] == 20
    assert kv_used_ratio(core) == before and core.pool.num_free == core.pool.num_blocks
    assert handle(faults, {"type": "hbm_release", "fault_id": "f1"})["blocks"] == 0  # idempotent
    core.pool.check_invariants()


def test_requests_finish_token_exact_under_an_hbm_fill(core, drive):
    faults = WorkerFaults(core)
    handle(faults, {"type": "hbm_fill", "fault_id": "f", "share": 0.7})
    add_all(core)
    assert drive(core) == expected()
    handle(faults, {"type": "hbm_release", "fault_id": "f"})
    assert core.pool.num_free == core.pool.num_blocks


@pytest.mark.parametrize("msg,words", [({"type": "hbm_fill", "fault_id": "x", "share": 1.5}, "share"),
                                       ({"type": "hbm_fill", "share": 0.5}, "fault_id"),
                                       ({"type": "ecc_poison", "fault_id": "x", "blocks": [999]}, "no KV block"),
                                       ({"type": "ecc_poison", "fault_id": "x", "count": 0}, "count")])
def test_bad_fault_commands_are_refused_with_the_reason(core, msg, words):
    state = handle(WorkerFaults(core), msg)
    assert state["active"] is False and words in state["error"]
    assert core.pool.num_free == core.pool.num_blocks


def test_ecc_poison_bites_running_requests_which_recompute_token_exact(core, drive):
    faults = WorkerFaults(core)
    add_all(core)
    early: dict[str, list[int]] = {}
    for _ in range(3):  # everything is decoding now
        for ev in core.step():
            early.setdefault(ev.request_id, []).extend(ev.token_ids)
    state = handle(faults, {"type": "ecc_poison", "fault_id": "e1", "count": 2})
    poisoned = set(state["blocks"])
    assert state["active"] and len(poisoned) == 2 and state["affected"]
    assert state["kv_blocks_poisoned"] == 2

    def never_allocated(_core):
        for seq in core.requests.values():
            assert not poisoned & set(seq.block_table), "a poisoned block was handed out again"

    rest = drive(core, never_allocated)
    assert {rid: early[rid] + rest[rid] for rid in early} == expected()
    assert set(state["affected"]) == {"r0", "r1"}
    assert core.pool.quarantined == poisoned
    cleared = handle(faults, {"type": "ecc_clear", "fault_id": "e1"})
    assert cleared["restored"] == 2 and not cleared["active"]
    assert not core.pool.quarantined and core.pool.num_free == core.pool.num_blocks
    core.pool.check_invariants()


def test_ecc_poison_of_named_blocks_and_clear_is_per_fault(core):
    faults = WorkerFaults(core)
    handle(faults, {"type": "ecc_poison", "fault_id": "a", "blocks": [1, 2]})
    handle(faults, {"type": "ecc_poison", "fault_id": "b", "blocks": [5]})
    assert core.pool.quarantined == {1, 2, 5}
    handle(faults, {"type": "ecc_clear", "fault_id": "a"})
    assert core.pool.quarantined == {5}
    handle(faults, {"type": "ecc_clear", "fault_id": "b"})
    assert not core.pool.quarantined


def test_request_poisoned_while_paused_for_migration_is_recomputed_on_resume(core, drive):
    add_all(core)
    early: dict[str, list[int]] = {}
    for _ in range(3):
        for ev in core.step():
            early.setdefault(ev.request_id, []).extend(ev.token_ids)
    core.pause_request("r0")  # a migration is in flight
    block = core.requests["r0"].block_table[0]
    handle(WorkerFaults(core), {"type": "ecc_poison", "fault_id": "p", "blocks": [block]})
    assert core.resume_request("r0")  # the migration failed: r0 continues here, from clean KV
    rest = drive(core)
    assert {rid: early[rid] + rest.get(rid, []) for rid in early} == expected()


def test_a_request_that_cannot_finish_beside_an_hbm_fill_waits_for_the_release(core, drive):
    faults = WorkerFaults(core)
    handle(faults, {"type": "hbm_fill", "fault_id": "big", "share": 0.9})  # 36 of 40 blocks
    prompt = tok.encode(PROMPTS[0])
    core.add_request(GenerateRequest("long", prompt, SamplingParams(max_tokens=200, ignore_eos=True)))
    for _ in range(20):  # its prompt would fit, its whole output not: it must not start (and recompute forever)
        assert core.step() == []
    assert core.stats().num_waiting == 1 and core.scheduler.preemptions_total == 0
    handle(faults, {"type": "hbm_release", "fault_id": "big"})
    assert drive(core)["long"] == greedy_reference("tiny", prompt, 200, ignore_eos=True)


@pytest.fixture
def core_without_ecc() -> EngineCore:
    return EngineCore(EngineConfig(preset="tiny", kv_budget_bytes=40 * BLOCK_BYTES, ecc_handling=False))


def decode_a_little(core: EngineCore) -> dict[str, list[int]]:
    add_all(core)
    early: dict[str, list[int]] = {}
    for _ in range(3):  # everything is decoding now
        for ev in core.step():
            early.setdefault(ev.request_id, []).extend(ev.token_ids)
    return early


def test_with_ecc_handling_off_a_poisoned_block_stays_in_service_and_its_request_goes_wrong(core_without_ecc,
                                                                                          drive):
    core = core_without_ecc
    faults = WorkerFaults(core)
    early = decode_a_little(core)
    owner_blocks = {rid: list(core.requests[rid].block_table) for rid in early}
    preemptions = core.scheduler.preemptions_total
    state = handle(faults, {"type": "ecc_poison", "fault_id": "e1", "count": 2})
    poisoned = set(state["blocks"])
    assert state["active"] and state["ecc_handling"] is False and len(poisoned) == 2
    assert set(state["affected"]) == {"r0", "r1"}  # whose KV was there, though nothing is recomputed
    assert state["kv_blocks_poisoned"] == 2 and state["kv_blocks_quarantined"] == 0
    assert not core.pool.quarantined and core.pool.poisoned == poisoned
    assert all(torch.isnan(core.pool.storage[b]).all() for b in poisoned)

    out = {rid: early[rid] + rest for rid, rest in drive(core).items()}
    assert core.scheduler.preemptions_total == preemptions  # nobody was recomputed
    want = expected()
    assert out["r0"] != want["r0"] and out["r1"] != want["r1"]  # they decoded from NaN KV
    assert out["r2"] == want["r2"]  # its KV was not poisoned
    assert all(len(out[rid]) == MAX_TOKENS for rid in want)  # they still ran to the end
    assert poisoned <= set(owner_blocks["r0"]) | set(owner_blocks["r1"])
    assert poisoned <= set(core.pool.free_blocks)  # freed into service again, still poisoned
    assert core.stats().extra["kv_blocks_poisoned"] == 2

    cleared = handle(faults, {"type": "ecc_clear", "fault_id": "e1"})
    assert cleared["restored"] == 2 and cleared["kv_blocks_poisoned"] == 0
    assert not core.pool.poisoned and all((core.pool.storage[b] == 0).all() for b in poisoned)
    assert core.pool.num_free == core.pool.num_blocks
    core.pool.check_invariants()


def test_with_ecc_handling_off_poisoned_blocks_are_handed_out_to_new_requests(core_without_ecc):
    core = core_without_ecc
    handle(WorkerFaults(core), {"type": "ecc_poison", "fault_id": "free", "blocks": [0, 1]})
    assert core.pool.poisoned == {0, 1} and {0, 1} <= set(core.pool.free_blocks)
    core.add_request(GenerateRequest("new", tok.encode(PROMPTS[2]), SamplingParams(max_tokens=2, ignore_eos=True)))
    core.step()
    assert {0, 1} & set(core.requests["new"].block_table)  # an ignored retirement signal: memory reused


def test_with_ecc_handling_on_the_same_poisoning_is_quarantined_and_recomputed(core, drive):
    assert core.config.ecc_handling  # the default
    faults = WorkerFaults(core)
    early = decode_a_little(core)
    preemptions = core.scheduler.preemptions_total
    state = handle(faults, {"type": "ecc_poison", "fault_id": "e1", "count": 2})
    assert state["ecc_handling"] is True and state["kv_blocks_poisoned"] == state["kv_blocks_quarantined"] == 2
    assert {rid: early[rid] + rest for rid, rest in drive(core).items()} == expected()
    assert core.scheduler.preemptions_total == preemptions + 2
    assert handle(faults, {"type": "ecc_clear", "fault_id": "e1"})["kv_blocks_quarantined"] == 0
    assert not core.pool.poisoned and not core.pool.quarantined


def test_ecc_handling_must_be_a_bool():
    with pytest.raises(ConfigError, match="ecc_handling must be true or false"):
        EngineConfig(preset="tiny", ecc_handling="no")
