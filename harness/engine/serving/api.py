"""OpenAI-compatible HTTP API over any ``EngineClient``: the single-process server and the
PD router serve the same protocol through ``build_app``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Reference: docs/api.md.

Every error, including ones raised by routes other modules add, is answered in OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``; a traceback never reaches a
client. A streaming request is held until its first engine event, so that a request the
engine refuses (admission control, bad input) still gets a proper HTTP status; after that,
an engine failure becomes an SSE ``error`` payload followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from harness.engine.serving.metrics import RequestTracker, ServingMetrics, engine_alive
from harness.engine.core.types import EngineClient, FinishReason, GenerateRequest, SamplingParams, TokenEvent
from harness.errors import EngineError, HarnessError, InvalidRequestError, WorkerDeadError

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

_T = TypeVar("_T")


# ---- request bodies -----------------------------------------------------------------------
# Strict: "5" is not an integer and 1 is not a boolean. Unknown fields are ignored, as
# OpenAI-compatible servers do. Fields OpenAI accepts but this engine cannot honour are
# declared so that they can be refused by name (see _refuse_unsupported).

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _CommonBody(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: Any = None  # str | list[str], checked by _stop() for a clearer message than a union's
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # extensions (vLLM-style)
    ignore_eos: bool = False
    priority: int = 0
    return_token_ids: bool = False


class CompletionBody(_CommonBody):
    prompt: Any = None  # str | list[int] | [str] | [list[int]], checked by _completion_prompt()
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class ChatBody(_CommonBody):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


def _refuse_unsupported(body: _CommonBody) -> None:
    def refuse(param: str, what: str) -> None:
        raise InvalidRequestError(f"'{param}' is not supported by this server: {what}", param=param,
                                  code="unsupported_parameter")

    if body.n != 1:
        refuse("n", f"only n=1 is supported, got n={body.n}; send separate requests instead")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true",
                                  param="stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            refuse(name, "penalties are not implemented; omit it or send 0")
    if body.logit_bias:
        refuse("logit_bias", "omit it")
    if isinstance(body, CompletionBody):
        if body.echo:
            refuse("echo", "omit it or send false")
        if body.suffix:
            refuse("suffix", "omit it")
        if body.best_of not in (None, 1):
            refuse("best_of", "omit it or send 1")
        if body.logprobs:
            refuse("logprobs", "omit it")
    if isinstance(body, ChatBody):
        if body.logprobs or body.top_logprobs:
            refuse("logprobs", "omit logprobs and top_logprobs")
        if body.tools:
            refuse("tools", "tool calling is not implemented")
        if body.response_format and body.response_format.get("type", "text") != "text":
            refuse("response_format", "only {'type': 'text'} is supported")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidRequestError(f"'stop' must be a string or a list of strings, got {value!r}", param="stop")


def _completion_prompt(value: Any, client: EngineClient) -> list[int]:
    tokenizer = client.tokenizer()
    # One prompt only: OpenAI's batch form (a list of several prompts) needs n-way choices.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("'prompt' is empty", param="prompt")
        return tokenizer.encode(value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in value):
        tokenizer.validate(value, "prompt")
        return list(value)
    if value is None:
        raise InvalidRequestError("'prompt' is required", param="prompt")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise InvalidRequestError("batched prompts are not supported: send one prompt per request",
                                  param="prompt", code="unsupported_parameter")
    raise InvalidRequestError("'prompt' must be a non-empty string or a non-empty list of token ids",
                              param="prompt")


def _chat_prompt(messages: list[dict[str, Any]], client: EngineClient) -> list[int]:
    if not messages:
        raise InvalidRequestError("'messages' must hold at least one message", param="messages")
    flat = []
    for n, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts are understood
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequestError(f"messages[{n}].content holds a part that is not "
                                              "{'type': 'text', 'text': str}", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        flat.append({"role": message.get("role"), "content": content})
    tokenizer = client.tokenizer()
    return tokenizer.encode(tokenizer.apply_chat_template(flat))


def _parse(body_type: type[_T], raw: bytes) -> _T:
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None


def _validation_error(errors: Sequence[dict]) -> InvalidRequestError:
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequestError(f"request body is not valid JSON: {first['msg']}",
                                   code="invalid_json")
    loc = [part for part in first["loc"] if part != "body"]
    if not loc:
        return InvalidRequestError("request body must be a JSON object")
    param = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    got = f", got {first['input']!r}" if first["type"] != "missing" and "input" in first else ""
    return InvalidRequestError(f"invalid '{param}': {first['msg']}{got}", param=param)


@dataclass
class _Call:
    """One parsed request: what the engine gets and how the answer is shaped."""

    chat: bool
    request: GenerateRequest
    model: str
    created: int
    include_usage: bool
    return_token_ids: bool
    stream: bool


def _to_call(body: _CommonBody, client: EngineClient) -> _Call:
    if body.model is not None and body.model != client.model_name:
        raise InvalidRequestError(f"model {body.model!r} does not exist; this server serves "
                                  f"{client.model_name!r} (GET /v1/models)", param="model",
                                  code="model_not_found", status=404)
    _refuse_unsupported(body)
    chat = isinstance(body, ChatBody)
    if chat:
        prompt = _chat_prompt(body.messages, client)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    else:
        prompt = _completion_prompt(body.prompt, client)
        max_tokens, max_param = body.max_tokens, "max_tokens"
    limit = client.max_model_len
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"'{max_param}' must be at least 1, got {max_tokens}", param=max_param)
    if len(prompt) >= limit:
        raise InvalidRequestError(f"the prompt has {len(prompt)} tokens but this model's context is {limit} "
                                  "tokens, which must also hold at least one output token; shorten the prompt",
                                  param="messages" if chat else "prompt", code="context_length_exceeded")
    if max_tokens is None:  # as vLLM does: whatever room the context leaves
        max_tokens = limit - len(prompt)
    elif len(prompt) + max_tokens > limit:
        raise InvalidRequestError(f"this model's context is {limit} tokens, but {len(prompt)} prompt tokens + "
                                  f"{max_tokens} {max_param} = {len(prompt) + max_tokens}; reduce "
                                  f"'{max_param}' or the prompt", param=max_param, code="context_length_exceeded")
    params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            seed=body.seed, stop=_stop(body.stop), ignore_eos=body.ignore_eos,
                            priority=body.priority)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    request = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                              arrival_time=time.monotonic())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _Call(chat=chat, request=request, model=client.model_name, created=int(time.time()),
                 include_usage=include_usage, return_token_ids=body.return_token_ids, stream=body.stream)


# ---- the engine stream of one request -----------------------------------------------------

class _Generation:
    """Pulls one request's events from the engine, feeds its metrics tracker and collects
    its output; ``aclose`` aborts it in the engine unless it already finished."""

    def __init__(self, client: EngineClient, call: _Call, tracker: RequestTracker) -> None:
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


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await ``work`` unless the client disconnects first (then cancel it, raise _ClientGone)."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


# ---- response shapes ----------------------------------------------------------------------

def _finish_reason(event: TokenEvent) -> str | None:
    return (event.finish_reason or FinishReason.STOP).value if event.finished else None


def _usage(call: _Call, gen: _Generation) -> dict[str, int]:
    final = gen.final
    prompt = (final.num_prompt_tokens if final else 0) or len(call.request.prompt_token_ids)
    completion = (final.num_output_tokens if final else 0) or len(gen.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _envelope(call: _Call, obj: str, choices: list, served_by: str | None) -> dict[str, Any]:
    return {"id": call.request.request_id, "object": obj, "created": call.created, "model": call.model,
            "choices": choices, "served_by": served_by}


def _chunk(call: _Call, event: TokenEvent, first: bool) -> dict[str, Any]:
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


def _full_response(call: _Call, gen: _Generation) -> dict[str, Any]:
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


async def _stream_events(call: _Call, gen: _Generation, first: TokenEvent) -> AsyncIterator[str]:
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


async def _generate(request: Request, body_type: type[_CommonBody]) -> Response:
    state = request.app.state
    client: EngineClient = state.client
    try:
        call = _to_call(_parse(body_type, await _read_body(request, state.max_body_bytes)), client)
        tracker = state.metrics.track(call.request.arrival_time, ttft_on_write=call.stream)
        gen = _Generation(client, call, tracker)
    except Exception as exc:
        return _exception_response(request, exc)
    handed_over = False
    try:
        if call.stream:
            first = await _unless_disconnected(request, gen.next())
            if first.finished and first.finish_reason == FinishReason.ERROR:
                return _error_response(request, 500, _event_error(first), code="engine_error")
            handed_over = True
            return _SSEResponse(_stream_events(call, gen, first), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                on_first_body=tracker.first_write)
        final = await _unless_disconnected(request, gen.collect())
        if final.finish_reason == FinishReason.ERROR:
            return _error_response(request, 500, _event_error(final), code="engine_error")
        return JSONResponse(_full_response(call, gen))
    except _ClientGone:
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
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _exception_response(request, _validation_error(exc.errors()))

    @app.exception_handler(HarnessError)
    async def harness_error(request: Request, exc: HarnessError) -> Response:
        return _exception_response(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        return _exception_response(request, exc)

    return app
