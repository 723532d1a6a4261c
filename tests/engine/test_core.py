"""EngineCore behaviour against the dense oracle (tiny preset)."""

import pytest

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.types import FinishReason, GenerateRequest, SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import InvalidRequestError, KVCapacityError, KVIntegrityError

tok = ByteTokenizer()
BLOCK_BYTES = 16 * 2048  # tiny: 2048 KV bytes per token, 16 tokens per block


def engine(**overrides) -> EngineCore:
    return EngineCore(EngineConfig(preset="tiny", **overrides))


def req(rid: str, prompt: str, max_tokens: int = 20, **params) -> GenerateRequest:
    params.setdefault("ignore_eos", True)
    return GenerateRequest(rid, tok.encode(prompt), SamplingParams(max_tokens=max_tokens, **params))


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def text_of(events) -> str:
    return "".join(e.text for e in events)


def oracle(prompt: str, max_tokens: int = 20, **kw) -> list[int]:
    kw.setdefault("ignore_eos", True)
    return greedy_reference("tiny", tok.encode(prompt), max_tokens, **kw)


PROMPTS = ["Hello world", "The quick brown fox", "abc", "KV cache " * 6, "x"]


def test_greedy_output_is_token_exact_alone_and_in_any_batch():
    alone = {}
    for i, p in enumerate(PROMPTS):
        eng = engine()
        eng.add_request(req(f"r{i}", p))
        alone[i] = tokens_of(eng.run_to_completion()[f"r{i}"])
        assert alone[i] == oracle(p)
    eng = engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(req(f"r{i}", p, max_tokens=20 - i))  # different lengths: the batch changes
    done = eng.run_to_completion()
    for i in range(len(PROMPTS)):
        assert tokens_of(done[f"r{i}"]) == alone[i][:20 - i]


def test_continuous_batching_admits_and_finishes_between_steps():
    eng = engine()
    eng.add_request(req("long", "first request", max_tokens=12))
    first = eng.step()
    assert [e.request_id for e in first] == ["long"] and eng.stats().num_running == 1
    eng.step()
    eng.add_request(req("short", "second request", max_tokens=3))
    joined = eng.step()
    assert {e.request_id for e in joined} == {"long", "short"}
    assert eng.stats().num_running == 2
    events = {"long": [], "short": []}
    finished_order = []
    while eng.has_work():
        for e in eng.step():
            events[e.request_id].append(e)
            if e.finished:
                finished_order.append(e.request_id)
    assert finished_order == ["short", "long"]
    stats = eng.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert stats.extra["kv_blocks_free"] == stats.kv_blocks_total


def test_events_carry_counts_and_final_reason():
    eng = engine(name="decode-0")
    eng.add_request(req("r", "count me", max_tokens=5))
    events = eng.run_to_completion()["r"]
    assert [e.num_output_tokens for e in events] == [1, 2, 3, 4, 5]
    assert events[-1].finished and events[-1].finish_reason is FinishReason.LENGTH
    assert not any(e.finished for e in events[:-1])
    assert all(e.num_prompt_tokens == len("count me") and e.worker == "decode-0" for e in events)


def test_stop_string_is_excluded_from_text_and_ends_the_request():
    full = oracle("Hello world", 40)
    full_text = tok.decode(full)
    stop = full_text[12:15]
    eng = engine()
    eng.add_request(req("r", "Hello world", 40, stop=(stop,)))
    events = eng.run_to_completion()["r"]
    assert events[-1].finish_reason is FinishReason.STOP
    assert text_of(events) == full_text[:full_text.index(stop)]
    assert tokens_of(events) == oracle("Hello world", 40, stop=[stop])
    assert eng.stats().kv_blocks_used == 0


def test_eos_stops_unless_ignored():
    prompt = "prompt 0"  # tiny's greedy output for it reaches EOS within a few tokens
    natural = oracle(prompt, 64, ignore_eos=False)
    assert natural[-1] == tok.EOS and len(natural) < 64
    eng = engine()
    eng.add_request(req("stops", prompt, 64, ignore_eos=False))
    eng.add_request(req("goes-on", prompt, 64, ignore_eos=True))
    done = eng.run_to_completion()
    assert tokens_of(done["stops"]) == natural
    assert done["stops"][-1].finish_reason is FinishReason.STOP
    assert len(tokens_of(done["goes-on"])) == 64
    assert tokens_of(done["goes-on"])[:len(natural)] == natural


def test_context_limit_finishes_with_length():
    eng = engine(max_model_len=32)
    prompt = "a prompt of 24 tokens.."
    eng.add_request(req("r", prompt, max_tokens=100))
    events = eng.run_to_completion()["r"]
    assert len(tokens_of(events)) == 32 - len(prompt)
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_abort_frees_kv_and_reports_abort():
    eng = engine()
    eng.add_request(req("r", "abort me " * 5, max_tokens=50))
    eng.step()
    assert eng.stats().kv_blocks_used > 0
    eng.abort("r")
    assert eng.stats().kv_blocks_used == 0 and not eng.stats().num_running
    [event] = eng.step()
    assert event.finished and event.finish_reason is FinishReason.ABORT
    assert not eng.has_work()


def test_admission_waits_for_free_kv_then_both_finish_exactly():
    # 6 blocks = 96 tokens; a prompt of 50 takes 4 blocks and peaks at 50 + 30 = 80 tokens (5)
    eng = engine(kv_budget_bytes=6 * BLOCK_BYTES)
    a, b = "a" * 50, "b" * 50
    eng.add_request(req("a", a, 30))
    eng.add_request(req("b", b, 30))
    first = eng.step()
    assert eng.stats().num_running == 1 and eng.stats().num_waiting == 1
    done = eng.run_to_completion()
    assert tokens_of(first + done["a"]) == oracle(a, 30) and tokens_of(done["b"]) == oracle(b, 30)
    assert eng.stats().kv_blocks_used == 0


def test_preempted_request_is_recomputed_token_exactly():
    # both prompts fit at once (2 + 2 blocks of 5), but growing to 70 tokens each does not
    eng = engine(kv_budget_bytes=7 * BLOCK_BYTES)
    eng.add_request(req("a", "p" * 20, 50))
    eng.add_request(req("b", "q" * 20, 50))
    done = eng.run_to_completion()
    assert eng.stats().extra["preemptions_total"] > 0
    assert tokens_of(done["a"]) == oracle("p" * 20, 50) and tokens_of(done["b"]) == oracle("q" * 20, 50)


def test_request_that_can_never_fit_gets_a_clear_error_event():
    eng = engine(kv_budget_bytes=2 * BLOCK_BYTES)
    eng.add_request(req("big", "z" * 20, 100))
    [event] = eng.step()
    assert event.finished and event.finish_reason is FinishReason.ERROR
    assert "KV blocks" in event.error and "kv_budget_bytes" in event.error
    assert not eng.has_work()


@pytest.mark.parametrize("bad, match", [
    (GenerateRequest("e", []), "empty"),
    (GenerateRequest("t", [1, 999]), "999"),
    (GenerateRequest("l", [65] * 2000), "max_model_len"),
])
def test_malformed_requests_are_rejected(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine().add_request(bad)


def test_duplicate_request_id_is_rejected():
    eng = engine()
    eng.add_request(req("same", "one"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request(req("same", "two"))


def test_resume_continues_exactly_like_an_uninterrupted_run():
    full = oracle("resume me", 30)
    eng = engine()
    eng.add_request(GenerateRequest("r", tok.encode("resume me"), SamplingParams(max_tokens=30, ignore_eos=True),
                                    resume_token_ids=full[:11]))
    events = eng.run_to_completion()["r"]
    assert tokens_of(events) == full[11:]
    assert events[-1].num_output_tokens == 30
    assert text_of(events) == tok.decode(full)[len(tok.decode(full[:11])):]


def test_seeded_sampling_is_reproducible_across_batches_and_resume():
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    eng = engine()
    eng.add_request(req("alone", "sample me", **params))
    alone = tokens_of(eng.run_to_completion()["alone"])
    eng = engine()
    for i in range(3):
        eng.add_request(req(f"other{i}", f"noise {i}", max_tokens=10 + i, temperature=1.0, seed=i))
    eng.add_request(req("batched", "sample me", **params))
    batched = tokens_of(eng.run_to_completion()["batched"])
    assert batched == alone
    assert alone != oracle("sample me", 24)  # it really sampled
    eng = engine()
    eng.add_request(GenerateRequest("resumed", tok.encode("sample me"), SamplingParams(ignore_eos=True, **params),
                                    resume_token_ids=alone[:9]))
    assert tokens_of(eng.run_to_completion()["resumed"]) == alone[9:]


def test_pd_prefill_then_import_decodes_token_exactly():
    prompt = "disaggregated prefill"
    prefill, decode = engine(name="prefill-0"), engine(name="decode-0")
    request = req("pd", prompt, 20)
    layers = []
    result = prefill.prefill_for_transfer(request, on_layer=lambda i, k, v: layers.append(i))
    assert layers == list(range(prefill.model_config.n_layers))
    assert result.num_tokens == len(prompt) and prefill.stats().kv_blocks_used == 0
    handle = decode.begin_import(request, result.num_tokens)
    for i, (k, v) in enumerate(result.kv):
        handle.write_layer(i, k, v)
    decode.commit_import(handle, result.first_token_id)
    events = decode.run_to_completion()["pd"]
    assert events[0].token_ids[0] == result.first_token_id and events[0].worker == "decode-0"
    assert tokens_of(events) == oracle(prompt, 20)
    assert decode.stats().kv_blocks_used == 0


def test_pd_import_checks_shapes_and_cancel_frees_blocks():
    prefill, decode = engine(), engine()
    request = req("pd", "shape check", 5)
    result = prefill.prefill_for_transfer(request)
    handle = decode.begin_import(request, result.num_tokens)
    assert decode.stats().kv_blocks_used > 0
    k, v = result.kv[0]
    with pytest.raises(KVIntegrityError, match="shape"):
        handle.write_layer(0, k[:-1], v[:-1])
    handle.write_layer(0, k, v)
    with pytest.raises(KVIntegrityError, match="missing"):
        decode.commit_import(handle, result.first_token_id)  # layers 1.. never arrived
    assert decode.stats().kv_blocks_used == 0
    handle = decode.begin_import(request, result.num_tokens)
    decode.cancel_import(handle)
    assert decode.stats().kv_blocks_used == 0 and not decode.has_work()


def test_live_migration_moves_kv_and_continues_exactly():
    source, target = engine(), engine()
    source.add_request(req("m", "migrate me please", 30))
    streamed = []
    for _ in range(8):
        streamed += tokens_of(source.step())
    exported = source.export_request("m")
    assert source.stats().kv_blocks_used == 0 and not source.has_work()
    target.import_request(exported)
    streamed += tokens_of(target.run_to_completion()["m"])
    assert streamed == oracle("migrate me please", 30)


def test_migration_with_a_corrupted_block_is_refused_and_nothing_is_kept():
    source, target = engine(), engine()
    source.add_request(req("m", "corrupt me " * 3, 30))
    for _ in range(4):
        source.step()
    exported = source.export_request("m")
    bad = bytearray(exported.blocks[1].data)
    bad[7] ^= 0x40
    exported.blocks[1] = type(exported.blocks[1])(bytes(bad), exported.blocks[1].checksum)
    with pytest.raises(KVIntegrityError, match="checksum"):
        target.import_request(exported)
    assert target.stats().kv_blocks_used == 0 and not target.has_work()


def test_long_prompt_is_prefilled_in_chunks_while_running_streams_keep_decoding():
    eng = engine(max_prefill_tokens=8)
    eng.add_request(req("stream", "s", 30))
    eng.step()
    long_prompt = "a long prompt that takes several chunks"  # 39 tokens: 5 steps of 8
    eng.add_request(req("long", long_prompt, 10))
    steps_until_first_token = 0
    events: dict[str, list] = {"stream": [], "long": []}
    while not events["long"]:
        step = eng.step()
        steps_until_first_token += 1
        assert "stream" in {e.request_id for e in step}  # never stalled by the prefill
        for e in step:
            events[e.request_id].append(e)
    assert steps_until_first_token == 5
    for rid, evs in eng.run_to_completion().items():
        events[rid] += evs
    assert tokens_of(events["long"]) == oracle(long_prompt, 10)
    assert eng.stats().prompt_tokens_total == 1 + len(long_prompt)


def test_preemption_spares_high_priority_requests():
    eng = engine(kv_budget_bytes=7 * BLOCK_BYTES)
    eng.add_request(req("low", "p" * 20, 50))
    eng.add_request(req("high", "q" * 20, 50, priority=5))  # newest, but more important
    events: dict[str, list] = {"low": [], "high": []}
    while not (events["high"] and events["high"][-1].finished):
        step = eng.step()
        assert "high" in {e.request_id for e in step}  # never preempted: a token every step
        for e in step:
            events[e.request_id].append(e)
    for rid, evs in eng.run_to_completion().items():
        events[rid] += evs
    assert eng.stats().extra["preemptions_total"] > 0
    assert tokens_of(events["high"]) == oracle("q" * 20, 50) and tokens_of(events["low"]) == oracle("p" * 20, 50)


def test_hbm_fill_holds_blocks_until_released():
    eng = engine(kv_budget_bytes=8 * BLOCK_BYTES)
    assert eng.hold_kv_blocks(6) == 6
    stats = eng.stats()
    assert stats.kv_blocks_used == 6 and stats.extra["kv_blocks_held"] == 6
    eng.add_request(req("r", "w" * 40, 20))  # needs 3 blocks for its prompt: waits
    eng.step()
    assert eng.stats().num_waiting == 1
    assert eng.release_kv_blocks() == 6
    assert tokens_of(eng.run_to_completion()["r"]) == oracle("w" * 40, 20)
    assert eng.stats().kv_blocks_used == 0


def test_poisoned_block_is_quarantined_and_its_request_recomputed_exactly():
    eng = engine(kv_budget_bytes=8 * BLOCK_BYTES)
    eng.add_request(req("victim", "poison " * 4, 30))
    streamed = []
    for _ in range(5):
        streamed += tokens_of(eng.step())
    report = eng.poison_kv_block()
    assert report["request_id"] == "victim"
    assert eng.stats().extra["kv_blocks_quarantined"] == 1
    streamed += tokens_of(eng.run_to_completion()["victim"])
    assert streamed == oracle("poison " * 4, 30)
    eng.hold_kv_blocks(7)  # every healthy block: the poisoned one is never handed out
    with pytest.raises(KVCapacityError, match="free"):
        eng.hold_kv_blocks(1)
    eng.release_kv_blocks()
    assert eng.restore_quarantined_blocks() == 1
    assert eng.stats().extra["kv_blocks_quarantined"] == 0 and eng.hold_kv_blocks(8) == 8


def test_poisoning_an_import_before_its_first_token_streams_it_once():
    prefill, decode = engine(), engine()
    request = req("pd", "imported then poisoned", 12)
    result = prefill.prefill_for_transfer(request)
    handle = decode.begin_import(request, result.num_tokens)
    for i, (k, v) in enumerate(result.kv):
        handle.write_layer(i, k, v)
    decode.commit_import(handle, result.first_token_id)
    assert decode.poison_kv_block()["request_id"] == "pd"
    events = decode.run_to_completion()["pd"]
    assert tokens_of(events) == oracle("imported then poisoned", 12)


def test_abort_of_a_waiting_request_and_resume_that_already_reached_max_tokens():
    eng = engine(kv_budget_bytes=4 * BLOCK_BYTES)
    eng.add_request(req("running", "r" * 40, 20))
    eng.add_request(req("queued", "q" * 40, 20))
    eng.step()
    assert eng.stats().num_waiting == 1
    eng.abort("queued")
    assert eng.stats().num_waiting == 0
    eng.add_request(GenerateRequest("done", tok.encode("x"), SamplingParams(max_tokens=3),
                                    resume_token_ids=[65, 66, 67]))
    done = eng.run_to_completion()
    assert done["queued"][-1].finish_reason is FinishReason.ABORT
    assert done["done"] == [done["done"][0]] and done["done"][0].token_ids == []
    assert done["done"][0].finish_reason is FinishReason.LENGTH and done["done"][0].num_output_tokens == 3
