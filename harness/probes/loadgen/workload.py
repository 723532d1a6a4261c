"""What load to generate: the profile, its prompts and its arrival schedule.

The profile travels from the harness to the Locust process as JSON (environment variable
``HARNESS_LOAD_PROFILE``), so both sides build the same prompts and arrival times from
the same seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

MODES = ("closed", "constant", "poisson")

# A small fixed vocabulary: prompts are deterministic and need no download.
WORDS = (
    "the cache holds key value blocks for every layer while the decoder streams tokens to the client "
    "prefill workers compute attention over the prompt and send each layer across the fabric "
    "a scheduler places requests on the least loaded worker with enough headroom for their memory "
    "latency budgets are measured in milliseconds and checked against thresholds before each rollout"
).split()


@dataclass(frozen=True)
class LoadProfile:
    """A load run. ``closed``: ``users`` users send back to back. ``constant``/``poisson``:
    open loop at ``rate`` requests/s for ``duration_s``, at most ``users`` in flight; latency
    is also measured from each request's scheduled send time, so a stalled server cannot
    hide its queueing delay (no coordinated omission)."""

    mode: str = "closed"
    users: int = 2
    rate: float | None = None          # requests/s, open loop only
    duration_s: float = 5.0
    max_tokens: int = 16
    prompt_min_chars: int = 16
    prompt_max_chars: int = 96
    num_prompts: int = 64
    seed: int = 0
    ignore_eos: bool = True            # fixed output length keeps TPOT comparable across requests
    chat: bool = False
    model: str | None = None
    timeout_s: float = 60.0
    stop_timeout_s: float = 30.0       # how long in-flight requests may finish after duration_s
    processes: int = 1                 # >1: Locust master + this many forked worker processes
    # prompts sized in the server's tokens (else prompt_min/max_chars): every request asks for
    # prompt_tokens tokens of prompt, or one of ``mix``'s shapes, each (prompt_tokens, output_tokens,
    # weight), drawn by weight with the seed (output_tokens replaces max_tokens for that request).
    # Characters per token come from the server itself (harness.probes.loadgen.calibrate, before the run).
    prompt_tokens: int | None = None
    mix: tuple[tuple[int, int, float], ...] = ()
    chars_per_token: float | None = None  # measured: prompt chars per server token ...
    token_overhead: float = 0.0           # ... plus the tokens every prompt costs (BOS, template)
    requests: int | None = None        # send this many requests in all, then end (duration_s caps it)
    engine: str = "bundled"            # the server's engine: which request extensions are sent (request_shape.py)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"load mode {self.mode!r} is unknown", fix=f"use one of {', '.join(MODES)}")
        if not isinstance(self.users, int) or self.users < 1:
            raise ConfigError(f"users must be a positive integer, got {self.users!r}",
                              fix="give the number of concurrent users (the in-flight cap in open loop)")
        if self.mode == "closed" and self.rate is not None:
            raise ConfigError("rate is only meaningful for open-loop load",
                              fix="use mode='constant' or 'poisson', or drop rate")
        if self.mode != "closed" and (self.rate is None or self.rate <= 0):
            raise ConfigError(f"open-loop mode {self.mode!r} needs rate > 0 requests/s, got {self.rate!r}",
                              fix="set rate, e.g. rate=4.0")
        if self.duration_s <= 0:
            raise ConfigError(f"duration_s must be > 0, got {self.duration_s!r}", fix="give the run length in seconds")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens!r}", fix="ask for at least one token")
        if not 1 <= self.prompt_min_chars <= self.prompt_max_chars:
            raise ConfigError(f"prompt lengths must satisfy 1 <= min <= max, got "
                              f"{self.prompt_min_chars}..{self.prompt_max_chars}", fix="fix prompt_min/max_chars")
        if self.num_prompts < 1:
            raise ConfigError("num_prompts must be >= 1", fix="generate at least one prompt")
        if not isinstance(self.processes, int) or not 1 <= self.processes <= 64:
            raise ConfigError(f"processes must be an integer from 1 to 64, got {self.processes!r}",
                              fix="use 1 unless one load generator process is the bottleneck")
        if self.users < self.processes:
            raise ConfigError(f"{self.users} users cannot be spread over {self.processes} processes",
                              fix="give at least one user per process")
        if self.timeout_s <= 0 or self.stop_timeout_s < 0:
            raise ConfigError("timeout_s must be > 0 and stop_timeout_s >= 0", fix="fix the timeouts")
        if self.prompt_tokens is not None and (not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 1):
            raise ConfigError(f"prompt_tokens must be a positive integer, got {self.prompt_tokens!r}",
                              fix="give the prompt length in tokens, e.g. 200")
        object.__setattr__(self, "mix", tuple(tuple(shape) for shape in self.mix))
        for shape in self.mix:
            if (len(shape) != 3 or not all(isinstance(v, int) and v >= 1 for v in shape[:2])
                    or not isinstance(shape[2], (int, float)) or not shape[2] > 0):
                raise ConfigError(f"request shape {list(shape)!r} is not (prompt_tokens >= 1, output_tokens >= 1, "
                                  f"weight > 0)", fix="write each shape as [prompt_tokens, output_tokens, weight]")
        if self.chars_per_token is not None and not self.chars_per_token > 0:
            raise ConfigError(f"chars_per_token must be > 0, got {self.chars_per_token!r}",
                              fix="let LoadRunner measure it on the server (harness.probes.loadgen.calibrate)")
        from harness.probes.client.request_shape import request_shape

        request_shape(self.engine)  # an unknown engine is a ConfigError naming the known ones
        if self.requests is not None and (not isinstance(self.requests, int) or self.requests < 1):
            raise ConfigError(f"requests must be a positive integer, got {self.requests!r}",
                              fix="give how many requests to send in all, or leave it unset to run for duration_s")

    @property
    def open_loop(self) -> bool:
        return self.mode != "closed"

    @property
    def sized_in_tokens(self) -> bool:
        """Prompts are sized in the server's tokens, so the server must be measured first."""
        return self.prompt_tokens is not None or bool(self.mix)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoadProfile:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"load profile is not valid JSON: {exc}", fix="pass LoadProfile.to_json()") from exc
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ConfigError(f"load profile has unknown fields {sorted(set(data) - known)}",
                              fix=f"use only {sorted(known)}")
        return cls(**data)


def workload_profile(workload: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """LoadProfile fields for a cluster file's ``workload:`` (prompt and output lengths in tokens, a
    request mix); ``{}`` without one. A suite's own ``max_tokens`` wins over the workload's output
    lengths (the suite chose its stream length for what it measures); prompts keep their sizes."""
    if workload is None:
        return {}
    fields: dict[str, Any] = {"prompt_tokens": workload.prompt_tokens, "max_tokens": workload.output_tokens}
    if workload.mix:
        fields["mix"] = tuple((s.prompt_tokens, overrides.get("max_tokens", s.output_tokens), s.weight)
                              for s in workload.mix)
    return fields


def prompt_text(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of the load's fixed vocabulary, drawn with ``rng``."""
    words: list[str] = []
    while len(" ".join(words)) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars].rstrip() or WORDS[0]


def prompt_chars(profile: LoadProfile, tokens: int) -> int:
    """Characters that make a prompt of about ``tokens`` server tokens (measured ratio)."""
    if profile.chars_per_token is None:
        raise ConfigError("prompts sized in tokens need the server's characters per token",
                          fix="start the run through LoadRunner, which measures it on the server first "
                              "(harness.probes.loadgen.calibrate), or set chars_per_token")
    return max(1, round((tokens - profile.token_overhead) * profile.chars_per_token))


def make_requests(profile: LoadProfile) -> list[tuple[str, int]]:
    """``num_prompts`` (prompt, max_tokens) pairs, the same for the same seed: prompts of varied
    length in chars, or sized in tokens (``prompt_tokens`` / ``mix``, max_tokens per shape)."""
    rng = random.Random(profile.seed)
    shapes: tuple[tuple[int, int, float], ...] = ()
    if profile.sized_in_tokens:
        shapes = profile.mix or ((profile.prompt_tokens, profile.max_tokens, 1.0),)
    out = []
    for _ in range(profile.num_prompts):
        if shapes:
            prompt_tokens, max_tokens, _w = rng.choices(shapes, weights=[s[2] for s in shapes])[0]
            out.append((prompt_text(rng, prompt_chars(profile, prompt_tokens)), max_tokens))
        else:
            out.append((prompt_text(rng, rng.randint(profile.prompt_min_chars, profile.prompt_max_chars)),
                        profile.max_tokens))
    return out


def make_prompts(profile: LoadProfile) -> list[str]:
    """The prompts of :func:`make_requests`."""
    return [prompt for prompt, _ in make_requests(profile)]


def arrival_offsets(mode: str, rate: float, duration_s: float, seed: int) -> list[float]:
    """Scheduled send times (seconds from the start) inside [0, duration_s).

    ``constant``: every 1/rate s. ``poisson``: exponential gaps with mean 1/rate, seeded,
    so the mean rate is ``rate`` and the same seed gives the same schedule."""
    if rate <= 0 or duration_s <= 0:
        raise ConfigError(f"arrival schedule needs rate > 0 and duration > 0, got {rate}, {duration_s}",
                          fix="pass a positive rate and duration")
    if mode == "constant":
        return [i / rate for i in range(int(duration_s * rate - 1e-9) + 1) if i / rate < duration_s]
    if mode == "poisson":
        rng = random.Random(seed)
        out, t = [], rng.expovariate(rate)
        while t < duration_s:
            out.append(t)
            t += rng.expovariate(rate)
        return out
    raise ConfigError(f"arrival mode {mode!r} is not open loop", fix="use 'constant' or 'poisson'")


# distributed load (harness.probes.loadgen.load_distributed): a worker names its load host (LOAD_HOST_ENV) to
# the master in a JOINED_MESSAGE, which appends it to the file named by JOINED_ENV
LOAD_HOST_ENV = "HARNESS_LOAD_HOST"
JOINED_ENV = "HARNESS_LOAD_JOINED"
JOINED_MESSAGE = "harness_load_host"


def worker_records_path(output_path: str | os.PathLike, index: int) -> Path:
    """Where Locust worker ``index`` of a multi-process run writes its records."""
    path = Path(output_path)
    return path.with_name(f"{path.stem}.w{index}{path.suffix}")
