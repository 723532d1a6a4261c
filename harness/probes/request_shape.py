"""Which request extensions an engine's OpenAI-compatible server accepts, so that nothing it rejects is sent.

The harness asks for more than the OpenAI API where a server allows it: each chunk's token ids
(``return_token_ids``), usage in every chunk (``stream_options.continuous_usage_stats``), a fixed output
length (``ignore_eos``), a scheduling ``priority``. Servers differ: NVIDIA Dynamo 1.6.1's frontend answers
HTTP 400 "Unsupported parameter(s): `return_token_ids`" (and `priority`) unless it was started with
``DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS=1``, which a user's cluster need not have. So the cluster file's
``engine:`` names a :class:`RequestShape` and the streaming client sends only what it allows.

When the harness attaches to a cluster, :func:`check_request_shape` sends one request of the full shape;
a 400 that an extension caused is a harness error naming the field and the engine's shape, raised before
any fault (the suites would otherwise record every request as failed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from harness.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestShape:
    """The extensions one engine's server accepts (each True: sent when a request asks for it)."""

    engine: str
    token_ids: bool = False         # return_token_ids: each chunk carries its tokens' ids
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    ignore_eos: bool = False        # generate max_tokens whatever the model samples
    priority: bool = False          # a scheduling priority per request

    def extensions(self, *, ignore_eos: bool, priority: int | None) -> dict[str, Any]:
        """The body fields beyond the OpenAI API for one request (stream_options handled by the caller)."""
        out: dict[str, Any] = {}
        if self.token_ids:
            out["return_token_ids"] = True
        if ignore_eos and self.ignore_eos:
            out["ignore_eos"] = True
        if priority is not None and self.priority:
            out["priority"] = priority
        return out


# measured on each engine's server (docs/dynamo.md, docs/api.md); "openai" is any other OpenAI-compatible
# server: what the harness always sent (most such servers ignore fields they do not know)
REQUEST_SHAPES: dict[str, RequestShape] = {
    "bundled": RequestShape("bundled", token_ids=True, ignore_eos=True, priority=True),
    "vllm": RequestShape("vllm", token_ids=True, continuous_usage=True, ignore_eos=True),
    "sglang": RequestShape("sglang", continuous_usage=True, ignore_eos=True),
    "dynamo": RequestShape("dynamo", continuous_usage=True, ignore_eos=True),
    "openai": RequestShape("openai", token_ids=True, ignore_eos=True),
}
DEFAULT_SHAPE = REQUEST_SHAPES["bundled"]


def request_shape(engine: str | None) -> RequestShape:
    """The shape of ``engine`` (a cluster file's ``engine:``; None: the bundled engine)."""
    try:
        return REQUEST_SHAPES[engine or "bundled"]
    except KeyError:
        raise ConfigError(f"engine {engine!r} has no request shape",
                          fix=f"use one of {', '.join(REQUEST_SHAPES)}") from None


def sent_extensions(body: dict[str, Any]) -> list[str]:
    """The fields beyond the OpenAI API that a request ``body`` carries."""
    sent = [k for k in ("return_token_ids", "ignore_eos", "priority") if k in body]
    if (body.get("stream_options") or {}).get("continuous_usage_stats"):
        sent.append("continuous_usage_stats")
    return sent


def unsupported_fields(body: dict[str, Any], message: str) -> list[str]:
    """The extension fields of ``body`` that a server's 400 ``message`` names."""
    return [k for k in sent_extensions(body) if k in message]


def unsupported_error(shape: RequestShape, fields: list[str], url: str, message: str) -> ConfigError:
    """The harness error for a server that rejects ``fields`` of ``shape``."""
    return ConfigError(f"{url} rejects request field(s) {', '.join(fields)} that the {shape.engine!r} request "
                       f"shape sends (HTTP 400: {message[:300]})",
                       fix=f"set the cluster file's engine: to the engine the server runs (request shapes: "
                           f"{', '.join(REQUEST_SHAPES)}; harness/probes/request_shape.py), or let the server "
                           f"accept {', '.join(fields)}")


def check_request_shape(api_url: str, shape: RequestShape, *, model: str | None = None,
                        api_key: str | None = None, timeout_s: float = 60.0) -> None:
    """Send one streamed completion with every extension of ``shape``; raise :func:`unsupported_error` when
    the server answers 400 because of one of them (named in its message, or the same request without
    extensions succeeds). Any other outcome is left to the suites: a server that is down or overloaded is
    what they measure."""
    from harness.probes.streaming import CompletionRequest, StreamingClient

    request = CompletionRequest(prompt="Which request fields does this server accept?", max_tokens=2,
                                ignore_eos=True, priority=0)
    with StreamingClient(api_url, model=model, api_key=api_key, timeout_s=timeout_s, request_shape=shape) as client:
        try:
            client.resolve_model()
        except Exception as exc:  # noqa: BLE001  (no model list: the suites will say so)
            log.warning("request shape not checked: %s", exc)
            return
        rec = client.send(request, request_id="request-shape")
        if rec.http_status != 400:
            return
        body = request.body(client.model or "", shape)
        fields = unsupported_fields(body, rec.error_message or "")
        if not fields:
            with StreamingClient(api_url, model=client.model, api_key=api_key, timeout_s=timeout_s,
                                 request_shape=RequestShape(shape.engine)) as plain_client:
                plain = plain_client.send(request, request_id="request-shape-plain")
            if plain.http_status == 400:
                return  # not an extension: the request itself is refused (the suites record why)
            fields = sent_extensions(body)
        raise unsupported_error(shape, fields, f"{api_url}{request.path}", rec.error_message or "")


__all__ = ["DEFAULT_SHAPE", "REQUEST_SHAPES", "RequestShape", "check_request_shape", "request_shape",
           "sent_extensions", "unsupported_error", "unsupported_fields"]
