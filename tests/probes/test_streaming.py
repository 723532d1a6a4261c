"""The streaming client against a real reference-engine server (tiny preset)."""

import asyncio
import os
import signal
import socket
import threading

import pytest

from harness.engine.core.oracle import greedy_reference
from harness.engine.serving.server import ServerProcess
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import ProbeError
from harness.probes.client.streaming import AsyncStreamingClient, CompletionRequest, StreamingClient

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with ServerProcess("tiny") as srv:
        yield srv


def _assert_ordered_times(r):
    assert r.scheduled_ns <= r.sent_ns <= r.first_byte_ns <= r.first_token_ns <= r.end_ns
    assert r.chunk_ns == sorted(r.chunk_ns) and r.chunk_ns[0] == r.first_token_ns and r.chunk_ns[-1] <= r.end_ns


def test_completion_record_is_token_exact_with_usage_and_ordered_times(server):
    prompt = "The scheduler places each request"
    seen = []
    with StreamingClient(server.url, on_record=seen.append) as client:
        r = client.send(CompletionRequest(prompt, max_tokens=12, ignore_eos=True), request_id="probe-1")
    assert r.status == "ok" and r.http_status == 200 and r.request_id == "probe-1" and r.response_id
    assert seen == [r]
    expected = greedy_reference("tiny", ByteTokenizer().encode(prompt), 12, ignore_eos=True)
    assert r.token_ids == expected
    assert (r.prompt_tokens, r.completion_tokens, r.finish_reason) == (len(prompt.encode()), 12, "length")
    assert sum(r.chunk_tokens) == 12 and r.num_output_tokens == 12
    assert r.scheduled_ns == r.sent_ns  # not open loop: due when sent
    _assert_ordered_times(r)


def test_chat_and_async_clients_record_the_same_way(server):
    async def go():
        async with AsyncStreamingClient(server.url) as client:
            return await asyncio.gather(*(client.send(CompletionRequest(f"hi {i}", max_tokens=6, ignore_eos=True,
                                                                        chat=True)) for i in range(3)))
    records = asyncio.run(go())
    assert [r.status for r in records] == ["ok"] * 3
    for r in records:
        assert r.completion_tokens == 6 and len(r.token_ids) == 6 and r.text
        _assert_ordered_times(r)


def test_server_rejection_is_an_http_error_record_naming_the_problem(server):
    with StreamingClient(server.url) as client:
        r = client.send(CompletionRequest("x" * 5000, max_tokens=4))     # over the context limit
    assert r.status == "http_error" and r.http_status == 400
    assert r.error_class and "context" in (r.error_message + r.error_class).lower()
    assert r.first_token_ns is None and r.token_ids == []


def test_unreachable_server_is_a_connection_error_record():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with StreamingClient(f"http://127.0.0.1:{port}", model="tiny") as client:
        r = client.send(CompletionRequest("hello", max_tokens=4))
    assert r.status == "connection_error" and r.error_class == "ConnectError" and r.end_ns >= r.sent_ns
    with pytest.raises(ProbeError, match="cannot list models"):
        StreamingClient(f"http://127.0.0.1:{port}").resolve_model()
    with pytest.raises(ProbeError, match="no http"):
        StreamingClient("127.0.0.1:8000")


def test_cancelled_request_is_recorded_then_the_cancellation_propagates(server):
    seen = []

    async def go():
        async with AsyncStreamingClient(server.url, on_record=seen.append) as client:
            # 900 tokens take seconds even on an idle machine; a loaded one only makes it longer
            task = asyncio.create_task(client.send(CompletionRequest("cancel me", max_tokens=900, ignore_eos=True)))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert len(seen) == 1
    r = seen[0]
    assert r.status == "cancelled" and r.error_class == "CancelledError"
    assert len(r.token_ids) < 900 and r.end_ns >= r.sent_ns


def test_hung_server_mid_stream_is_a_timeout_record(server):
    """SIGSTOP the real server while it streams: the client's stall timeout ends the request."""
    hang = threading.Timer(0.3, os.kill, (server.proc.pid, signal.SIGSTOP))  # 900 tokens take seconds
    with StreamingClient(server.url, read_timeout_s=1.0) as client:
        client.resolve_model()
        try:
            hang.start()
            r = client.send(CompletionRequest("hang", max_tokens=900, ignore_eos=True))
        finally:
            hang.join()
            os.kill(server.proc.pid, signal.SIGCONT)
    assert r.status == "timeout" and r.error_class == "ReadTimeout", (r.status, r.error_class)
    assert len(r.token_ids) < 900 and r.end_ns > r.sent_ns
