"""The request shape of each engine's OpenAI-compatible server: which extensions beyond the OpenAI
API it accepts (:class:`RequestShape`, the table :data:`REQUEST_SHAPES`). The streaming client sends
only those (harness/probes/client/streaming.py); harness/probes/client/request_shape.py checks a server against its
shape. Kept below both so the check can use the client without the client importing the check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.errors import ConfigError


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


__all__ = ["DEFAULT_SHAPE", "REQUEST_SHAPES", "RequestShape", "request_shape"]
