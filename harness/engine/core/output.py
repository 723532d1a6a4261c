"""Per-request output state: the token list, streamed text, and when generation stops.

Shared by the engine and the oracle so that both apply exactly the same stop rules:

- EOS (unless ``ignore_eos``) stops with reason STOP; the EOS id is in the token ids, not the text.
- A stop string stops with reason STOP; the token that completed it is in the token ids, but the
  text ends right before the stop string.
- ``max_tokens`` output tokens (``resume_token_ids`` count) stop with reason LENGTH.
- prompt + output reaching ``max_model_len`` stops with reason LENGTH.

Text that could be the start of a stop string is held back until it is decided.
"""

from __future__ import annotations

from harness.engine.core.types import FinishReason, SamplingParams
from harness.engine.core.tokenizer import ByteTokenizer


class OutputTracker:
    def __init__(self, tokenizer: ByteTokenizer, params: SamplingParams, num_prompt_tokens: int,
                 max_model_len: int, resume_token_ids: list[int] = ()) -> None:
        self.params = params
        self.eos = tokenizer.EOS
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        self.output_ids: list[int] = list(resume_token_ids)
        self._detok = tokenizer.detokenizer()
        self._text = self._detok.push(self.output_ids)
        self._max_stop = max((len(s) for s in params.stop), default=0)
        # The resumed tokens' text reached the client except the tail the earlier worker held back
        # as a possible start of a stop string (same rule, same text): that tail is still to be
        # streamed, and a stop string may begin in it and end in the tokens decoded from here.
        self._emitted = len(self._text) - self._held_back(len(self._text), 0)
        self.finish_reason: FinishReason | None = None
        self._check_limits()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> bool:
        """Add one generated token; returns True when the request is now finished."""
        assert not self.finished, "token appended after the request finished"
        self.output_ids.append(token_id)
        if token_id == self.eos and not self.params.ignore_eos:
            self.finish_reason = FinishReason.STOP
            self._text += self._detok.flush()
            return True
        before = len(self._text)
        self._text += self._detok.push([token_id])
        if self._max_stop:
            start = max(self._emitted, before - self._max_stop + 1)
            hits = [i for i in (self._text.find(s, start) for s in self.params.stop) if i >= 0]
            if hits:
                self._text = self._text[:min(hits)]
                self.finish_reason = FinishReason.STOP
                return True
        self._check_limits()
        if self.finished:
            self._text += self._detok.flush()
        return self.finished

    def _check_limits(self) -> None:
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.num_prompt_tokens + len(self.output_ids) >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH

    def take_text(self) -> str:
        """New text that is safe to stream (all of it once finished)."""
        end = len(self._text)
        if not self.finished:
            end -= self._held_back(end, self._emitted)
        new, self._emitted = self._text[self._emitted:end], max(self._emitted, end)
        return new

    def _held_back(self, end: int, emitted: int) -> int:
        """Length of the longest tail of ``_text[emitted:end]`` that a stop string could still
        start with (it is not streamed until decided)."""
        for n in range(min(self._max_stop - 1, end - emitted), 0, -1):
            tail = self._text[end - n:end]
            if any(s.startswith(tail) for s in self.params.stop):
                return n
        return 0
