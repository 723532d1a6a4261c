"""The OpenAI-compatible app in process: httpx's ASGI transport against the real tiny engine in a
thread (fixtures in conftest.py): completions, chat, streaming, errors, health and metrics.
Disconnects, speculative decoding, extra routers and TTFT stamping: test_api_lifecycle.py."""


from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from harness.engine.serving.api import build_app
from harness.engine.core.client import InProcessClient
from harness.engine.core.config import EngineConfig
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def test_greedy_completion_equals_oracle_with_usage_and_token_ids(engine, call):
    prompt = "Prefill and decode run apart"

    async def go(http):
        return await http.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})

    r, _ = call(engine, go)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = greedy_reference("tiny", TOK.encode(prompt), 20, ignore_eos=True)
    choice = body["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["text"] == TOK.decode(expected)
    assert choice["finish_reason"] == "length"
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": len(prompt.encode()), "completion_tokens": 20,
                             "total_tokens": len(prompt.encode()) + 20}
    assert "served_by" in body and body["served_by_all"] == ([body["served_by"]] if body["served_by"] else [])


def test_token_id_prompt_and_stop_string_follow_the_oracle(engine, call):
    prompt_ids = TOK.encode("KV blocks move layer by layer")
    free = greedy_reference("tiny", prompt_ids, 24, ignore_eos=True)
    stop = TOK.decode(free)[5:7]  # a stop string the greedy output is known to contain
    expected = greedy_reference("tiny", prompt_ids, 24, stop=[stop], ignore_eos=True)

    async def go(http):
        return await http.post("/v1/completions", json={
            "prompt": prompt_ids, "max_tokens": 24, "temperature": 0, "stop": stop, "ignore_eos": True,
            "return_token_ids": True})

    r, _ = call(engine, go)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == expected
    assert stop not in choice["text"]


def test_chat_completion_uses_the_chat_template_and_max_completion_tokens(engine, call):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Where does "},
                                             {"type": "text", "text": "KV go?"}]}]
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where does KV go?"}]
    prompt_ids = TOK.encode(TOK.apply_chat_template(flat))

    async def go(http):
        return await http.post("/v1/chat/completions", json={
            "messages": messages, "max_completion_tokens": 12, "max_tokens": 99, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})

    r, _ = call(engine, go)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = greedy_reference("tiny", prompt_ids, 12, ignore_eos=True)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TOK.decode(expected)}
    assert body["choices"][0]["token_ids"] == expected
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("chat", [False, True])
def test_stream_chunks_concatenate_to_the_oracle_and_end_with_usage(engine, chat, call, sse_messages):
    prompt = "Degradation level two"
    body = {"max_tokens": 15, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        prompt_ids = TOK.encode(TOK.apply_chat_template(body["messages"]))
    else:
        body["prompt"] = prompt
        prompt_ids = TOK.encode(prompt)

    async def go(http):
        return await http.post("/v1/chat/completions" if chat else "/v1/completions", json=body)

    r, _ = call(engine, go)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    messages = sse_messages(r.text)
    assert messages[-1] == "[DONE]"
    *chunks, usage_chunk, _ = messages
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 15,
                                    "total_tokens": len(prompt_ids) + 15}
    ids, text = [], ""
    for chunk in chunks:
        assert chunk["usage"] is None and "served_by" in chunk
        choice = chunk["choices"][0]
        ids += choice["token_ids"]
        text += choice["delta"].get("content", "") if chat else choice["text"]
    expected = greedy_reference("tiny", prompt_ids, 15, ignore_eos=True)
    assert ids == expected and text == TOK.decode(expected)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[0]["object"] == "chat.completion.chunk"


BAD_REQUESTS = [
    # (id, route, raw body, status, param, code, words in the message)
    ("invalid-json", "/v1/completions", b'{"prompt": "x",', 400, None, "invalid_json", "not valid JSON"),
    ("not-an-object", "/v1/completions", b'[1, 2]', 400, None, None, "JSON object"),
    ("wrong-type", "/v1/completions", b'{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens", None,
     "max_tokens"),
    ("bool-as-int", "/v1/completions", b'{"prompt": "x", "stream": 1}', 400, "stream", None, "boolean"),
    ("negative-max-tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens",
     None, "at least 1"),
    ("zero-max-tokens", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}', 400,
     "max_completion_tokens", None, "at least 1"),
    ("prompt-over-context", "/v1/completions", json.dumps({"prompt": "y" * 1100}).encode(), 400, "prompt",
     "context_length_exceeded", "1100 tokens"),
    ("prompt-plus-max-tokens-over-context", "/v1/completions",
     json.dumps({"prompt": "y" * 1000, "max_tokens": 100}).encode(), 400, "max_tokens",
     "context_length_exceeded", "1100"),
    ("unknown-model", "/v1/completions", b'{"prompt": "x", "model": "gpt-9"}', 404, "model",
     "model_not_found", "gpt-9"),
    ("n-2", "/v1/completions", b'{"prompt": "x", "n": 2}', 400, "n", "unsupported_parameter", "n=2"),
    ("missing-messages", "/v1/chat/completions", b'{"max_tokens": 3}', 400, "messages", None, "messages"),
    ("bad-role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400,
     "messages", None, "role"),
    ("batched-prompts", "/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt", "unsupported_parameter",
     "one prompt per request"),
    ("empty-prompt", "/v1/completions", b'{"prompt": ""}', 400, "prompt", None, "empty"),
    ("token-id-out-of-vocab", "/v1/completions", b'{"prompt": [1, 99999]}', 400, "prompt", None, "99999"),
    ("bad-stop", "/v1/completions", b'{"prompt": "x", "stop": [1]}', 400, "stop", None, "stop"),
    ("temperature-range", "/v1/completions", b'{"prompt": "x", "temperature": 7}', 400, "temperature", None,
     "temperature"),
    ("stream-options-without-stream", "/v1/completions",
     b'{"prompt": "x", "stream_options": {"include_usage": true}}', 400, "stream_options", None, "stream"),
    ("unsupported-tools", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', 400, "tools",
     "unsupported_parameter", "tool"),
    ("oversized-body", "/v1/completions", b'{"prompt": "' + b"z" * (5 * 1024 * 1024) + b'"}', 413, None,
     "request_too_large", "larger than"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(engine, call, metric_samples, scrape):
    async def go(http):
        answers = []
        for case_id, route, raw, *_ in BAD_REQUESTS:
            r = await http.post(route, content=raw, headers={"content-type": "application/json"})
            answers.append((case_id, r.status_code, r.json()))
        answers.append(("unknown-route", (await http.get("/v2/nothing")).status_code, None))
        ok = await http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3,
                                                      "ignore_eos": True})
        return answers, ok

    (answers, ok), app = call(engine, go)
    for (case_id, _, _, status, param, code, words), (_, got_status, body) in zip(BAD_REQUESTS, answers):
        assert got_status == status, (case_id, body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, case_id
        assert (error["param"], error["code"]) == (param, code), (case_id, error)
        assert words in error["message"], (case_id, error["message"])
        assert "Traceback" not in error["message"]
    assert answers[-1][1] == 404
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3

    # the app's own counter saw every refusal
    samples = metric_samples(asyncio.run(scrape(app)))
    refused = sum(v for (name, _), v in samples.items() if name == "pdengine_http_errors_total")
    assert refused == len(BAD_REQUESTS) + 1


def test_models_and_health(engine, call):
    async def go(http):
        return (await http.get("/v1/models")).json(), await http.get("/health")

    (models, health), _ = call(engine, go)
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_health_is_503_once_the_engine_is_closed(metric_samples):
    client = InProcessClient(EngineConfig(preset="tiny"))
    app = build_app(client)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
            before = await http.get("/health")
            await client.close()
            after = await http.get("/health")
            metrics = (await http.get("/metrics")).text
            refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            return before, after, metrics, refused

    before, after, metrics, refused = asyncio.run(go())
    assert before.status_code == 200
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    assert metric_samples(metrics)[("pdengine_engine_up", (("model_name", "tiny"),))] == 0.0
    # a closed engine ends the request with an error event: a clean 500, not a hang or a traceback
    assert refused.status_code == 500 and refused.json()["error"]["code"] == "engine_error"


def test_metrics_expose_documented_names_with_values_matching_the_traffic(engine, call, metric_samples):
    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]
    max_tokens = [4, 7, 10]

    async def go(http):
        for p, m in zip(prompts, max_tokens):
            r = await http.post("/v1/completions", json={"prompt": p, "max_tokens": m, "ignore_eos": True,
                                                         "temperature": 0, "stream": m == 7})
            assert r.status_code == 200
        return (await http.get("/metrics"))

    r, _ = call(engine, go)
    assert r.headers["content-type"].startswith("text/plain")
    s = metric_samples(r.text)
    model = (("model_name", "tiny"),)
    n = len(prompts)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds"):
        assert s[(f"pdengine_{hist}_count", model)] == n, hist
        assert s[(f"pdengine_{hist}_sum", model)] > 0, hist
    # one token per engine step without speculation: max_tokens - 1 gaps per request
    assert s[("pdengine_inter_token_latency_seconds_count", model)] == sum(m - 1 for m in max_tokens)
    assert s[("pdengine_requests_finished_total", (("finished_reason", "length"), *model))] == n
    assert s[("pdengine_requests_finished_total", (("finished_reason", "abort"), *model))] == 0
    assert s[("pdengine_generation_tokens_total", model)] == sum(max_tokens)
    assert s[("pdengine_prompt_tokens_total", model)] == sum(len(p) for p in prompts)
    cfg = EngineConfig(preset="tiny")
    assert s[("pdengine_kv_cache_blocks_total", model)] == cfg.num_blocks
    assert s[("pdengine_kv_cache_block_bytes", model)] == cfg.block_bytes
    assert s[("pdengine_kv_cache_blocks_used", model)] == 0  # all finished: KV freed
    assert s[("pdengine_kv_cache_usage_ratio", model)] == 0
    assert s[("pdengine_engine_up", model)] == 1
    for gauge in ("num_requests_running", "num_requests_waiting", "spec_decode_enabled",
                  "spec_decode_draft_tokens_total", "spec_decode_accepted_tokens_total",
                  "spec_decode_acceptance_rate"):
        assert (f"pdengine_{gauge}", model) in s, gauge


# ---- client disconnect, driven through the bare ASGI interface ------------------------------
