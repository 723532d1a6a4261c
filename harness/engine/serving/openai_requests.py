"""The request half of the OpenAI-compatible API: strict request bodies, their validation into
OpenAI-shaped errors, and their translation into one engine ``GenerateRequest`` (a ``Call``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from harness.engine.core.types import EngineClient, GenerateRequest, SamplingParams
from harness.errors import InvalidRequestError

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


class CommonBody(_Body):
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


class CompletionBody(CommonBody):
    prompt: Any = None  # str | list[int] | [str] | [list[int]], checked by _completion_prompt()
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None


class ChatBody(CommonBody):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


def _refuse_unsupported(body: CommonBody) -> None:
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


def parse_body(body_type: type[_T], raw: bytes) -> _T:
    try:
        return body_type.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def validation_error(errors: Sequence[dict]) -> InvalidRequestError:
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
class Call:
    """One parsed request: what the engine gets and how the answer is shaped."""

    chat: bool
    request: GenerateRequest
    model: str
    created: int
    include_usage: bool
    return_token_ids: bool
    stream: bool


def to_call(body: CommonBody, client: EngineClient) -> Call:
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
    return Call(chat=chat, request=request, model=client.model_name, created=int(time.time()),
                 include_usage=include_usage, return_token_ids=body.return_token_ids, stream=body.stream)


__all__ = ["COMPLETIONS_DEFAULT_MAX_TOKENS", "Call", "ChatBody", "CommonBody", "CompletionBody", "parse_body", "to_call",
           "validation_error"]
