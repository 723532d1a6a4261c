"""``python -m harness serve`` as a real child process, driven by the official openai client
and raw HTTP: streaming, errors, disconnects, engine death, shutdown and reaping."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.cli import main as cli_main
from harness.engine.core.oracle import greedy_reference
from harness.engine.serving.server import ServerProcess
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import ConfigError

TOK = ByteTokenizer()
MODEL = (("model_name", "tiny"),)


def children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return kids


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def gone_or_reaped(pid: int) -> bool:
    """True when ``pid`` no longer exists: a zombie (exited, never reaped) still has /proc/PID."""
    return not os.path.exists(f"/proc/{pid}")


def scrape(server: ServerProcess) -> dict:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def abort_count(server: ServerProcess) -> float:
    return scrape(server)[("pdengine_requests_finished_total", (("finished_reason", "abort"), *MODEL))]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("tiny", engine="process") as srv:
        yield srv


@pytest.fixture
def oa(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.mark.slow
def test_openai_client_streams_a_completion_token_exact_with_usage_last(server, oa):
    prompt = "Hot migration moves KV"
    stream = oa.completions.create(model="tiny", prompt=prompt, max_tokens=14, temperature=0, stream=True,
                                   stream_options={"include_usage": True},
                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    *token_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 14
    assert last.usage.prompt_tokens == len(prompt.encode())
    ids = [i for c in token_chunks for i in c.choices[0].token_ids]
    expected = greedy_reference("tiny", TOK.encode(prompt), 14, ignore_eos=True)
    assert ids == expected
    assert "".join(c.choices[0].text for c in token_chunks) == TOK.decode(expected)
    assert token_chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_openai_client_streams_a_chat_completion_and_reads_a_plain_one(server, oa):
    messages = [{"role": "user", "content": "Name a degradation level."}]
    expected = greedy_reference("tiny", TOK.encode(TOK.apply_chat_template(messages)), 9, ignore_eos=True)
    stream = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                        stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TOK.decode(expected)
    assert chunks[-1].usage.completion_tokens == 9
    plain = oa.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert plain.choices[0].message.content == TOK.decode(expected)
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 9


@pytest.mark.slow
def test_bad_requests_raise_openai_errors_and_the_server_keeps_serving(server, oa):
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(model="tiny", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as long:
        oa.completions.create(model="tiny", prompt="w" * 1100, max_tokens=4)
    assert long.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        oa.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as n2:
        oa.completions.create(model="tiny", prompt="x", max_tokens=2, n=2)
    assert n2.value.param == "n"
    raw = httpx.post(f"{server.base_url}/completions", content=b"{nope", timeout=10,
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    ok = oa.completions.create(model="tiny", prompt="still serving", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3


@pytest.mark.slow
def test_client_disconnect_over_tcp_frees_the_engines_kv(server):
    aborted_before = abort_count(server)
    body = {"prompt": "keep going", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [line for line, _ in zip(lines, range(4)) if line.startswith("data:")]
            assert got and "[DONE]" not in got[-1]
            during = scrape(server)[("pdengine_kv_cache_blocks_used", MODEL)]
        # leaving the block closed the connection mid-stream
    assert during > 0  # the request held KV while it streamed
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        samples = scrape(server)
        if samples[("pdengine_kv_cache_blocks_used", MODEL)] == 0 and abort_count(server) == aborted_before + 1:
            break
        time.sleep(0.1)
    assert samples[("pdengine_kv_cache_blocks_used", MODEL)] == 0, "KV still held after the client left"
    assert abort_count(server) == aborted_before + 1
    assert samples[("pdengine_num_requests_running", MODEL)] == 0


@pytest.mark.slow
def test_engine_death_mid_stream_is_an_sse_error_then_done_and_shutdown_reaps_everything():
    with ServerProcess("tiny", engine="process") as srv:
        kids = children(srv.proc.pid)
        engines = [k for k in kids if "spawn_main" in cmdline(k)]
        assert len(engines) == 1, [cmdline(k) for k in kids]
        body = {"prompt": "until the end", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        messages = []
        with httpx.stream("POST", f"{srv.base_url}/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                messages.append(line[len("data: "):])
                if len(messages) == 2:
                    os.kill(engines[0], signal.SIGKILL)
        assert messages[-1] == "[DONE]"
        error = json.loads(messages[-2])["error"]
        assert "died" in error["message"] and error["code"] == "engine_error"
        assert all("choices" in json.loads(m) for m in messages[:-2])
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert scrape(srv)[("pdengine_engine_up", MODEL)] == 0
        refused = httpx.post(f"{srv.base_url}/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code in (500, 503) and "error" in refused.json()
    assert srv.proc.returncode == 0, srv.log_tail()
    assert all(gone_or_reaped(k) for k in kids), [(k, cmdline(k)) for k in kids if not gone_or_reaped(k)]


@pytest.mark.slow
def test_sigint_stops_an_inproc_server_cleanly():
    srv = ServerProcess("tiny", engine="inproc")
    with srv:
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0, srv.log_tail()
        assert "listening on http://127.0.0.1:" in srv.log_tail()


def test_serve_refuses_a_port_in_use_and_a_bad_port(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert cli_main(["serve", "--port", str(port)]) == 3
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--port", "70000"])
    assert exc.value.code == 2 and "0..65535" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="engine mode"):
        ServerProcess("tiny", engine="gpu")


def test_accepted_api_connections_have_tcp_nodelay():
    """asyncio (and so uvicorn) sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; the
    listener used to be created with proto 0, and Nagle then held each keep-alive client's first
    SSE chunk until the client's delayed ACK (~40 ms of false TTFT)."""
    import asyncio

    from harness.engine.serving.server import bind_socket

    async def main() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=bind_socket("127.0.0.1", 0))
        host, port = server.sockets[0].getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
