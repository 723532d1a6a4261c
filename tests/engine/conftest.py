"""Shared fixtures of the engine tests."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.engine.core.client import InProcessClient
from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.serving.api import build_app


def _drive(core: EngineCore, on_step: Callable[[EngineCore], None] | None = None) -> dict[str, list[int]]:
    """Step until idle, asserting no error event; tokens per request. ``on_step(core)`` runs after each step."""
    out: dict[str, list[int]] = {}
    while core.has_work():
        for ev in core.step():
            assert ev.error is None, ev.error
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        if on_step:
            on_step(core)
    return out


@pytest.fixture
def drive() -> Callable[..., dict[str, list[int]]]:
    return _drive


# -- the OpenAI-compatible app in process (test_api.py, test_api_lifecycle.py)

@pytest.fixture(scope="module")
def engine():
    """The real tiny engine in a thread, shared by a module's API tests."""
    client = InProcessClient(EngineConfig(preset="tiny"))
    yield client
    asyncio.run(client.close())


def _call(engine, fn):
    """Run ``fn(http)`` against a fresh app over ``engine``; returns (result, app)."""
    app = build_app(engine)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            return await fn(http)

    return asyncio.run(go()), app


def _sse_messages(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), f"stream must end with [DONE]: {text[-200:]!r}"
    out = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def _scrape(app) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as http:
        return (await http.get("/metrics")).text


@pytest.fixture
def call() -> Callable:
    return _call


@pytest.fixture
def sse_messages() -> Callable[[str], list]:
    return _sse_messages


@pytest.fixture
def metric_samples() -> Callable[[str], dict]:
    return _metric_samples


@pytest.fixture
def scrape() -> Callable:
    return _scrape
