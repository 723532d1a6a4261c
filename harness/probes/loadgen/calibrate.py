"""How many characters of the load's prompt text make one token on this server.

Prompts sized in tokens (``LoadProfile.prompt_tokens`` / ``mix``, the cluster file's ``workload``)
need the server's tokenizer, which the harness does not have for a foreign engine. So it asks the
server: two prompts of the load's own words, of different lengths, each with ``max_tokens=1``;
``usage.prompt_tokens`` of each gives a line ``tokens = overhead + chars / chars_per_token`` (the
overhead is what every prompt costs: BOS, a chat template). The records of the real run carry the
server's prompt token counts, so the sizing can be checked afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
import random

from harness.errors import ProbeError
from harness.probes.client.request_shape import (DEFAULT_SHAPE, RequestShape, request_shape, unsupported_error,
                                          unsupported_fields)
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from harness.probes.loadgen.workload import LoadProfile, prompt_text

log = logging.getLogger(__name__)

SHORT_CHARS, LONG_CHARS = 64, 448  # short enough for a tiny model's context


def measure_chars_per_token(api_url: str, *, model: str | None = None, api_key: str | None = None,
                            chat: bool = False, timeout_s: float = 120.0,
                            shape: RequestShape = DEFAULT_SHAPE) -> tuple[float, float]:
    """(characters per token, tokens of overhead per prompt) measured on the server. A 400 that names an
    extension of ``shape`` is a ConfigError naming the field and the shape."""
    rng = random.Random(0)
    points = []
    with StreamingClient(api_url, model=model, timeout_s=timeout_s, api_key=api_key, request_shape=shape) as client:
        for chars in (SHORT_CHARS, LONG_CHARS):
            text = prompt_text(rng, chars)
            request = CompletionRequest(prompt=text, max_tokens=1, chat=chat)
            rec = client.send(request, request_id=f"calibrate-{chars}")
            rejected = unsupported_fields(request.body(client.model or "", shape), rec.error_message or "")
            if rec.http_status == 400 and rejected:
                raise unsupported_error(shape, rejected, f"{api_url}{request.path}", rec.error_message or "")
            if not rec.ok:
                raise ProbeError(f"sizing prompts in tokens: the calibration request to {api_url} failed "
                                 f"({rec.status}: {rec.error_class} {rec.error_message})",
                                 fix="check the server answers /v1/completions, or size prompts in characters "
                                     "(drop prompt_tokens / workload)")
            if not rec.prompt_tokens:
                raise ProbeError(f"sizing prompts in tokens: {api_url} returned no usage.prompt_tokens "
                                 f"(stream_options.include_usage) for the calibration request",
                                 fix="use a server that reports usage, or size prompts in characters "
                                     "(drop prompt_tokens / workload)")
            points.append((len(text), rec.prompt_tokens))
    (c1, t1), (c2, t2) = points
    if t2 <= t1:
        raise ProbeError(f"sizing prompts in tokens: a {c2}-character prompt counted {t2} tokens, not more than "
                         f"the {c1}-character one's {t1}", fix="check the server's usage counts")
    per_token = (c2 - c1) / (t2 - t1)
    overhead = max(0.0, t1 - c1 / per_token)
    log.info("server %s: %.2f prompt characters per token, %.1f tokens of overhead per prompt",
             api_url, per_token, overhead)
    return per_token, overhead


def calibrated(profile: LoadProfile, api_url: str, *, api_key: str | None = None) -> LoadProfile:
    """``profile`` with the server's characters per token filled in when its prompts are sized
    in tokens and it has none yet; else ``profile`` itself."""
    if not profile.sized_in_tokens or profile.chars_per_token is not None:
        return profile
    per_token, overhead = measure_chars_per_token(api_url, model=profile.model, api_key=api_key,
                                                  chat=profile.chat, timeout_s=profile.timeout_s,
                                                  shape=request_shape(profile.engine))
    return dataclasses.replace(profile, chars_per_token=per_token, token_overhead=overhead)
