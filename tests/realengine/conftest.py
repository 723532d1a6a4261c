"""Fixtures of the real-engine tests: a real vLLM cluster started by clusters/vllm/launch.py, a real NVIDIA
Dynamo cluster started by clusters/dynamo/launch.py, each shared by the modules in a row that ask for the
same one (tests/realengine/pool.py says how, each module's docstring whether it shares and why).

The virtualenvs are made by ``clusters/vllm/setup.sh`` and ``clusters/dynamo/setup.sh`` (``.ci/run`` does
both); ``HARNESS_VLLM_VENV`` / ``HARNESS_DYNAMO_VENV`` point elsewhere. Without one, its tests skip, except
in CI (``CI=true``), where its absence is a failure.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from harness.scenarios.migration_on_loss import migration_count
from harness.probes.client.request_shape import request_shape
from harness.probes.client.streaming import CompletionRequest, StreamingClient
# REPO, healthy and pgrep are also imported from here by the test modules
from tests.realengine.pool import (FIXTURES, REPO, ClusterPool, cluster_key, healthy, next_user_key,  # noqa: F401
                                   order_by_cluster, pgrep)


def vllm_venv() -> Path:
    return Path(os.environ.get("HARNESS_VLLM_VENV", REPO / ".venv-vllm"))


def dynamo_venv() -> Path:
    return Path(os.environ.get("HARNESS_DYNAMO_VENV", REPO / ".venv-dynamo"))


def _require(venv: Path, needs: list[Path], setup: str) -> Path:
    if all(p.exists() for p in needs):
        return venv
    reason = f"no {setup.split('/')[1]} venv at {venv}: make it with {setup} {venv}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (.ci/run makes it; in CI its absence is a failure)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def require_vllm() -> Path:
    venv = vllm_venv()
    return _require(venv, [venv / "bin" / "vllm-router", venv / "bin" / "python"], "clusters/vllm/setup.sh")


@pytest.fixture(scope="session")
def require_dynamo() -> Path:
    venv = dynamo_venv()
    site = next((venv / "lib").glob("python3*/site-packages"), venv / "lib")
    return _require(venv, [venv / "bin" / "python", site / "dynamo" / "mocker"], "clusters/dynamo/setup.sh")


@pytest.fixture(scope="session")
def cluster_pool():
    """The started clusters the modules share (tests/realengine/pool.py); whatever it holds at the end is stopped."""
    pool = ClusterPool()
    try:
        yield pool
    finally:
        pool.release_all()


def _shared(request, pool: ClusterPool, fixture: str, venv: Path, tmp_path_factory):
    key = cluster_key(request.module, FIXTURES[fixture])
    cluster = pool.get(key, venv, tmp_path_factory.mktemp(key[0]))
    yield cluster
    if next_user_key(request, fixture) != key:   # the next module to run asks for another one (or none does)
        pool.release(key[0])


@pytest.fixture(scope="module")
def vllm_cluster(request, require_vllm, tmp_path_factory, cluster_pool):
    """The module's ``VLLM_MODE`` (``VLLM_MODEL_PRESET``, default tiny; ``VLLM_KV_CACHE_TOKENS``, default vLLM's
    own pool), started once for every module in a row that asks for the same (tests/realengine/pool.py)."""
    yield from _shared(request, cluster_pool, "vllm_cluster", require_vllm, tmp_path_factory)


@pytest.fixture(scope="module")
def dynamo_cluster(request, require_dynamo, tmp_path_factory, cluster_pool):
    """The module's ``DYNAMO_MODE`` (agg, disagg, many), shared like ``vllm_cluster``."""
    yield from _shared(request, cluster_pool, "dynamo_cluster", require_dynamo, tmp_path_factory)


def pytest_collection_modifyitems(items):
    order_by_cluster(items)   # modules that share a cluster run one after another


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (samples only)."""
    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@dataclass
class StreamOutcome:
    pieces: list[str]  # non-empty content deltas (vLLM may merge several tokens into one when busy)
    error: str | None  # the error event's or HTTP error's text
    completion_tokens: int | None  # from the final usage chunk


def stream_chat_outcome(api: str, model: str, content: str, max_tokens: int = 16) -> StreamOutcome:
    """One streamed chat completion. A stream that ends without [DONE] and without an error event (cut
    silently) fails the test: nothing may be lost silently."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    pieces, done, error, tokens = [], False, None, None
    with httpx.stream("POST", f"{api}/v1/chat/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return StreamOutcome([], f"HTTP {resp.status_code}: {resp.read()[:300]!r}", None)
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    error = str(event["error"])
                pieces += [c["delta"].get("content") or "" for c in event.get("choices", [])]
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    assert done or error, f"the stream was cut with no error event after {len(pieces)} pieces"
    return StreamOutcome([p for p in pieces if p], error, tokens)


def stream_chat(api: str, model: str, content: str, max_tokens: int = 16) -> StreamOutcome:
    """One streamed chat completion that must succeed with all ``max_tokens`` tokens (the model never
    picks end-of-sequence: clusters/vllm/make_model.py)."""
    outcome = stream_chat_outcome(api, model, content, max_tokens)
    assert outcome.error is None, outcome.error
    assert outcome.pieces and outcome.completion_tokens == max_tokens, outcome
    return outcome


# -- Dynamo: streams decoding while a worker dies --------------------------------------------------------


def _decode_concurrently(api: str, n: int, max_tokens: int, started: int) -> tuple[list, list[threading.Thread]]:
    """``n`` streams in threads; returns once each has ``started`` tokens (their records fill in later)."""
    records: list = [None] * n
    ready = [threading.Event() for _ in range(n)]

    def run(i: int) -> None:
        def seen(rec, _msg):
            if sum(rec.chunk_tokens) >= started:
                ready[i].set()
        try:
            with StreamingClient(api, request_shape=request_shape("dynamo"), timeout_s=120) as client:
                records[i] = client.send(CompletionRequest(f"survive {i}", max_tokens=max_tokens, ignore_eos=True),
                                         on_message=seen)
        finally:
            ready[i].set()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for e in ready:
        assert e.wait(60)
    return records, threads


@dataclass
class KillOutcome:
    records: list          # the harness's streams (RequestRecord)
    migrated: float        # rise of dynamo_frontend_model_migration_total{migration_type="ongoing_request"}
    kill_perf_ns: int      # time.perf_counter_ns() of the SIGKILL (the wall clock may step: seen here once, 0.6 s)
    independent: list[list[float]]  # per independent stream: time.perf_counter() of each SSE line with a token


def _independent_stream(api: str, i: int, max_tokens: int, out: list[list[float]], started: threading.Event) -> None:
    """A client that shares no code with the harness: raw httpx lines, its own clock, a token when usage rises."""
    arrivals: list[float] = []
    body = {"model": "tiny-llama", "prompt": f"independent {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    try:
        with httpx.stream("POST", f"{api}/v1/completions", json=body, timeout=120) as resp:
            count = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    now = (event.get("usage") or {}).get("completion_tokens", 0)
                    if event.get("choices") and now > count:
                        count = now
                        arrivals.append(time.perf_counter())
                        if count >= 20:
                            started.set()
    finally:
        started.set()
        out.append(arrivals)


def kill_under_streams(cluster, victim: str, n: int = 6, independent: int = 0) -> KillOutcome:
    """SIGKILL ``victim`` while ``n`` of the harness's streams (and ``independent`` raw ones) decode; wait for
    the supervisor to bring it back."""
    pid_file = Path(cluster.ready["workers"][victim]["pid_file"])
    metrics = cluster.ready["metrics"]
    # streams moved only (ongoing_request), never requests re-sent before their first token (new_request)
    before = migration_count(metrics, "dynamo", quantity="migrations_ongoing")
    raw: list[list[float]] = []
    flags = [threading.Event() for _ in range(independent)]
    raw_threads = [threading.Thread(target=_independent_stream, args=(cluster.api, i, 400, raw, flags[i]))
                   for i in range(independent)]
    for t in raw_threads:
        t.start()
    records, threads = _decode_concurrently(cluster.api, n, max_tokens=400, started=20)
    for e in flags:
        assert e.wait(60)
    old = int(pid_file.read_text())
    kill_perf_ns = time.perf_counter_ns()
    os.kill(old, signal.SIGKILL)
    for t in threads + raw_threads:
        t.join(120)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and int(pid_file.read_text()) != old and healthy(cluster.worker(victim)["health"])):
        assert time.monotonic() < deadline, cluster.launcher_log()[-3000:]
        time.sleep(0.5)
    return KillOutcome(records, migration_count(metrics, "dynamo", quantity="migrations_ongoing") - before,
                       kill_perf_ns, raw)
