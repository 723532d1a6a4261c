"""OpenAI-compatible HTTP API over any ``EngineClient``: the single-process server and the
PD router serve the same protocol through ``build_app``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Reference: docs/api.md.

Every error, including ones raised by routes other modules add, is answered in OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``; a traceback never reaches a
client. A streaming request is held until its first engine event, so that a request the
engine refuses (admission control, bad input) still gets a proper HTTP status; after that,
an engine failure becomes an SSE ``error`` payload followed by ``[DONE]``. Request bodies, their
validation and their translation into a ``GenerateRequest``: openai_requests.py; the engine stream of
one request and the client-disconnect watch: generation.py.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from harness.engine.serving.generation import ClientGone, Generation, unless_disconnected
from harness.engine.serving.metrics import ServingMetrics, engine_alive
from harness.engine.core.types import EngineClient, FinishReason, TokenEvent
from harness.engine.serving.openai_requests import (Call, ChatBody, CommonBody, CompletionBody, parse_body, to_call,
                                                    validation_error)
from harness.errors import HarnessError, InvalidRequestError, WorkerDeadError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

# ---- response shapes ----------------------------------------------------------------------

def _finish_reason(event: TokenEvent) -> str | None:
    return (event.finish_reason or FinishReason.STOP).value if event.finished else None


def _usage(call: Call, gen: Generation) -> dict[str, int]:
    final = gen.final
    prompt = (final.num_prompt_tokens if final else 0) or len(call.request.prompt_token_ids)
    completion = (final.num_output_tokens if final else 0) or len(gen.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _envelope(call: Call, obj: str, choices: list, served_by: str | None) -> dict[str, Any]:
    return {"id": call.request.request_id, "object": obj, "created": call.created, "model": call.model,
            "choices": choices, "served_by": served_by}


def _chunk(call: Call, event: TokenEvent, first: bool) -> dict[str, Any]:
    if call.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if event.text or first:
            delta["content"] = event.text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": event.text}
    choice.update(logprobs=None, finish_reason=_finish_reason(event))
    if call.return_token_ids:
        choice["token_ids"] = list(event.token_ids)
    chunk = _envelope(call, "chat.completion.chunk" if call.chat else "text_completion", [choice],
                      event.worker)
    if event.degraded:
        chunk["degraded"] = event.degraded
    if call.include_usage:
        chunk["usage"] = None
    return chunk


def _full_response(call: Call, gen: Generation) -> dict[str, Any]:
    text = "".join(gen.text)
    choice: dict[str, Any] = {"index": 0}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=_finish_reason(gen.final))
    if call.return_token_ids:
        choice["token_ids"] = gen.token_ids
    body = _envelope(call, "chat.completion" if call.chat else "text_completion", [choice],
                     gen.workers[-1] if gen.workers else None)
    body["served_by_all"] = gen.workers  # a PD request may move between workers (resume, migration)
    if gen.final is not None and gen.final.degraded:
        body["degraded"] = gen.final.degraded  # the service was degraded for this request (Level 4)
    body["usage"] = _usage(call, gen)
    return body


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_ERROR_TYPES = {499: "invalid_request_error", 400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def _error_response(request: Request, status: int, message: str, param: str | None = None,
                    code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    metrics: ServingMetrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.count_error(status, code)
    type_ = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(_error_body(message, type_, param, code), status_code=status, headers=headers)


CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads this answer


def _exception_response(request: Request, exc: BaseException) -> JSONResponse:
    """The one place where an exception becomes an HTTP answer."""
    if isinstance(exc, ClientDisconnect):  # the client went away mid-upload: not a server error
        logger.info("client disconnected while sending %s %s", request.method, request.url.path)
        return _error_response(request, CLIENT_CLOSED, "the client disconnected before its request was read",
                               code="client_disconnected")
    if isinstance(exc, InvalidRequestError):
        retry_after = getattr(exc, "retry_after", None)  # admission control (429) may set it
        headers = {"Retry-After": str(int(retry_after))} if retry_after is not None else None
        return _error_response(request, exc.status, str(exc), exc.param, exc.code, headers)
    if isinstance(exc, WorkerDeadError):
        return _error_response(request, 503, f"no worker could serve the request: {exc}",
                               code="worker_unavailable")
    if isinstance(exc, HarnessError):
        return _error_response(request, 500, f"engine error: {exc}", code="engine_error")
    logger.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(request, 500, f"internal server error ({type(exc).__name__}); see the server log",
                           code="internal_error")


def _event_error(event: TokenEvent) -> str:
    return event.error or "the engine could not finish the request"


# ---- routes -------------------------------------------------------------------------------

async def _read_body(request: Request, limit: int) -> bytes:
    too_big = InvalidRequestError(f"request body is larger than {limit} bytes; send a shorter prompt",
                                  code="request_too_large", status=413)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


class _SSEResponse(StreamingResponse):
    """Closes the event stream on every exit, including a client that went away while a
    chunk was being sent (Starlette would leave the generator to the garbage collector).
    ``on_first_body`` runs after each chunk of the body was handed to the server's transport
    until it returns True (the engine's TTFT is stamped at the first token's chunk there, which is
    when the client can start to see it)."""

    def __init__(self, *args: Any, on_first_body: Callable[[], bool] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_first_body = on_first_body

    async def __call__(self, scope, receive, send) -> None:
        pending = self._on_first_body

        async def send_stamped(message: dict) -> None:
            nonlocal pending
            await send(message)
            if pending is not None and message["type"] == "http.response.body" and message.get("body"):
                if pending():  # True once the chunk carried the first token
                    pending = None

        try:
            await super().__call__(scope, receive, send_stamped)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _stream_events(call: Call, gen: Generation, first: TokenEvent) -> AsyncIterator[str]:
    event, is_first = first, True
    try:
        while True:
            if event.finished and event.finish_reason == FinishReason.ERROR:
                yield _sse(_error_body(_event_error(event), "server_error", code="engine_error"))
                break
            if event.token_ids or event.text or event.finished:
                yield _sse(_chunk(call, event, is_first))
                is_first = False
            if event.finished:
                if call.include_usage:
                    usage = _envelope(call, "chat.completion.chunk" if call.chat else "text_completion",
                                      [], gen.workers[-1] if gen.workers else None)
                    usage["usage"] = _usage(call, gen)
                    yield _sse(usage)
                break
            event = await gen.next()
    except Exception as exc:  # mid-stream: the status line is sent, so the error goes in-band
        logger.warning("request %s failed mid-stream: %s", call.request.request_id, exc,
                       exc_info=not isinstance(exc, HarnessError))
        message = str(exc) if isinstance(exc, HarnessError) else f"internal error ({type(exc).__name__})"
        yield _sse(_error_body(message, "server_error", code="engine_error"))
    finally:
        await gen.aclose()
    yield _sse("[DONE]")


async def _generate(request: Request, body_type: type[CommonBody]) -> Response:
    state = request.app.state
    client: EngineClient = state.client
    try:
        call = to_call(parse_body(body_type, await _read_body(request, state.max_body_bytes)), client)
        tracker = state.metrics.track(call.request.arrival_time, ttft_on_write=call.stream)
        gen = Generation(client, call, tracker)
    except Exception as exc:
        return _exception_response(request, exc)
    handed_over = False
    try:
        if call.stream:
            first = await unless_disconnected(request, gen.next())
            if first.finished and first.finish_reason == FinishReason.ERROR:
                return _error_response(request, 500, _event_error(first), code="engine_error")
            handed_over = True
            return _SSEResponse(_stream_events(call, gen, first), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                on_first_body=tracker.first_write)
        final = await unless_disconnected(request, gen.collect())
        if final.finish_reason == FinishReason.ERROR:
            return _error_response(request, 500, _event_error(final), code="engine_error")
        return JSONResponse(_full_response(call, gen))
    except ClientGone:
        logger.info("client went away; request %s aborted", call.request.request_id)
        return Response(status_code=499)  # nobody reads it; the status shows in access logs
    except Exception as exc:
        return _exception_response(request, exc)
    finally:
        if not handed_over:
            await gen.aclose()


router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _generate(request, CompletionBody)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _generate(request, ChatBody)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    client: EngineClient = request.app.state.client
    return {"object": "list", "data": [{"id": client.model_name, "object": "model",
                                        "created": request.app.state.created, "owned_by": "harness",
                                        "max_model_len": client.max_model_len}]}


@router.get("/health")
async def health(request: Request) -> Response:
    client: EngineClient = request.app.state.client
    try:
        stats = client.stats()
    except Exception as exc:
        return _error_response(request, 503, f"engine is not alive: {exc}", code="engine_dead")
    if not engine_alive(client):
        return _error_response(request, 503, "engine is not alive (it died or was closed)", code="engine_dead")
    return JSONResponse({"status": "ok", "running": stats.num_running, "waiting": stats.num_waiting})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(client: EngineClient, *, registry: CollectorRegistry | None = None,
              extra_routers: Sequence[APIRouter] = (),
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible app over ``client``.

    ``registry`` receives this app's metrics (a fresh one when None; pass one to add your own
    collectors). ``extra_routers`` are mounted as they are (the PD router's admin API); their
    errors are answered in the same OpenAI error shape. ``app.state`` holds ``client``,
    ``metrics`` (ServingMetrics) and ``registry`` for them.
    """
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise InvalidRequestError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    app = FastAPI(title="harness reference engine", summary="OpenAI-compatible API", docs_url=None,
                  redoc_url=None)
    app.state.client = client
    app.state.registry = registry if registry is not None else CollectorRegistry()
    app.state.metrics = ServingMetrics(client, app.state.registry)
    app.state.max_body_bytes = max_body_bytes
    app.state.created = int(time.time())
    app.include_router(router)
    for extra in extra_routers:
        app.include_router(extra)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(request, exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                               code=code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _exception_response(request, validation_error(exc.errors()))

    @app.exception_handler(HarnessError)
    async def harness_error(request: Request, exc: HarnessError) -> Response:
        return _exception_response(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return _exception_response(request, exc)

    return app
