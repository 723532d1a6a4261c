"""Typed messages between the API layer, the engine core and (in PD mode) the router.

These types are the contract shared by the single-process server, the engine core,
the PD router and the workers. Keep them plain dataclasses of plain values so they
pickle across process boundaries and serialise to JSON.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from harness.errors import InvalidRequestError


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS token or a stop string
    LENGTH = "length"    # max_tokens reached or context limit reached
    ABORT = "abort"      # client went away / cancelled
    ERROR = "error"      # the engine could not finish it (error event carries the message)


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. temperature == 0 means greedy (deterministic, the oracle)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    priority: int = 0  # higher = more important; high-priority KV is never evicted (Section 4.3)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}",
                                      param="max_tokens")
        if not 0.0 <= float(self.temperature) <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature!r}",
                                      param="temperature")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be at most 4 non-empty strings", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerateRequest:
    """One generation request as the engine sees it (already tokenised)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    # PD resume after a worker died: tokens already streamed to the client. The engine
    # re-prefills prompt + these and continues; they are not emitted again, and they
    # count against max_tokens.
    resume_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0  # time.monotonic() at the API layer


@dataclass
class TokenEvent:
    """New output of one request after one engine step (or a final/error event).

    ``token_ids`` may hold several tokens (speculative decoding accepts several per step).
    ``text`` is the newly decodable text (byte-level tokens may hold partial UTF-8, so
    text can lag token ids by a few bytes; the final event flushes). When a stop string
    matches, the stop string itself is not included in ``text``.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative, including resume_token_ids
    worker: str | None = None   # id of the worker that produced these tokens (PD mode)
    error: str | None = None    # set when finish_reason is ERROR
    degraded: str | None = None  # what degradation Level 4 changed (capped max_tokens, cut context)


@dataclass
class EngineStats:
    """A point-in-time view of an engine (or a whole PD cluster, summed)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_block_bytes: int = 0
    spec_enabled: bool = False
    spec_draft_tokens: int = 0      # cumulative proposed draft tokens
    spec_accepted_tokens: int = 0   # cumulative accepted draft tokens
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0


@runtime_checkable
class EngineClient(Protocol):
    """What the HTTP API layer talks to. Implemented in-process, over a queue to an engine
    process, and by the PD router (which fans out to worker processes)."""

    model_name: str
    max_model_len: int  # prompt + output tokens must fit

    def tokenizer(self):  # -> harness.engine.core.tokenizer.ByteTokenizer
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream events for one request. The last event has finished=True. Closing the
        iterator early (client went away) must abort the request and free its KV."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def set_speculative(self, enabled: bool) -> None:
        """Switch speculative decoding at run time (degradation Level 2 turns it off)."""
        ...

    async def close(self) -> None: ...
