"""Back means served: a worker resumed after a hang is back only when a request SENT AFTER the
revert gets tokens from it, never when a counter that work queued during the hang moves.

The worker is a real HTTP server on loopback (OpenAI streaming completions, /health, Prometheus
/metrics) with one engine that serves requests one at a time, first come first served, like a
scheduler whose batch is full. "Hung" holds every request at the engine's door; the revert lets them
in: the requests queued during the hang drain one by one, each raising ``vllm:prompt_tokens_total``
as it is admitted, while a request sent after the revert waits behind them and gets no token until
they are done (what was measured behind a plain reverse proxy, issue 33). Assertions are on the
order of events the server logged, never on how long anything took."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest

from harness.probes.workers.rejoin import RejoinWatch
from harness.probes.workers.rejoin_probe import own_api, straight_probe
from tests.probes.conftest import http_server

SERVE_S = 0.5      # the engine's time per request: the queued ones take QUEUED * SERVE_S to drain
QUEUED = 6


@dataclass
class Engine:
    """One request at a time, in arrival order; while hung (``door_open`` False) none is admitted."""

    lock: threading.Condition = field(default_factory=threading.Condition)
    door_open: bool = False
    tickets: int = 0
    serving: int = 0
    prompt_tokens: int = 0
    first_tokens: list[tuple[float, float]] = field(default_factory=list)   # (arrived, first token) walls

    def set_open(self, door_open: bool) -> None:
        with self.lock:
            self.door_open = door_open
            self.lock.notify_all()

    def serve(self, arrived: float) -> float:
        with self.lock:
            ticket, self.tickets = self.tickets, self.tickets + 1
            self.lock.wait_for(lambda: self.door_open and self.serving == ticket)
            self.prompt_tokens += 10                     # admitted: its prompt counted, no token yet
        time.sleep(SERVE_S)
        first = time.time()
        with self.lock:
            self.first_tokens.append((arrived, first))
            self.serving += 1
            self.lock.notify_all()
        return first


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Worker(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/metrics":
                self._send(f"# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total {engine.prompt_tokens}\n"
                           .encode())
            else:
                self._send(b"ok")

        def do_POST(self) -> None:  # noqa: N802
            arrived = time.time()
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            engine.serve(arrived)
            chunk = {"id": "c", "object": "text_completion", "model": "m",
                     "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            self._send(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

        def log_message(self, *args: object) -> None:
            pass
    return Worker


@pytest.fixture
def hung_worker() -> Iterator[tuple[Engine, str, list[threading.Thread]]]:
    """A hung worker with QUEUED requests waiting at its door (the load sent them during the hang)."""
    engine = Engine()
    with http_server(handler(engine)) as url:
        senders = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                    kwargs={"json": {"prompt": f"queued {i}"}, "timeout": 60}, daemon=True)
                   for i in range(QUEUED)]
        for t in senders:
            t.start()
        while engine.tickets < QUEUED:   # every one has reached the engine's door
            time.sleep(0.01)
        yield engine, url, senders
        engine.set_open(True)
        for t in senders:
            t.join(timeout=60)


def cluster_of(url: str) -> SimpleNamespace:
    worker = SimpleNamespace(name="vllm-0", api=url, metrics=url + "/metrics")
    spec = SimpleNamespace(metric_profile="vllm")
    return SimpleNamespace(api_url="http://127.0.0.1:1", workers=[worker, SimpleNamespace(name="vllm-1", api="x")],
                           spec=spec, metrics_url=None, model="m", engine="vllm", api_key=lambda: None,
                           auth_headers=lambda: {})


def test_queued_work_draining_is_not_back_until_a_request_sent_after_the_revert_gets_a_token(hung_worker):
    """Planted defect: back read from the resumed worker's prompt-token counter (the old rule, kept
    here as ``restarted=True``: a new process's counters). It says back while the queued requests
    drain, before any request sent after the revert got a token; the rule under test waits for its
    own request, sent straight to the worker after the revert, and for new traffic after it."""
    engine, url, _ = hung_worker
    cluster = cluster_of(url)
    worker = cluster.workers[0]
    assert own_api(cluster, worker)
    engine.set_open(True)                    # the revert (SIGCONT): the queue starts draining
    reverted = time.time()
    traffic_stop = threading.Event()

    def traffic() -> None:                   # the cluster keeps sending it work after the revert
        while not traffic_stop.wait(0.2):
            threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                             kwargs={"json": {"prompt": "new"}, "timeout": 60}, daemon=True).start()

    threading.Thread(target=traffic, daemon=True).start()
    fooled = RejoinWatch("vllm-0", worker_api=url, worker_metrics=url + "/metrics", profile="vllm",
                         router_metrics=None, limit_s=60.0, poll_s=0.05, restarted=True)   # counters only
    watch = RejoinWatch.for_worker(cluster, worker, 60.0, restarted=False, poll_s=0.05)
    try:
        old = fooled.wait(60)
        new = watch.wait(60)
    finally:
        traffic_stop.set()
        watch.close()
    first_new_token = min(first for arrived, first in engine.first_tokens if arrived >= reverted)
    # the trap was real: the counter rose (queued work admitted) before any post-revert request got a token
    assert old.back and old.serving_wall < first_new_token
    # served: by a request sent after the revert, at or after the first post-revert token
    assert new.back and new.served_how.startswith("a request sent straight to ") and new.probes >= 1
    assert new.served_wall >= first_new_token > reverted
    # taken back: traffic counted after it was served
    assert new.serving_wall >= new.traffic_wall >= new.served_wall and new.seen_by.startswith("vllm:prompt_tokens")
    assert new.sentence().startswith("the cluster took vllm-0 back ") and "served +" in new.sentence()


def test_a_worker_that_never_serves_a_new_request_is_not_back_however_its_counter_moves(hung_worker):
    """Planted defect: the queue's drain (the counter rising) read as back. The worker hangs again
    after two of the queued requests: its counter rose, no request sent after the revert is served."""
    engine, url, _ = hung_worker
    cluster = cluster_of(url)
    engine.set_open(True)                    # the revert
    watch = RejoinWatch.for_worker(cluster, cluster.workers[0], 1.0, restarted=False, poll_s=0.05)
    watch.start()                            # its probe waits behind the queued requests
    while engine.serving < 2:                # two queued requests drained, the counter rose
        time.sleep(0.01)
    engine.set_open(False)                   # ...and it hangs again before reaching the probe
    try:
        r = watch.wait(1.0)
    finally:
        watch.close()
    assert engine.prompt_tokens > 0 and not r.back and r.served_wall is None and r.observable
    assert r.sentence().startswith("vllm-0 served no request sent after the revert for ")


def test_a_worker_behind_the_clusters_api_has_no_api_of_its_own():
    """Planted defect: ``own_api`` comparing URLs without their trailing slash removed, or not against
    the other workers': a Dynamo mocker (its ``api`` the frontend's) would be "probed" through the
    frontend, where any worker's token would count as this one's."""
    cluster = SimpleNamespace(api_url="http://127.0.0.1:8400/", workers=[
        SimpleNamespace(name="dynamo-0", api="http://127.0.0.1:8400"),
        SimpleNamespace(name="dynamo-1", api="http://127.0.0.1:8400")])
    assert not own_api(cluster, cluster.workers[0])
    shared = SimpleNamespace(api_url="http://lb:80", workers=[SimpleNamespace(name="a", api="http://w:1"),
                                                               SimpleNamespace(name="b", api="http://w:1/")])
    assert not own_api(shared, shared.workers[0])
    assert callable(straight_probe(cluster_of("http://127.0.0.1:1"), cluster.workers[0]))
