"""OpenAI SSE responses parsed into a RequestRecord: the byte stream split into messages, each
dated by the read that brought its first byte (as AIPerf does), and the tokens each carries counted.
Any HTTP client can feed it; the streaming clients (harness/probes/client/streaming.py) do.
"""

from __future__ import annotations

import json
from typing import Callable

from harness.probes.client.records import RequestRecord

# called after each parsed SSE message with the record so far and the message (e.g. to act on a
# stream mid-way: its id and ``served_by`` say where it runs now); must not block
MessageHook = Callable[[RequestRecord, dict], None]


class SSEDecoder:
    """Splits a byte stream into SSE messages' data payloads, each dated by the read that
    brought its first byte. Comment and ``event:`` lines are ignored."""

    def __init__(self) -> None:
        self._buf = b""
        self._started_ns: int | None = None

    def feed(self, data: bytes, t_ns: int) -> list[tuple[int, str]]:
        if data and self._started_ns is None:
            self._started_ns = t_ns
        # normalise on the whole buffer: a CRLF may be split across two reads
        self._buf = (self._buf + data).replace(b"\r\n", b"\n")
        out: list[tuple[int, str]] = []
        while b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append((self._started_ns or t_ns, b"\n".join(lines).decode("utf-8", "replace")))
            # the rest of the buffer (if any) belongs to a message that began in this read
            self._started_ns = t_ns if self._buf.strip() else None
        return out


class RecordBuilder:
    """Fills a RequestRecord from timestamped reads of an OpenAI SSE response; any HTTP
    client can feed it (``feed(bytes, perf_counter_ns)`` per read, then ``finish``).

    Tokens are counted without relying on text (a server may stream tokens that detokenize to nothing):
    a chunk's ``token_ids`` where given; else, when the stream's chunks carry usage
    (``stream_options.continuous_usage_stats``), the rise of ``usage.completion_tokens`` since the last
    chunk; else one token per chunk with text. A chunk carrying a token is an output chunk whatever its
    text (TTFT is the first one). The way the stream was counted is the record's ``token_source``."""

    def __init__(self, record: RequestRecord, on_message: MessageHook | None = None) -> None:
        self.record = record
        self.done = False
        self.on_message = on_message
        self._sse = SSEDecoder()
        self._usage_tokens = 0  # completion tokens the per-chunk usage has counted so far (never down)

    def feed(self, data: bytes, t_ns: int) -> None:
        rec = self.record
        if rec.first_byte_ns is None and data:
            rec.first_byte_ns = t_ns
        for msg_ns, payload in self._sse.feed(data, t_ns):
            if payload.strip() == "[DONE]":
                self.done = True
                continue
            try:
                msg = json.loads(payload)
                self._message(msg, msg_ns)
            except (json.JSONDecodeError, TypeError, AttributeError) as exc:
                self.fail("stream_error", "MalformedSSE", f"unparseable SSE message {payload[:200]!r}: {exc}")
                continue
            if self.on_message is not None:
                self.on_message(self.record, msg)

    def _message(self, msg: dict, t_ns: int) -> None:
        rec = self.record
        if "error" in msg:
            err = msg["error"] if isinstance(msg["error"], dict) else {"message": str(msg["error"])}
            self.fail("stream_error", str(err.get("type") or err.get("code") or "StreamError"),
                      str(err.get("message", "")))
            return
        if rec.response_id is None and msg.get("id"):
            rec.response_id = str(msg["id"])
        served = msg.get("served_by")
        for worker in ([served] if isinstance(served, str) else served or []):
            if worker not in rec.served_by:
                rec.served_by.append(worker)
        usage = msg.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
        for choice in msg.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content") or ""
            ids = choice.get("token_ids") or []
            n = self._tokens_in(ids, text, usage)
            if n:
                if rec.first_token_ns is None:
                    rec.first_token_ns = t_ns
                rec.chunk_ns.append(t_ns)
                rec.chunk_tokens.append(n)
                rec.token_ids.extend(ids)
            rec.text += text
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]

    def _tokens_in(self, ids: list, text: str, usage: dict | None) -> int:
        """Tokens one chunk carries (see the class doc). Per-chunk usage counts only when the stream's
        first tokens came with it: a server that puts its total in the last content chunk (and none
        before) is counted by text, so that total is not counted twice."""
        rec = self.record
        count = (usage or {}).get("completion_tokens")
        if ids:
            rec.token_source = "token_ids"
            return len(ids)
        if isinstance(count, int) and rec.token_source in (None, "usage"):
            rec.token_source = "usage"
            # a count that goes down adds nothing here; the final usage then differs from the stream's
            # sum and nothing-lost names it
            n, self._usage_tokens = max(0, count - self._usage_tokens), max(count, self._usage_tokens)
            return n
        if text and rec.token_source != "usage":
            rec.token_source = rec.token_source or "text"
            return 1
        return 0

    def fail(self, status: str, error_class: str, message: str) -> None:
        rec = self.record
        if rec.status == "ok":  # keep the first failure: later ones are consequences
            rec.status, rec.error_class, rec.error_message = status, error_class, message

    def finish(self, t_ns: int) -> RequestRecord:
        rec = self.record
        rec.end_ns = t_ns
        if rec.status == "ok" and not self.done:
            self.fail("stream_error", "IncompleteStream", "the stream ended without a [DONE] message")
        return rec
