"""Engine clients: the EngineClient protocol over a thread and over a child process."""

import asyncio
import os
import signal

import pytest

from harness.engine.core.client import InProcessClient, QueueClient, make_client
from harness.engine.core.config import EngineConfig
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.types import EngineClient, FinishReason, GenerateRequest, SamplingParams
from harness.errors import ConfigError, InvalidRequestError

CONFIG = EngineConfig(preset="tiny")


def request(rid: str, prompt: str, max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(rid, list(prompt.encode()), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def collect(client, req: GenerateRequest) -> tuple[list[int], object]:
    tokens, last = [], None
    async for event in client.generate(req):
        tokens += event.token_ids
        last = event
    return tokens, last


async def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_inprocess_client_streams_concurrent_requests_token_exactly():
    async def main():
        async with InProcessClient(CONFIG) as client:
            assert isinstance(client, EngineClient)
            assert client.model_name == "tiny" and client.max_model_len == CONFIG.context_len
            results = await asyncio.gather(*(collect(client, request(f"r{i}", f"prompt {i}")) for i in range(6)))
            for i, (tokens, last) in enumerate(results):
                assert tokens == greedy_reference("tiny", list(f"prompt {i}".encode()), 16, ignore_eos=True)
                assert last.finished and last.finish_reason is FinishReason.LENGTH
            assert client.stats().generation_tokens_total == 6 * 16
    asyncio.run(main())


def test_closing_the_stream_early_aborts_and_frees_kv():
    async def main():
        async with InProcessClient(CONFIG) as client:
            stream = client.generate(request("early", "walk away " * 4, max_tokens=500))
            first = await stream.__anext__()
            assert first.token_ids and not first.finished
            await wait_for(lambda: client.stats().kv_blocks_used > 0)
            await stream.aclose()
            await wait_for(lambda: client.stats().kv_blocks_used == 0 and client.stats().num_running == 0)
    asyncio.run(main())


def test_invalid_requests_raise_before_streaming():
    async def main():
        async with InProcessClient(CONFIG) as client:
            with pytest.raises(InvalidRequestError, match="empty"):
                await collect(client, GenerateRequest("bad", []))
            with pytest.raises(InvalidRequestError, match="max_model_len"):
                await collect(client, request("long", "x" * 5000))
    asyncio.run(main())


def test_set_speculative_changes_the_engine_and_not_the_tokens():
    async def main():
        async with InProcessClient(CONFIG) as client:
            await client.set_speculative(True)
            tokens, _ = await collect(client, request("s", "speculative client", 24))
            assert client.stats().spec_enabled and client.stats().spec_draft_tokens > 0
            assert tokens == greedy_reference("tiny", list(b"speculative client"), 24, ignore_eos=True)
    asyncio.run(main())


def test_make_client_rejects_unknown_modes():
    with pytest.raises(ConfigError, match="inproc"):
        make_client(CONFIG, mode="thread")


@pytest.mark.slow
def test_queue_client_serves_and_reports_a_killed_child():
    async def main():
        client = make_client(CONFIG, mode="process")
        assert isinstance(client, QueueClient)
        try:
            tokens, last = await collect(client, request("ok", "over a queue", 12))
            assert tokens == greedy_reference("tiny", list(b"over a queue"), 12, ignore_eos=True)
            assert last.finish_reason is FinishReason.LENGTH
            assert client.stats().generation_tokens_total == 12

            stream = client.generate(request("victim", "killed mid-stream", max_tokens=1000))
            await stream.__anext__()
            os.kill(client.pid, signal.SIGKILL)
            events = [e async for e in stream]
            assert events[-1].finished and events[-1].finish_reason is FinishReason.ERROR
            assert "died" in events[-1].error and str(client.pid) in events[-1].error

            tokens, after = await collect(client, request("after", "anyone there"))
            assert tokens == [] and after.finish_reason is FinishReason.ERROR and "died" in after.error
        finally:
            await client.close()
        assert client.process.exitcode == -signal.SIGKILL  # joined: no zombie left
    asyncio.run(main())


@pytest.mark.slow
def test_queue_client_close_reaps_a_healthy_child():
    async def main():
        client = QueueClient(CONFIG)
        pid = client.pid
        await client.close()
        assert client.process.exitcode == 0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    asyncio.run(main())


def _children_of(pid: int) -> set[int]:
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    if f"PPid:\t{pid}\n" in f.read():
                        found.add(int(entry))
            except OSError:
                pass
    return found


ORPHAN_SCRIPT = """
import asyncio
from harness.engine.core.client import QueueClient
from harness.engine.core.config import EngineConfig
if __name__ == "__main__":
    client = QueueClient(EngineConfig(preset="tiny"))
    print(client.pid, flush=True)
    asyncio.run(asyncio.sleep(3600))
"""


@pytest.mark.slow
def test_queue_client_child_exits_when_its_parent_is_killed():
    import ctypes
    import subprocess
    import sys
    import time

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36  # orphans of the killed parent become ours, so we can reap them
    assert libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0
    before = _children_of(os.getpid())
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60
        while os.waitpid(engine_pid, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline, "the engine process outlived its killed parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in _children_of(os.getpid()) - before - {parent.pid}:  # e.g. multiprocessing's tracker
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        parent.stdout.close()
        libc.prctl(pr_set_child_subreaper, 0, 0, 0, 0)
