"""Speculative decoding is lossless: the same tokens on or off, with real draft acceptance."""

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer

tok = ByteTokenizer()
PROMPTS = ["speculate on this", "draft and verify", "zzz", "The quick brown fox jumps"]


def run(engine: EngineCore, max_tokens: int = 40, **params) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(f"r{i}", tok.encode(p),
                                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)))
    return {rid: [t for e in evs for t in e.token_ids] for rid, evs in engine.run_to_completion().items()}


def test_greedy_tokens_identical_with_speculation_on_and_off():
    off = run(EngineCore(EngineConfig(preset="tiny", speculative=False)))
    spec_engine = EngineCore(EngineConfig(preset="tiny", speculative=True, spec_num_tokens=3))
    on = run(spec_engine)
    assert on == off
    for i, p in enumerate(PROMPTS):
        assert on[f"r{i}"] == greedy_reference("tiny", tok.encode(p), 40, ignore_eos=True)
    stats = spec_engine.stats()
    assert stats.spec_enabled and stats.spec_draft_tokens > 0
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.kv_blocks_used == 0


def test_more_draft_layers_accept_more():
    rates = []
    for layers in (1, 3):
        engine = EngineCore(EngineConfig(preset="tiny", speculative=True, spec_draft_layers=layers))
        run(engine)
        rates.append(engine.stats().spec_acceptance_rate)
    assert rates[0] < rates[1]


def test_switching_speculation_at_run_time_keeps_the_output():
    engine = EngineCore(EngineConfig(preset="tiny", speculative=True))
    for i, p in enumerate(PROMPTS):
        engine.add_request(GenerateRequest(f"r{i}", tok.encode(p), SamplingParams(max_tokens=40, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_work():
        if steps % 3 == 0:
            engine.set_speculative(not engine.stats().spec_enabled)
        for e in engine.step():
            out.setdefault(e.request_id, []).extend(e.token_ids)
        steps += 1
    for i, p in enumerate(PROMPTS):
        assert out[f"r{i}"] == greedy_reference("tiny", tok.encode(p), 40, ignore_eos=True)


def test_sampled_requests_are_unaffected_by_speculation():
    params = dict(temperature=0.8, seed=7)
    off = run(EngineCore(EngineConfig(preset="tiny")), 25, **params)
    engine = EngineCore(EngineConfig(preset="tiny", speculative=True))
    assert run(engine, 25, **params) == off
    assert engine.stats().spec_draft_tokens == 0


def test_speculation_respects_stop_rules_inside_an_accepted_run():
    full = greedy_reference("tiny", tok.encode(PROMPTS[0]), 40, ignore_eos=True)
    for max_tokens in (1, 2, 5, 13):
        engine = EngineCore(EngineConfig(preset="tiny", speculative=True, spec_num_tokens=4))
        engine.add_request(GenerateRequest("r", tok.encode(PROMPTS[0]),
                                           SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        events = engine.run_to_completion()["r"]
        assert [t for e in events for t in e.token_ids] == full[:max_tokens]
        assert engine.stats().kv_blocks_used == 0


def test_speculation_under_kv_pressure_with_preemption_stays_exact():
    # 10 blocks of 16 tokens for four requests that grow to 60+ tokens each
    engine = EngineCore(EngineConfig(preset="tiny", speculative=True, kv_budget_bytes=10 * 16 * 2048))
    out = run(engine, 45)
    assert engine.stats().extra["preemptions_total"] > 0
    for i, p in enumerate(PROMPTS):
        assert out[f"r{i}"] == greedy_reference("tiny", tok.encode(p), 45, ignore_eos=True)
    assert engine.stats().kv_blocks_used == 0
