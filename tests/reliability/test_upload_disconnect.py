"""A client that disconnects in the middle of uploading its request body is not a server error: the
API answers 499 (nobody reads it), logs no error and counts no 500."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.engine.serving.api import build_app
from harness.engine.core.client import InProcessClient
from harness.engine.core.config import EngineConfig


@pytest.fixture(scope="module")
def engine():
    client = InProcessClient(EngineConfig(preset="tiny"))
    yield client
    asyncio.run(client.close())


async def _half_upload(app, path: str) -> list[dict]:
    """Declare a 400-byte JSON body, send 40 bytes of it, then disconnect."""
    parts = [{"type": "http.request", "body": b'{"prompt": "half an upload", "max_tok', "more_body": True},
             {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive():
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"400")],
             "client": ("127.0.0.1", 40001), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


def _errors_by_status(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdengine_http_errors_total":
                out[s.labels["status"]] = out.get(s.labels["status"], 0) + s.value
    return out


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_disconnect_mid_upload_is_not_a_500(engine, path, caplog):
    app = build_app(engine)
    with caplog.at_level(logging.INFO, logger="harness.engine.serving.api"):
        sent = asyncio.run(_half_upload(app, path))
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert starts and starts[0]["status"] == 499, sent

    async def scrape() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
            return (await http.get("/metrics")).text

    errors = _errors_by_status(asyncio.run(scrape()))
    assert errors.get("500", 0) == 0 and errors.get("499") == 1, errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert any("disconnected" in r.getMessage() for r in caplog.records)
