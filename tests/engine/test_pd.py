"""PD disaggregation end to end: real router and worker processes, real KV transfer over TCP,
real signals. Every completion is checked token-exactly against the oracle."""

from __future__ import annotations

import functools
import signal
import threading
import time

import httpx
import pytest

from harness.engine.core.oracle import greedy_reference
from harness.engine.pd.router_config import RouterConfig
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.pd.topology import Topology
from harness.probes.client.streaming import CompletionRequest, StreamingClient

pytestmark = pytest.mark.slow
PRESET = "tiny"


@functools.lru_cache(maxsize=None)
def oracle(prompt: str, max_tokens: int, ignore_eos: bool = True) -> list[int]:
    return greedy_reference(PRESET, ByteTokenizer().encode(prompt), max_tokens, ignore_eos=ignore_eos)


def request(prompt: str, max_tokens: int) -> CompletionRequest:
    return CompletionRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True)


# worker -> tokens streamed, per running stream of send_all, from the streams' own chunks (served_by):
# a heartbeat (every second) can report a fast stream running only after it ended
STREAMING: dict[tuple[int, int], tuple[str, int]] = {}


def send_all(base_url: str, reqs: list[CompletionRequest]) -> list:
    """Send concurrently from threads; returns the RequestRecords in order."""
    out = [None] * len(reqs)

    def one(i: int) -> None:
        key = (id(out), i)

        def seen(rec, msg) -> None:
            if isinstance(msg.get("served_by"), str) and rec.chunk_tokens:
                STREAMING[key] = (msg["served_by"], sum(rec.chunk_tokens))

        try:
            with StreamingClient(base_url, model=PRESET, read_timeout_s=60) as client:
                out[i] = client.send(reqs[i], on_message=seen)
        finally:
            STREAMING.pop(key, None)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    return threads, out


def join(threads, timeout_s: float = 120.0) -> None:
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a client request hung"


def streaming_decode(min_tokens: int = 4) -> list[str]:
    """Decode workers a running stream of send_all has at least ``min_tokens`` tokens from."""
    return [w for w, n in list(STREAMING.values()) if n >= min_tokens and w.startswith("decode")]


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)  # polling interval of the admin API
    raise AssertionError(f"timed out waiting for {what}")


def assert_exact(rec, prompt: str, max_tokens: int) -> None:
    assert rec.status == "ok", (rec.status, rec.error_message)
    assert rec.token_ids == oracle(prompt, max_tokens), f"{prompt!r} diverged from the oracle"


def worker(topo: Topology, wid: str) -> dict:
    return next(w for w in topo.workers() if w["id"] == wid)


@pytest.fixture(scope="module")
def topo():
    with Topology(prefill=2, decode=2, preset=PRESET) as t:
        yield t
    for p in [t._router, *t._procs.values()]:
        assert p.popen.poll() is not None, f"{p.id} was not reaped"


@pytest.fixture
def healthy(topo):
    """Each test starts with all four workers in the routing table (restarting any a test broke)."""
    for wid in topo.worker_ids():
        w = worker(topo, wid)
        if w["health"] != "healthy" or w["pid"] != topo.pid(wid) or not topo._proc(wid).alive():
            topo.restart(wid)
    return topo


def test_outputs_are_token_exact_against_the_oracle(healthy):
    prompts = [f"The quick brown fox {i} jumps" for i in range(6)]
    threads, recs = send_all(healthy.api_url, [request(p, 24) for p in prompts])
    join(threads)
    for p, rec in zip(prompts, recs):
        assert_exact(rec, p, 24)
        assert rec.served_by and rec.served_by[0].startswith("decode-")
    # Workers report their transfer counters with their heartbeats (every second): wait for one.
    metric = 'pdengine_kv_transfer_transfers_total{path="fabric"'
    wait_for(lambda: metric in httpx.get(f"{healthy.api_url}/metrics").text, what="transfer counters in /metrics")


def test_sigkill_decode_while_streaming_resumes_token_exact(healthy):
    prompts = [f"Resilience story number {i}:" for i in range(4)]
    # long enough to be seen running: heartbeats report num_running up to a second late
    threads, recs = send_all(healthy.api_url, [request(p, 900) for p in prompts])
    victim = wait_for(streaming_decode, what="a decode worker streaming")[0]
    since = max((e["seq"] for e in healthy.events()), default=0)
    killed_at = time.monotonic()
    healthy.kill(victim, signal.SIGKILL)
    new = StreamingClient(healthy.api_url, model=PRESET).send(request("fresh request", 4))
    assert_exact(new, "fresh request", 4)
    join(threads)
    for p, rec in zip(prompts, recs):
        assert_exact(rec, p, 900)
    # Streams on the victim continued on another decode worker. (A health decision may also have
    # live-migrated a stream before the kill, so the victim need not be the first server.)
    # (served_by lists distinct workers in first-seen order.)
    resumed = [rec for rec in recs if victim in rec.served_by and len(rec.served_by) >= 2]
    assert resumed, [rec.served_by for rec in recs]
    events = healthy.events(since)
    down = next(e for e in events if e["type"] == "worker_down" and e["worker"] == victim)
    assert down["reason"] == "connection_lost" and down["monotonic"] - killed_at < 3.0
    assert {e["type"] for e in events} >= {"reschedule", "resumed"}


def test_hung_prefill_sends_its_queued_requests_elsewhere(healthy):
    since = max((e["seq"] for e in healthy.events()), default=0)
    healthy.kill("prefill-0", signal.SIGSTOP)  # its queue can only grow until it is declared hung
    try:
        prompts = [f"Queued prompt {i} " * 20 for i in range(6)]
        threads, recs = send_all(healthy.api_url, [request(p, 8) for p in prompts])
        join(threads)
    finally:
        healthy.kill("prefill-0", signal.SIGKILL)
    for p, rec in zip(prompts, recs):
        assert_exact(rec, p, 8)
    events = healthy.events(since)
    down = next(e for e in events if e["type"] == "worker_down" and e["worker"] == "prefill-0")
    moved = [e for e in events if e["type"] == "reschedule" and e["from_worker"] == "prefill-0"]
    assert down["reason"] == "no_progress" and down["affected"] and len(moved) == len(down["affected"])
    assert all(e["to_prefill"] == "prefill-1" for e in moved)


def test_sigstop_is_detected_routed_around_and_rejoins_after_sigcont(healthy):
    # the stream's own chunks name its decode worker (heartbeats report num_running up to a second
    # late), and the stream is long enough to be running when the worker stops
    threads, recs = send_all(healthy.api_url, [request("A hung worker story", 900)])
    victim = wait_for(streaming_decode, what="a decode worker streaming")[0]
    since = max((e["seq"] for e in healthy.events()), default=0)
    stopped_at = time.monotonic()  # the router shares this clock
    healthy.kill(victim, signal.SIGSTOP)
    try:
        down = wait_for(lambda: [e for e in healthy.events(since) if e["type"] == "worker_down"],
                        what="the hang to be detected")[0]
        # progress beats stopped: declared hung before the heartbeat timeout would have noticed
        assert (down["worker"], down["reason"]) == (victim, "no_progress")
        assert down["monotonic"] - stopped_at < RouterConfig().heartbeat_timeout_s
        rec = StreamingClient(healthy.api_url, model=PRESET).send(request("routed around", 6))
        assert_exact(rec, "routed around", 6)
        assert rec.served_by != [victim]
        join(threads)
        assert_exact(recs[0], "A hung worker story", 900)
    finally:
        healthy.kill(victim, signal.SIGCONT)
    up = wait_for(lambda: [e for e in healthy.events(since) if e["type"] == "worker_up" and e["worker"] == victim],
                  what="the worker to rejoin")[0]
    assert up["rejoined"] and worker(healthy, victim)["health"] == "healthy"


def test_corrupt_frame_is_detected_retried_and_never_decoded(healthy):
    def counter(name: str, label: str) -> float:
        text = httpx.get(f"{healthy.api_url}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"pdengine_kv_transfer_{name}_total{{") and label in line)

    rejected0, retries0 = counter("rejected_frames", 'reason="crc"'), counter("retries", 'path="fabric"')
    r = httpx.post(f"{healthy.admin_url}/workers/prefill-0/fault", json={"corrupt_frames": 1})
    assert r.status_code == 200, r.text
    rec = StreamingClient(healthy.api_url, model=PRESET).send(request("checksummed prompt", 16))
    assert_exact(rec, "checksummed prompt", 16)
    wait_for(lambda: counter("rejected_frames", 'reason="crc"') == rejected0 + 1
             and counter("retries", 'path="fabric"') == retries0 + 1, what="the rejection in /metrics")
    assert any(e["type"] == "transfer_retry" for e in healthy.events())


def test_fault_hook_rejects_bad_input(healthy):
    r = httpx.post(f"{healthy.admin_url}/workers/prefill-0/fault", json={"corrupt_frames": -1})
    assert r.status_code == 400 and "corrupt_frames" in r.json()["error"]["message"]
    r = httpx.post(f"{healthy.admin_url}/workers/nope/fault", json={"corrupt_frames": 1})
    assert r.status_code == 404


def test_no_capacity_left_ends_streams_with_an_explicit_error():
    with Topology(prefill=1, decode=1, preset=PRESET, router_config={"reschedule_wait_s": 0.5}) as topo:
        # long enough to outlast the kill: heartbeats report num_running up to a second late
        threads, recs = send_all(topo.api_url, [request("Nowhere to go", 900)])
        wait_for(lambda: "decode-0" in streaming_decode(), what="decode-0 streaming")
        topo.kill("decode-0", signal.SIGKILL)
        join(threads, 30)
        assert recs[0].status == "stream_error" and "no worker could take" in recs[0].error_message
        assert recs[0].token_ids == oracle("Nowhere to go", len(recs[0].token_ids))
        topo.restart("decode-0")  # a restarted worker rejoins the same router
        assert_exact(StreamingClient(topo.api_url, model=PRESET).send(request("back again", 5)), "back again", 5)
