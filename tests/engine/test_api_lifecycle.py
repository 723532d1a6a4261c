"""The OpenAI-compatible app's request lifecycle, in process against the real tiny engine: client
disconnects (a bare ASGI driver), speculative decoding, extra routers sharing the error shape and
the scrape, and when TTFT is stamped. Fixtures in conftest.py; the rest of the API: test_api.py."""


from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from harness.engine.serving.api import build_app
from harness.engine.core.client import InProcessClient
from harness.engine.core.config import EngineConfig
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


async def _asgi_post(app, path: str, body: dict, disconnect_after_chunks: int | None) -> list[dict]:
    """POST ``body``; the client disconnects after that many response body messages (or, when
    None, right after sending the request). Returns every message the app sent."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    gone = asyncio.Event()
    if disconnect_after_chunks is None:
        gone.set()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        bodies = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_chunks is not None and len(bodies) >= disconnect_after_chunks:
            gone.set()

    await app(_post_scope(path, raw), receive, send)
    return sent


def _post_scope(path: str, raw: bytes) -> dict:
    """The ASGI scope of a JSON POST of ``raw`` to ``path``."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(raw)).encode())],
            "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 80)}


def _wait_kv_free(engine, deadline_s: float = 60.0) -> None:
    # The abort reaches the engine thread asynchronously; its stats refresh after its next loop.
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"KV not freed after the client went away: {engine.stats()}")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request_and_frees_its_kv(engine, stream, metric_samples, scrape):
    app = build_app(engine)
    # a long request: it cannot finish on its own before the client leaves
    body = {"prompt": "a long answer please", "max_tokens": 1000, "ignore_eos": True, "stream": stream}
    sent = asyncio.run(_asgi_post(app, "/v1/completions", body, 3 if stream else None))
    chunks = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    if stream:
        assert sent[0]["status"] == 200 and len(chunks) >= 3
        assert b"[DONE]" not in b"".join(chunks)
    _wait_kv_free(engine)
    samples = metric_samples(asyncio.run(scrape(app)))
    model = ("model_name", "tiny")
    assert samples[("pdengine_requests_finished_total", (("finished_reason", "abort"), model))] == 1
    assert samples[("pdengine_requests_finished_total", (("finished_reason", "length"), model))] == 0
    assert samples[("pdengine_generation_tokens_total", (model,))] < 1000


def test_speculative_engine_is_token_exact_and_reports_acceptance_per_chunk(sse_messages, metric_samples):
    client = InProcessClient(EngineConfig(preset="tiny", speculative=True))
    app = build_app(client)
    prompt = "speculate: draft then verify"

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
            r = await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True,
                "return_token_ids": True})
            return r, (await http.get("/metrics")).text

    try:
        r, text = asyncio.run(go())
    finally:
        asyncio.run(client.close())
    chunks = [m for m in sse_messages(r.text) if m != "[DONE]"]
    token_chunks = [c["choices"][0]["token_ids"] for c in chunks if c["choices"][0]["token_ids"]]
    assert [i for ids in token_chunks for i in ids] == greedy_reference("tiny", TOK.encode(prompt), 40,
                                                                          ignore_eos=True)
    s = metric_samples(text)
    model = (("model_name", "tiny"),)
    drafted = s[("pdengine_spec_decode_draft_tokens_total", model)]
    accepted = s[("pdengine_spec_decode_accepted_tokens_total", model)]
    assert s[("pdengine_spec_decode_enabled", model)] == 1
    assert drafted > 0 and 0 <= accepted <= drafted
    assert s[("pdengine_spec_decode_acceptance_rate", model)] == pytest.approx(accepted / drafted)
    # ITL is observed per token-bearing chunk, however many tokens the chunk holds
    assert s[("pdengine_inter_token_latency_seconds_count", model)] == len(token_chunks) - 1
    assert s[("pdengine_generation_tokens_total", model)] == 40


def test_extra_routers_and_registry_share_the_error_shape_and_the_scrape(engine, metric_samples):
    from fastapi import APIRouter
    from prometheus_client import CollectorRegistry, Counter

    from harness.errors import InvalidRequestError

    admin = APIRouter(prefix="/admin")

    @admin.get("/level")
    async def level(n: int) -> dict:
        return {"level": n}

    @admin.post("/busy")
    async def busy() -> dict:
        exc = InvalidRequestError("admission queue is full; retry later", code="overloaded", status=429)
        exc.retry_after = 2
        raise exc

    @admin.post("/bug")
    async def bug() -> dict:
        raise RuntimeError("secret internal detail")

    registry = CollectorRegistry()
    Counter("pdengine_router_test_marker", "a collector the router adds", registry=registry).inc(3)
    app = build_app(engine, registry=registry, extra_routers=[admin])

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return [await http.get("/admin/level", params={"n": 2}),
                    await http.get("/admin/level", params={"n": "x"}),
                    await http.post("/admin/busy"), await http.post("/admin/bug"), await http.get("/metrics")]

    ok, bad, busy_r, bug_r, metrics = asyncio.run(go())
    assert ok.json() == {"level": 2}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.n"
    assert busy_r.status_code == 429 and busy_r.headers["retry-after"] == "2"
    assert busy_r.json()["error"] == {"message": "admission queue is full; retry later",
                                      "type": "rate_limit_error", "param": None, "code": "overloaded"}
    assert bug_r.status_code == 500 and bug_r.json()["error"]["code"] == "internal_error"
    assert "secret" not in bug_r.text and "Traceback" not in bug_r.text
    s = metric_samples(metrics.text)
    assert s[("pdengine_router_test_marker_total", ())] == 3
    assert s[("pdengine_http_errors_total", (("code", "overloaded"), ("status", "429")))] == 1


def test_streamed_ttft_is_stamped_when_the_first_chunk_is_written_not_when_the_engine_made_it(engine, metric_samples):
    """A socket that takes 1.5 s to accept the first chunk (Nagle, a full buffer, a busy loop):
    the client saw its first token 1.5 s late, so the engine's TTFT must say so too; a request
    that is not streamed keeps the engine's time (its body is written at the end)."""
    app = build_app(engine)
    hold_s = 1.5
    raw = json.dumps({"prompt": "hello there", "max_tokens": 3, "stream": True, "ignore_eos": True}).encode()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)

    first_body = True

    async def slow_first_chunk(message):
        nonlocal first_body
        if message["type"] == "http.response.body" and message.get("body") and first_body:
            first_body = False
            await asyncio.sleep(hold_s)

    async def go():
        await app(_post_scope("/v1/completions", raw), receive, slow_first_chunk)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return (await http.get("/metrics")).text

    s = metric_samples(asyncio.run(go()))
    model = (("model_name", "tiny"),)
    assert s[("pdengine_time_to_first_token_seconds_count", model)] == 1
    assert s[("pdengine_time_to_first_token_seconds_sum", model)] >= hold_s
    # TPOT is the engine's: measured from the first token's own time, not from the late write
    assert s[("pdengine_request_time_per_output_token_seconds_count", model)] == 1
