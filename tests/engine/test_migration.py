"""Live KV migration between two real decode worker processes (worker side of issue 6).

The test plays the router (a control server speaking the workers' JSON protocol) and the
prefill worker (an in-process engine streaming KV with the real sender), so only the worker
code under test runs in the child processes. The client's view is rebuilt from token events by
position (``num_output_tokens``), the way the router dedupes, and must equal the oracle.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.oracle import greedy_reference
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.control.codec import VERSION, frame, read_raw
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.kvtransfer.transfer import PATH_CONTROL, PATH_FABRIC, Endpoint, KVSender, TransferConfig, TransferStats
from harness.engine.resilience.worker_migration import transfer_id
from harness.errors import KVTransferError

tok = ByteTokenizer()
PROMPT, MAX_TOKENS = "migrate this stream, token for token: ", 300


def test_engine_level_handover_keeps_tokens_and_text_exact():
    """pause + read_kv on the source, begin/commit_import(stream_first=False) on the target."""
    cfg = EngineConfig(preset="tiny")
    source, target = EngineCore(cfg), EngineCore(cfg)
    req = GenerateRequest("h", tok.encode(PROMPT), SamplingParams(max_tokens=60, ignore_eos=True))
    source.add_request(req)
    tokens, text = [], ""
    while len(tokens) < 17:
        for ev in source.step():
            tokens += ev.token_ids
            text += ev.text
    all_tokens = source.pause_request("h")
    assert all_tokens == req.prompt_token_ids + tokens
    kv_tokens = len(all_tokens) - 1
    moved = GenerateRequest("h", req.prompt_token_ids, req.params, resume_token_ids=tokens[:-1])
    handle = target.begin_import(moved, kv_tokens)
    for layer, (k, v) in enumerate(source.read_kv("h", kv_tokens)):
        handle.write_layer(layer, k, v)
    target.commit_import(handle, tokens[-1], stream_first=False)
    assert source.release_paused("h") and source.pool.num_free == source.pool.num_blocks
    for ev in target.run_to_completion()["h"]:
        tokens += ev.token_ids
        text += ev.text
    expected = greedy_reference("tiny", req.prompt_token_ids, 60, ignore_eos=True)
    assert tokens == expected
    detok = tok.detokenizer()
    assert text == detok.push(expected) + detok.flush()


class FakeRouter:
    """Accepts worker registrations and relays messages: inbox per worker, send() down."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.workers: dict[str, dict] = {}
        self.inbox: dict[str, queue.Queue] = {}
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._conn, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _conn(self, reader, writer) -> None:
        hello = await read_raw(reader)
        wid = hello["id"]
        self.inbox.setdefault(wid, queue.Queue())
        self.workers[wid] = {**hello, "writer": writer}
        writer.write(frame({"v": VERSION, "type": "welcome", "heartbeat_interval_s": 0.2}))
        while (msg := await read_raw(reader)) is not None:
            self.inbox[wid].put(msg)

    def send(self, wid: str, msg: dict) -> None:
        self.loop.call_soon_threadsafe(self.workers[wid]["writer"].write, frame({"v": VERSION, **msg}))

    def wait(self, wid: str, kind: str, rid: str | None = None, timeout_s: float = 30.0,
             sink: list | None = None) -> dict:
        """Next message of ``kind`` (about ``rid``) from ``wid``; others go to ``sink``."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.inbox[wid].get(timeout=max(0.01, deadline - time.monotonic()))
            if msg["type"] == kind and (rid is None or msg.get("rid") == rid):
                return msg
            if sink is not None and msg["type"] != "heartbeat":
                sink.append((wid, msg))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def cluster():
    router = FakeRouter()
    procs = {}
    try:
        for wid in ("dA", "dB"):
            procs[wid] = subprocess.Popen(
                [sys.executable, "-m", "harness.engine.pd.worker", "--role", "decode", "--id", wid, "--router",
                 f"127.0.0.1:{router.port}", "--preset", "tiny", "--parent-pid", str(os.getpid()),
                 "--router-grace-s", "3"], stderr=open(os.devnull, "w") if not os.environ.get("H8_DEBUG") else None)
        deadline = time.monotonic() + 60
        while len(router.workers) < 2:
            assert time.monotonic() < deadline, "workers did not register"
            assert all(p.poll() is None for p in procs.values()), "a worker exited at start"
            time.sleep(0.05)
        yield router
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        router.close()


def start_stream(router: FakeRouter, rid: str) -> GenerateRequest:
    """Prefill in this process and import the request into dA, as a prefill worker would."""
    req = GenerateRequest(rid, tok.encode(PROMPT), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    router.send("dA", {"type": "import", "rid": rid, "prompt_token_ids": req.prompt_token_ids,
                       "params": asdict(req.params), "resume_token_ids": []})
    router.wait("dA", "import_ready", rid)
    a = router.workers["dA"]
    sender = KVSender(rid, 4, Endpoint(*a["kv_addr"], PATH_FABRIC), Endpoint(*a["control_addr"], PATH_CONTROL),
                      TransferConfig(), TransferStats())
    result = EngineCore(EngineConfig(preset="tiny")).prefill_for_transfer(req, on_layer=sender.send_layer)
    sender.finish(result.first_token_id)
    return req


def assemble(events: list[tuple[str, dict]], rid: str) -> tuple[list[int], dict[str, int]]:
    """Tokens by position, checking that both workers agree wherever they overlap."""
    out: dict[int, int] = {}
    per_worker = {"dA": 0, "dB": 0}
    for wid, msg in events:
        if msg["type"] != "tokens" or msg["rid"] != rid:
            continue
        assert msg["error"] is None, msg["error"]
        first = msg["num_output_tokens"] - len(msg["token_ids"])
        for i, t in enumerate(msg["token_ids"]):
            assert out.setdefault(first + i, t) == t, f"workers disagree at token {first + i}"
        per_worker[wid] += len(msg["token_ids"])
    return [out[i] for i in range(len(out))], per_worker


def drain(router: FakeRouter, wid: str, events: list) -> None:
    while not router.inbox[wid].empty():
        msg = router.inbox[wid].get()
        if msg["type"] != "heartbeat":
            events.append((wid, msg))


def prepare_migration(router: FakeRouter, rid: str, after_tokens: int = 20):
    """Stream ``rid`` on dA until it has ``after_tokens`` tokens, then ask dB to prepare its import
    (as the router does). Returns (request, events so far, tokens streamed, num_tokens, migrate_ready)."""
    req = start_stream(router, rid)
    events: list = []
    while sum(len(m["token_ids"]) for _, m in events if m["type"] == "tokens") < after_tokens:
        events.append(("dA", router.wait("dA", "tokens", rid)))
    generated, _ = assemble(events, rid)
    num_tokens = len(req.prompt_token_ids) + len(generated)
    router.send("dB", {"type": "migrate_in", "rid": rid, "request": asdict(req), "num_tokens": num_tokens,
                       "generated": generated})
    return req, events, generated, num_tokens, router.wait("dB", "migrate_ready", rid, sink=events)


def finish_on(router: FakeRouter, wid: str, rid: str, events: list) -> None:
    """Collect ``wid``'s token events of ``rid`` until the stream ends."""
    while True:
        msg = router.wait(wid, "tokens", rid)
        events.append((wid, msg))
        if msg["finished"]:
            return


@pytest.mark.slow
def test_live_migration_continues_the_stream_token_exact_on_the_target(cluster):
    router, rid = cluster, "m1#0"
    req, events, generated, num_tokens, ready = prepare_migration(router, rid)
    assert ready["num_tokens"] == num_tokens
    b = router.workers["dB"]
    router.send("dA", {"type": "migrate_out", "rid": rid, "num_tokens": num_tokens, "target_kv": b["kv_addr"],
                       "target_control": b["control_addr"], "target_id": "dB"})
    done = router.wait("dA", "migrated", rid, sink=events)
    assert done["target"] == "dB" and done["bytes"] > 0 and done["transfer_s"] >= 0
    assert router.wait("dB", "migrate_committed", rid, sink=events)
    finish_on(router, "dB", rid, events)
    drain(router, "dA", events)
    tokens, per_worker = assemble(events, rid)
    assert tokens == greedy_reference("tiny", req.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
    assert per_worker["dB"] >= MAX_TOKENS - per_worker["dA"] and per_worker["dB"] > 0
    # the source freed the request's KV: its heartbeat shows an empty engine
    deadline = time.monotonic() + 10
    while (stats := router.wait("dA", "heartbeat")["stats"])["kv_blocks_used"] or stats["num_running"]:
        assert time.monotonic() < deadline, f"the source kept the migrated request: {stats}"


@pytest.mark.slow
def test_tokens_decoded_during_the_handshake_move_with_the_kv(cluster):
    """The source decodes on while the target prepares: those tokens' KV travels too (up to the
    target's max_kv_tokens), so the target's first token follows the source's last one with no
    position decoded twice."""
    router, rid = cluster, "m4#0"
    req, events, generated, num_tokens, ready = prepare_migration(router, rid)
    assert ready["max_kv_tokens"] > num_tokens - 1
    seen = len(generated)
    while seen < len(generated) + 3:  # the router's snapshot is now behind the source
        msg = router.wait("dA", "tokens", rid)
        events.append(("dA", msg))
        seen = msg["num_output_tokens"]
    b = router.workers["dB"]
    router.send("dA", {"type": "migrate_out", "rid": rid, "num_tokens": num_tokens,
                       "max_kv_tokens": ready["max_kv_tokens"], "target_kv": b["kv_addr"],
                       "target_control": b["control_addr"], "target_id": "dB"})
    done = router.wait("dA", "migrated", rid, sink=events)
    assert done["extra_tokens"] >= 3
    finish_on(router, "dB", rid, events)
    drain(router, "dA", events)
    source_end = max(m["num_output_tokens"] for w, m in events if w == "dA" and m["type"] == "tokens")
    target_first = min(m["num_output_tokens"] - len(m["token_ids"]) for w, m in events
                       if w == "dB" and m["type"] == "tokens")
    assert target_first == source_end == len(generated) + done["extra_tokens"]
    tokens, _ = assemble(events, rid)
    assert tokens == greedy_reference("tiny", req.prompt_token_ids, MAX_TOKENS, ignore_eos=True)


@pytest.mark.slow
def test_a_source_whose_tokens_do_not_continue_the_stream_is_refused(cluster):
    """The END frame's tokens must start at the router's last token: a source that disagrees
    (a bug, or a stale stream) gets a clear refusal and the target frees what it reserved."""
    router, rid = cluster, "m5#0"
    req, _, generated, num_tokens, _ = prepare_migration(router, rid, after_tokens=10)
    # play a wrong source: the right KV, but an END claiming another last token
    kv_tokens = num_tokens - 1
    moved = GenerateRequest(rid, req.prompt_token_ids, req.params, resume_token_ids=generated[:-1])
    b = router.workers["dB"]
    sender = KVSender(transfer_id(rid, kv_tokens), 4, Endpoint(*b["kv_addr"], PATH_FABRIC), None,
                      TransferConfig(max_retries=0), TransferStats())
    EngineCore(EngineConfig(preset="tiny")).prefill_for_transfer(moved, on_layer=sender.send_layer)
    wrong = (generated[-1] + 1) % 256
    with pytest.raises(KVTransferError, match="do not continue the router's stream"):
        sender.finish(wrong, tokens=[wrong])
    router.send("dA", {"type": "abort", "rid": rid})
    deadline = time.monotonic() + 10
    while (stats := router.wait("dB", "heartbeat")["stats"])["kv_blocks_used"]:
        assert time.monotonic() < deadline, f"the target kept the refused import's blocks: {stats}"


@pytest.mark.slow
def test_failed_migration_leaves_the_stream_on_the_source(cluster):
    router, rid = cluster, "m2#0"
    req = start_stream(router, rid)
    events = [("dA", router.wait("dA", "tokens", rid))]
    generated, _ = assemble(events, rid)
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    router.send("dA", {"type": "migrate_out", "rid": rid, "num_tokens": len(req.prompt_token_ids) + len(generated),
                       "target_kv": ["127.0.0.1", dead_port], "target_id": "nowhere",
                       "transfer": {"max_retries": 0, "timeout_s": 1.0}})
    failed = router.wait("dA", "migrate_failed", rid, sink=events)
    assert failed["side"] == "source" and failed["resumed"] is True
    finish_on(router, "dA", rid, events)
    tokens, _ = assemble(events, rid)
    assert tokens == greedy_reference("tiny", req.prompt_token_ids, MAX_TOKENS, ignore_eos=True)


@pytest.mark.slow
def test_a_migrate_out_without_num_tokens_is_refused_and_the_stream_goes_on(cluster):
    """The worker's decoder refuses the malformed command (messages.py logs why); the request is
    neither paused nor lost: it streams to its end on the source."""
    router, rid = cluster, "m3#0"
    start_stream(router, rid)
    router.send("dA", {"type": "migrate_out", "rid": rid, "target_kv": ["127.0.0.1", 9]})
    events: list = []
    finish_on(router, "dA", rid, events)
    tokens, per_worker = assemble(events, rid)
    assert per_worker["dA"] > 0 and events[-1][1]["finished"] and events[-1][1]["num_output_tokens"] == MAX_TOKENS


@pytest.mark.slow
def test_fault_commands_over_the_control_connection(cluster):
    router = cluster
    router.send("dA", {"type": "hbm_fill", "fault_id": "f1", "share": 0.4})
    state = router.wait("dA", "fault_state")
    assert state["active"] and state["kv_used_ratio"] == pytest.approx(state["blocks"] / router.workers["dA"]
                                                                       ["kv_blocks_total"])
    deadline = time.monotonic() + 10
    while router.wait("dA", "heartbeat")["stats"]["kv_used_ratio"] < 0.39:
        assert time.monotonic() < deadline, "heartbeat never showed the fill"
    router.send("dA", {"type": "hbm_release", "fault_id": "f1"})
    assert router.wait("dA", "fault_state")["kv_used_ratio"] == 0.0
    router.send("dA", {"type": "set_offload", "enabled": True, "threshold": 0.85})
    while not router.wait("dA", "heartbeat")["stats"]["offload_enabled"]:
        assert time.monotonic() < deadline + 10
