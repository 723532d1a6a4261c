"""The engine stream of one HTTP request (``Generation``) and the watch that cancels engine work
when its client disconnects (``unless_disconnected``); api.py's routes use both."""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

import anyio
from fastapi import Request

from harness.engine.core.types import EngineClient, FinishReason, TokenEvent
from harness.engine.serving.metrics import RequestTracker
from harness.engine.serving.openai_requests import Call
from harness.errors import EngineError, InvalidRequestError

_T = TypeVar("_T")


class Generation:
    """Pulls one request's events from the engine, feeds its metrics tracker and collects
    its output; ``aclose`` aborts it in the engine unless it already finished."""

    def __init__(self, client: EngineClient, call: Call, tracker: RequestTracker) -> None:
        self._events = client.generate(call.request)
        self._iter = self._events.__aiter__()
        self._tracker = tracker
        self._closed = False
        self.final: TokenEvent | None = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.workers: list[str] = []

    async def next(self) -> TokenEvent:
        if self.final is not None:
            raise EngineError("internal: read past the final event")
        try:
            event = await self._iter.__anext__()
        except StopAsyncIteration:
            self._tracker.abort(FinishReason.ERROR)
            raise EngineError("the engine ended the stream without a final event") from None
        except InvalidRequestError:
            self._tracker.discard()
            raise
        except Exception:
            self._tracker.abort(FinishReason.ERROR)
            raise
        self._tracker.observe(event)
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        if event.worker and event.worker not in self.workers:
            self.workers.append(event.worker)
        if event.finished:
            self.final = event
        return event

    async def collect(self) -> TokenEvent:
        while self.final is None:
            await self.next()
        return self.final

    async def aclose(self) -> None:
        self._tracker.abort()
        if self._closed:
            return
        self._closed = True
        close = getattr(self._events, "aclose", None)
        if close is not None:
            # Shielded: this runs while the request's task is being cancelled (client gone).
            with anyio.CancelScope(shield=True):
                await close()


class ClientGone(Exception):
    """The client disconnected before the awaited engine work finished."""


async def unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work`` unless the client disconnects first (then cancel it, raise ClientGone)."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


__all__ = ["ClientGone", "Generation", "unless_disconnected"]
