"""Shared fixtures of the engine tests."""

from __future__ import annotations

from typing import Callable

import pytest

from harness.engine.core.engine_core import EngineCore


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
