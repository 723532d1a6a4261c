"""The cluster file's API key reaches every request the harness sends (streaming client, Locust
users, metric scrapes) as `Authorization: Bearer`, against a real HTTP server that refuses
requests without it; and it is never written to the load profile."""

import json
from http.server import BaseHTTPRequestHandler

import pytest

from harness.probes.loadgen.load import LoadRunner
from harness.probes.metrics.prometheus import PrometheusScraper
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from harness.probes.loadgen.workload import LoadProfile
from tests.probes.conftest import http_server

KEY = "sk-test-0123"


class _KeyedServer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def _authorised(self) -> bool:
        self.seen.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._send(401, "application/json", b'{"error": {"message": "missing API key"}}')
        return False

    def _send(self, status, ctype, body):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if not self._authorised():
            return
        if self.path == "/v1/models":
            self._send(200, "application/json", b'{"data": [{"id": "m"}]}')
        else:  # /metrics
            self._send(200, "text/plain", b"# TYPE up gauge\nup 1\n")

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self._authorised():
            return
        chunks = [json.dumps({"choices": [{"text": t, "index": 0, "finish_reason": None}]}) for t in ("a", "b")]
        body = "".join(f"data: {c}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _KeyedServer.seen = []
    with http_server(_KeyedServer) as url:
        yield url


def test_streaming_client_sends_the_key_and_without_it_is_refused(server):
    with StreamingClient(server, api_key=KEY) as client:
        rec = client.send(CompletionRequest(prompt="hi", max_tokens=2))
    assert rec.ok and rec.text == "ab"
    with StreamingClient(server, model="m") as client:
        rec = client.send(CompletionRequest(prompt="hi", max_tokens=2))
    assert not rec.ok and rec.http_status == 401
    assert ("/v1/completions", f"Bearer {KEY}") in _KeyedServer.seen


def test_scraper_sends_the_key(server):
    scraper = PrometheusScraper(f"{server}/metrics", api_key=KEY)
    assert [s.name for s in scraper.scrape_once()] == ["up"]
    assert _KeyedServer.seen == [("/metrics", f"Bearer {KEY}")]


@pytest.mark.slow  # starts Locust
def test_locust_users_send_the_key_and_the_profile_does_not_hold_it(server, tmp_path):
    profile = LoadProfile(users=1, duration_s=2, max_tokens=2)
    runner = LoadRunner(server, profile, output_dir=tmp_path, api_key=KEY)
    records = runner.run()
    assert records and all(r.ok for r in records), [r.error_message for r in records][:3]
    assert KEY not in profile.to_json() and KEY not in " ".join(runner.command())
    assert all(auth == f"Bearer {KEY}" for _, auth in _KeyedServer.seen)


def test_the_cluster_handle_builds_keyed_clients_with_the_engine_profile(server, tmp_path, monkeypatch):
    from harness.cluster import ClusterHandle
    from harness.clusterfile import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text(f"kind: external\nengine: vllm\nmodel: m\nauth: {{api_key_env: T_KEY}}\n"
                    f"endpoints: {{api: {server}, metrics: {server}/metrics}}\n")
    spec = load_cluster(path)
    handle = ClusterHandle(spec, spec.checklist(), server, f"{server}/metrics", None)
    monkeypatch.setenv("T_KEY", KEY)
    with handle.streaming_client() as client:
        assert client.model == "m" and client.send(CompletionRequest(prompt="x", max_tokens=2)).ok
    scraper = handle.scraper()
    assert scraper.profile["kv_usage"] == "vllm:kv_cache_usage_perc" and scraper.scrape_once()
    assert all(auth == f"Bearer {KEY}" for _, auth in _KeyedServer.seen)
