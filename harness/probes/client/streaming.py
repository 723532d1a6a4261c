"""A streaming OpenAI-compatible client that turns one completion into one RequestRecord.

Each network read is timestamped with ``perf_counter_ns`` as it arrives and fed to the SSE parser
(harness/probes/client/sse.py: a message gets the arrival time of the read that brought its first byte,
as AIPerf does, so a message split over two reads is not dated late). The same parser serves the
sync client (used by the Locust user and by suites that send single probe requests) and the async one.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from harness.errors import ProbeError
from harness.probes.client.records import RequestRecord, process_anchor
from harness.probes.client.shapes import DEFAULT_SHAPE, RequestShape
from harness.probes.client.sse import MessageHook, RecordBuilder
from harness.urls import http_url

log = logging.getLogger(__name__)

RecordSink = Callable[[RequestRecord], None]


@dataclass(frozen=True)
class CompletionRequest:
    """What to send. Greedy by default, so the reference engine's output has an oracle."""

    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    priority: int | None = None
    chat: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # merged into the body last

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ProbeError("prompt must be a non-empty string", fix="pass the prompt text")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ProbeError(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                             fix="ask for at least one token")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str, shape: RequestShape = DEFAULT_SHAPE) -> dict[str, Any]:
        """The request body, with only the extensions ``shape`` (the server's engine) accepts: a request
        asking for ``ignore_eos`` or a ``priority`` the server does not take is sent without them."""
        stream_options: dict[str, Any] = {"include_usage": True}
        if shape.continuous_usage:  # usage in every chunk: tokens counted without text (RecordBuilder)
            stream_options["continuous_usage_stats"] = True
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": stream_options,
            **shape.extensions(ignore_eos=self.ignore_eos, priority=self.priority),
        }
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        body.update(self.extra)
        return body


def _http_error(record: RequestRecord, status: int, body: bytes, headers: httpx.Headers) -> None:
    record.http_status = status
    try:
        data = json.loads(body)
        # OpenAI's {"error": {...}}; NVIDIA Dynamo's frontend sends the fields at the top level
        err = data["error"] if "error" in data else data if "message" in data else data["error"]
        cls, msg = str(err.get("type") or err.get("code") or f"HTTP{status}"), str(err.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        cls, msg = f"HTTP{status}", body[:300].decode("utf-8", "replace")
    if "retry-after" in headers:
        msg += f" (Retry-After: {headers['retry-after']})"
    record.status, record.error_class, record.error_message = "http_error", cls, msg


def _classify(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", type(exc).__name__
    if isinstance(exc, httpx.TransportError):
        return "connection_error", type(exc).__name__
    return "stream_error", type(exc).__name__


class _Exchange:
    """The bookkeeping of one request, shared by the sync and async clients (only their
    I/O loops differ). Used as a context manager: whatever way the block ends, the record
    is finished and emitted exactly once; transport errors become the record's status,
    cancellation (GreenletExit, CancelledError, KeyboardInterrupt) is recorded and re-raised."""

    def __init__(self, client: _ClientBase, request: CompletionRequest, request_id: str | None,
                 scheduled_ns: int | None, on_message: MessageHook | None = None) -> None:
        anchor = process_anchor()
        now = time.perf_counter_ns()
        self.client = client
        self.record = RequestRecord(
            request_id=request_id or uuid.uuid4().hex, user=client.user,
            scheduled_ns=scheduled_ns if scheduled_ns is not None else now, sent_ns=now,
            prompt=request.prompt, max_tokens=request.max_tokens,
            anchor_wall_ns=anchor.wall_ns, anchor_mono_ns=anchor.mono_ns, anchor_perf_ns=anchor.perf_ns)
        self.builder = RecordBuilder(self.record, on_message)
        self.deadline_ns = now + int(client.timeout_s * 1e9)
        self._scheduled = scheduled_ns is not None
        self._ended = False

    def begin(self) -> None:
        self.record.sent_ns = time.perf_counter_ns()
        if not self._scheduled:  # not open loop: the request was due when it was sent
            self.record.scheduled_ns = self.record.sent_ns

    def http_error(self, resp: httpx.Response, body: bytes) -> None:
        _http_error(self.record, resp.status_code, body, resp.headers)

    def chunk(self, data: bytes) -> bool:
        """Feed one read; False when the total deadline has passed and reading must stop."""
        t = time.perf_counter_ns()
        self.builder.feed(data, t)
        if t > self.deadline_ns:
            self.builder.fail("timeout", "DeadlineExceeded", f"no end of stream within {self.client.timeout_s} s")
            return False
        return True

    def __enter__(self) -> _Exchange:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, httpx.HTTPError):
            self.builder.fail(*_classify(exc), str(exc) or repr(exc))
        elif isinstance(exc, ProbeError):  # the model list could not be read
            self.builder.fail("http_error", "ModelListError", str(exc))
        elif exc is not None:
            self.builder.fail("cancelled", type(exc).__name__, "the client stopped waiting for this request")
        if not self._ended:
            self._ended = True
            self.builder.finish(time.perf_counter_ns())
            if self.client.on_record is not None:
                self.client.on_record(self.record)
        return isinstance(exc, (httpx.HTTPError, ProbeError))  # recorded; anything else propagates


class _ClientBase:
    def __init__(self, base_url: str, *, model: str | None, timeout_s: float, read_timeout_s: float,
                 user: str, on_record: RecordSink | None, api_key: str | None = None,
                 request_shape: RequestShape = DEFAULT_SHAPE) -> None:
        if timeout_s <= 0 or read_timeout_s <= 0:
            raise ProbeError("timeouts must be positive", fix="pass timeout_s > 0 and read_timeout_s > 0")
        self.base_url = http_url(base_url, "API URL")
        self.model = model
        self.timeout_s = timeout_s
        self.user = user
        self.on_record = on_record
        self.request_shape = request_shape  # the extensions the server's engine accepts
        self._timeout = httpx.Timeout(read_timeout_s, connect=min(10.0, read_timeout_s))
        # plain http never uses TLS: skip loading the CA bundle (~50 ms per client, which
        # would stall a Locust process spawning many users)
        self._verify = not self.base_url.startswith("http://")
        # the cluster file's auth: sent on every request, never recorded
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _model_from(self, resp: httpx.Response) -> str:
        if resp.status_code != 200:
            raise ProbeError(f"cannot list models at {self.base_url}/v1/models: HTTP {resp.status_code}",
                             fix="check the server is up, or pass model= explicitly")
        data = resp.json().get("data") or []
        if not data:
            raise ProbeError("the server's /v1/models lists no model", fix="pass model= explicitly")
        return str(data[0]["id"])


class StreamingClient(_ClientBase):
    """Sync client: ``send()`` returns the record of one streamed completion; it never
    raises for a failed request (the failure is in the record), except cancellation
    (GreenletExit, KeyboardInterrupt), which is recorded as ``cancelled`` and re-raised."""

    def __init__(self, base_url: str, *, model: str | None = None, timeout_s: float = 120.0,
                 read_timeout_s: float = 30.0, user: str = "", on_record: RecordSink | None = None,
                 api_key: str | None = None, request_shape: RequestShape = DEFAULT_SHAPE) -> None:
        super().__init__(base_url, model=model, timeout_s=timeout_s, read_timeout_s=read_timeout_s,
                         user=user, on_record=on_record, api_key=api_key, request_shape=request_shape)
        self._http = httpx.Client(base_url=self.base_url, timeout=self._timeout, verify=self._verify,
                                  headers=self._headers)

    def resolve_model(self) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self.model is None:
            try:
                self.model = self._model_from(self._http.get("/v1/models"))
            except httpx.HTTPError as exc:
                raise ProbeError(f"cannot list models at {self.base_url}/v1/models: {exc}",
                                 fix="check the server is up, or pass model= explicitly") from exc
        return self.model

    def send(self, request: CompletionRequest, *, request_id: str | None = None,
             scheduled_ns: int | None = None, on_message: MessageHook | None = None) -> RequestRecord:
        with _Exchange(self, request, request_id, scheduled_ns, on_message) as ex:
            if self.model is None:  # a fault may have taken the server down: record, don't raise
                self.model = self._model_from(self._http.get("/v1/models"))
            body = request.body(self.model, self.request_shape)
            ex.begin()
            with self._http.stream("POST", request.path, json=body) as resp:
                if resp.status_code >= 400:
                    ex.http_error(resp, resp.read())
                else:
                    ex.record.http_status = resp.status_code
                    for data in resp.iter_raw():
                        if not ex.chunk(data):
                            break
        return ex.record

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StreamingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStreamingClient(_ClientBase):
    """Async twin of StreamingClient, for suites that keep many probe requests in flight."""

    def __init__(self, base_url: str, *, model: str | None = None, timeout_s: float = 120.0,
                 read_timeout_s: float = 30.0, user: str = "", on_record: RecordSink | None = None,
                 api_key: str | None = None, request_shape: RequestShape = DEFAULT_SHAPE) -> None:
        super().__init__(base_url, model=model, timeout_s=timeout_s, read_timeout_s=read_timeout_s,
                         user=user, on_record=on_record, api_key=api_key, request_shape=request_shape)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout, verify=self._verify,
                                       headers=self._headers)

    async def resolve_model(self) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self.model is None:
            try:
                self.model = self._model_from(await self._http.get("/v1/models"))
            except httpx.HTTPError as exc:
                raise ProbeError(f"cannot list models at {self.base_url}/v1/models: {exc}",
                                 fix="check the server is up, or pass model= explicitly") from exc
        return self.model

    async def send(self, request: CompletionRequest, *, request_id: str | None = None,
                   scheduled_ns: int | None = None, on_message: MessageHook | None = None) -> RequestRecord:
        with _Exchange(self, request, request_id, scheduled_ns, on_message) as ex:
            if self.model is None:  # a fault may have taken the server down: record, don't raise
                self.model = self._model_from(await self._http.get("/v1/models"))
            body = request.body(self.model, self.request_shape)
            ex.begin()
            async with self._http.stream("POST", request.path, json=body) as resp:
                if resp.status_code >= 400:
                    ex.http_error(resp, await resp.aread())
                else:
                    ex.record.http_status = resp.status_code
                    async for data in resp.aiter_raw():
                        if not ex.chunk(data):
                            break
        return ex.record

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncStreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
