"""SSE parsing and record building from timestamped reads (no server: bytes are the input)."""

import json

from harness.probes.client.records import RequestRecord
from harness.probes.client.sse import RecordBuilder, SSEDecoder


def _msg(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def _chunk(ids, text="x", **extra) -> dict:
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": None}], **extra}


def test_a_message_split_over_reads_is_dated_by_its_first_byte():
    dec = SSEDecoder()
    whole = _msg(_chunk([1])) + _msg(_chunk([2]))
    cut = len(_msg(_chunk([1]))) + 5          # the second message starts in read 1, ends in read 2
    assert [t for t, _ in dec.feed(whole[:cut], 100)] == [100]
    assert [t for t, _ in dec.feed(whole[cut:], 200)] == [100]
    assert dec.feed(b"", 300) == []


def test_crlf_split_across_reads_comments_and_event_lines():
    dec = SSEDecoder()
    raw = b": keep-alive\r\n\r\nevent: completion\r\ndata: {\"a\": 1}\r\n\r\ndata: [DONE]\r\n\r\n"
    out = []
    for i in range(len(raw)):  # one byte per read: the worst a network can do
        out += dec.feed(raw[i:i + 1], i)
    assert [p for _, p in out] == ['{"a": 1}', "[DONE]"]
    assert out[0][0] == raw.index(b"event:")   # dated by the message's first byte


def _build(*reads) -> RequestRecord:
    b = RecordBuilder(RequestRecord(request_id="r", sent_ns=0))
    for t, data in enumerate(reads, start=1):
        b.feed(data, t * 10)
    return b.finish(1000)


def test_tokens_usage_workers_and_finish_reason():
    r = _build(_msg(_chunk([], text="", served_by="decode-0")),            # empty: not a token chunk
               _msg(_chunk([5, 6], text="ab", served_by="decode-0")),      # two tokens (speculative)
               _msg(_chunk([7], text="", served_by="decode-1")),           # partial UTF-8: still a token
               _msg({"id": "cmpl-1", "choices": [{"index": 0, "text": "c", "token_ids": [], "finish_reason": "length"}]}),
               _msg({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}),
               _msg(b"[DONE]"))
    assert r.status == "ok" and r.response_id == "cmpl-1"
    assert r.first_byte_ns == 10 and r.first_token_ns == 20
    assert (r.chunk_ns, r.chunk_tokens) == ([20, 30, 40], [2, 1, 1])   # text-only chunk counts as one token
    assert r.token_ids == [5, 6, 7] and r.text == "abc"
    assert r.served_by == ["decode-0", "decode-1"] and r.finish_reason == "length"
    assert (r.prompt_tokens, r.completion_tokens, r.end_ns) == (3, 3, 1000)


def test_chat_deltas_are_read():
    r = _build(_msg({"choices": [{"delta": {"role": "assistant"}}]}),
               _msg({"choices": [{"delta": {"content": "hi"}, "token_ids": [1, 2]}]}), _msg(b"[DONE]"))
    assert r.first_token_ns == 20 and r.text == "hi" and r.chunk_tokens == [2]


def test_error_payload_mid_stream_is_a_stream_error_not_a_silent_end():
    r = _build(_msg(_chunk([1])), _msg({"error": {"message": "worker decode-0 died", "type": "engine_error"}}),
               _msg(b"[DONE]"))
    assert (r.status, r.error_class, r.error_message) == ("stream_error", "engine_error", "worker decode-0 died")
    assert r.token_ids == [1]


def test_missing_done_and_garbage_are_stream_errors():
    assert _build(_msg(_chunk([1]))).error_class == "IncompleteStream"
    r = _build(_msg(b"{not json"), _msg(b"[DONE]"))
    assert r.status == "stream_error" and r.error_class == "MalformedSSE"
    # the first failure is kept: later ones are its consequences
    r = _build(_msg({"error": {"message": "boom", "code": "overloaded"}}), _msg(b"{not json"))
    assert r.error_class == "overloaded"


def _usage_chunk(count, text="", finish=None) -> dict:
    return {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": {"prompt_tokens": 4, "completion_tokens": count}}


def test_per_chunk_usage_counts_tokens_whose_text_is_empty():
    """Dynamo's mocker streams tokens that detokenize to nothing; its chunks carry cumulative usage."""
    r = _build(*(_msg(_usage_chunk(i)) for i in (1, 2, 3)),
               _msg(_usage_chunk(3, finish="length")),                        # the finish chunk adds no token
               _msg({"id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}),
               _msg(b"[DONE]"))
    assert r.status == "ok" and r.text == "" and r.token_source == "usage"
    assert r.chunk_tokens == [1, 1, 1] and r.chunk_ns == [10, 20, 30] and r.first_token_ns == 10
    assert r.completion_tokens == 3 and r.finish_reason == "length"


def test_usage_that_goes_down_adds_nothing_so_the_stream_disagrees_with_it():
    r = _build(_msg(_usage_chunk(1)), _msg(_usage_chunk(2)), _msg(_usage_chunk(1)), _msg(b"[DONE]"))
    assert sum(r.chunk_tokens) == 2 and r.completion_tokens == 1


def test_a_total_in_the_last_content_chunk_is_not_counted_twice():
    """Without per-chunk usage the stream is counted by text; a usage total riding on the last text
    chunk must not add the whole count again."""
    r = _build(_msg(_chunk([], text="a")), _msg(_chunk([], text="b")),
               _msg({"id": "c", "choices": [{"index": 0, "text": "c", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 3}}), _msg(b"[DONE]"))
    assert r.token_source == "text" and r.chunk_tokens == [1, 1, 1] and r.completion_tokens == 3


def test_token_ids_win_over_usage_and_text():
    r = _build(_msg({**_usage_chunk(2, text=""), "choices": [{"index": 0, "text": "", "token_ids": [4, 5]}]}),
               _msg(b"[DONE]"))
    assert r.token_source == "token_ids" and r.chunk_tokens == [2] and r.token_ids == [4, 5]
