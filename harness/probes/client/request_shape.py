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
from typing import Any

from harness.errors import ConfigError
from harness.probes.client.shapes import DEFAULT_SHAPE, REQUEST_SHAPES, RequestShape, request_shape
from harness.probes.client.streaming import CompletionRequest, StreamingClient

log = logging.getLogger(__name__)


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
                           f"{', '.join(REQUEST_SHAPES)}; harness/probes/client/request_shape.py), or let the server "
                           f"accept {', '.join(fields)}")


def check_request_shape(api_url: str, shape: RequestShape, *, model: str | None = None,
                        api_key: str | None = None, timeout_s: float = 60.0) -> None:
    """Send one streamed completion with every extension of ``shape``; raise :func:`unsupported_error` when
    the server answers 400 because of one of them (named in its message, or the same request without
    extensions succeeds). Any other outcome is left to the suites: a server that is down or overloaded is
    what they measure."""
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
