"""AdminClient: typed results, the requests it sends, and errors that name the endpoint.

The unit tests talk HTTP to a real local server that answers in the bundled engine's shapes
(recorded from harness/engine/pd/router_server.py and resilience_admin.py); the slow test runs the
client against a real PD topology."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from harness.errors import ProbeError
from harness.engine.admin.client import AdminClient, AdminError
from harness.engine.admin.models import AdminWorker, DegradationState, FaultState, MigrationResult

WORKER = {"id": "decode-0", "role": "decode", "pid": 4242, "health": "healthy", "down_reason": None,
          "addresses": {"control": "127.0.0.1:1", "kv": "127.0.0.1:2"}, "queue_depth": 0, "active_requests": 2,
          "kv_blocks_used": 10, "kv_blocks_total": 100, "kv_blocks_reserved": 0, "kv_used_ratio": 0.1,
          "kv_blocks_poisoned": 0, "kv_blocks_quarantined": 0, "spec_enabled": False, "offload": {},
          "num_running": 2, "generation_tokens_total": 7, "heartbeat_age_s": 0.01, "steps": 3}
EVENTS = [{"seq": 1, "type": "worker_up", "wall_time": 1.0, "monotonic": 1.0, "worker": "decode-0"},
          {"seq": 2, "type": "worker_down", "wall_time": 2.0, "monotonic": 2.0, "worker": "decode-0",
           "reason": "connection_lost"}]


class Engine(ThreadingHTTPServer):
    """Answers ``routes[(method, path)] = (status, json)`` and records every request it got."""

    def __init__(self, routes):
        self.routes, self.seen = routes, []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def _answer(self):
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.seen.append((self.command, parts.path, parse_qs(parts.query), body))
        status, payload = self.server.routes.get((self.command, parts.path), (404, {"detail": "Not Found"}))
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    servers = []

    def start(routes):
        server = Engine(routes)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return server

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join()


def test_workers_are_typed_and_still_read_like_the_json(engine):
    e = engine({("GET", "/admin/workers"): (200, [WORKER, {**WORKER, "id": "decode-1", "health": "down",
                                                          "pid": None, "active_requests": 0, "num_running": 0}])})
    with AdminClient(e.url) as admin:  # the router's address, no /admin: the client adds it
        a, b = admin.workers()
        assert isinstance(a, AdminWorker) and (a.id, a.role, a.pid, a.healthy, a.busy) == ("decode-0", "decode", 4242, True, True)
        assert (b.pid, b.healthy, b.busy) == (None, False, False)
        assert a["addresses"]["kv"] == "127.0.0.1:2" and a.get("nope", 5) == 5 and a.raw == WORKER
        assert json.loads(json.dumps(a.raw)) == WORKER
        assert admin.worker("decode-1").health == "down" and admin.worker("prefill-9") is None


def test_events_pass_since_and_type_and_stay_dicts(engine):
    e = engine({("GET", "/admin/events"): (200, EVENTS)})
    with AdminClient(e.url + "/admin/") as admin:
        assert admin.events() == EVENTS
        admin.events(since=1, type="worker_down")
    assert [q for _, _, q, _ in e.seen] == [{}, {"since": ["1"], "type": ["worker_down"]}]


def test_resilience_endpoints_send_the_documented_bodies(engine):
    state = {"fault_id": "f1", "kind": "ecc_poison", "worker": "decode-0", "active": True, "blocks": [3, 4],
             "affected": ["cmpl-1"], "kv_used_ratio": 0.2}
    e = engine({("GET", "/admin/degradation"): (200, {"level": 2, "name": "L2", "enabled": True, "thresholds": {},
                                                      "signals": {"hbm": 0.9}, "history": [], "counters": {}}),
                ("POST", "/admin/speculative"): (200, {"enabled": True}),
                ("POST", "/admin/faults/ecc_poison"): (200, state),
                ("DELETE", "/admin/faults/ecc_poison/f1"): (200, {**state, "active": False}),
                ("POST", "/admin/migrate"): (200, {"request_id": "cmpl-1", "source": "decode-0",
                                                   "target": "decode-1", "reason": "admin", "total_s": 0.01,
                                                   "num_tokens": 5})})
    with AdminClient(e.url) as admin:
        d = admin.degradation()
        assert isinstance(d, DegradationState) and d.level == 2 and d.signals["hbm"] == 0.9
        assert admin.set_speculative(True) is True
        f = admin.ecc_poison("decode-0", count=2)
        assert isinstance(f, FaultState) and f.active and f.blocks == [3, 4] and f.affected == ["cmpl-1"]
        assert admin.release_fault("ecc_poison", "f1").active is False
        m = admin.migrate("decode-0", rid="cmpl-1")
        assert isinstance(m, MigrationResult) and m.target == "decode-1" and m.get("target") == "decode-1"
    assert [(m, p, b) for m, p, _, b in e.seen if m != "GET"] == [
        ("POST", "/admin/speculative", {"enabled": True}),
        ("POST", "/admin/faults/ecc_poison", {"worker": "decode-0", "count": 2}),
        ("DELETE", "/admin/faults/ecc_poison/f1", None),
        ("POST", "/admin/migrate", {"source": "decode-0", "rid": "cmpl-1"})]


def test_a_refusal_names_endpoint_status_and_the_engines_message(engine):
    e = engine({("POST", "/admin/migrate"): (409, {"error": {"message": "no decoding request on decode-0",
                                                             "code": "nothing_to_migrate", "param": "source"}})})
    with AdminClient(e.url) as admin, pytest.raises(AdminError) as err:
        admin.migrate("decode-0")
    exc = err.value
    assert (exc.status, exc.code, exc.param) == (409, "nothing_to_migrate", "source")
    assert f"POST {e.url}/admin/migrate answered HTTP 409: no decoding request on decode-0" in str(exc)


def test_a_missing_admin_api_says_which_engine_serves_it(engine):
    e = engine({})
    with AdminClient(e.url) as admin, pytest.raises(AdminError, match="GET .*/admin/workers answered HTTP 404") as err:
        admin.workers()
    assert "bundled engine" in err.value.fix


@pytest.mark.parametrize("payload, needle", [
    ([{"id": "decode-0", "role": "decode"}], "no 'health'"),
    ([{**WORKER, "pid": "4242"}], "'pid' is '4242', expected int"),
    ([{**WORKER, "spec_enabled": 1}], "'spec_enabled' is 1, expected bool"),
    ({"workers": "x"}, "did not return a list"),
    ("<html>", "no JSON"),
])
def test_an_answer_that_is_not_the_bundled_engines_names_the_field(engine, payload, needle):
    e = engine({("GET", "/admin/workers"): (200, payload)})
    with AdminClient(e.url) as admin, pytest.raises(ProbeError, match=needle) as err:
        admin.workers()
    assert "/admin/workers" in str(err.value)


def test_events_that_are_not_events_are_refused(engine):
    e = engine({("GET", "/admin/events"): (200, [{"type": "x"}])})
    with AdminClient(e.url) as admin, pytest.raises(ProbeError, match="int 'seq'"):
        admin.events()


def test_transport_failure_names_the_endpoint():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with AdminClient(f"http://127.0.0.1:{port}", timeout_s=2) as admin:
        with pytest.raises(ProbeError, match=rf"GET http://127.0.0.1:{port}/admin/degradation failed: ConnectError"):
            admin.degradation()
        with pytest.raises(ProbeError, match="no fault kind 'gpu'"):
            admin.release_fault("gpu", "f1")


@pytest.mark.slow
def test_against_a_real_pd_topology(tmp_path):
    from harness.engine.pd.topology import Topology

    with Topology(prefill=1, decode=1, preset="tiny", log_dir=tmp_path / "pd") as topo, \
            AdminClient(topo.admin_url, timeout_s=30) as admin:
        workers = {w.id: w for w in admin.workers()}
        assert {w.role for w in workers.values()} == {"prefill", "decode"} and all(w.healthy for w in workers.values())
        assert admin.degradation().level == 0
        fill = admin.hbm_fill("decode-0", 0.5)
        assert fill.active and fill.error is None and fill.kv_used_ratio >= 0.5
        assert [f.fault_id for f in admin.faults()] == [fill.fault_id]
        assert admin.release_fault("hbm_fill", fill.fault_id).active is False
        with pytest.raises(AdminError) as err:
            admin.migrate("decode-404")
        assert err.value.status == 404 and err.value.param
        types = [e["type"] for e in admin.events()]
        assert "fault_hook" in types and "fault_state" in types
        assert admin.config()["reschedule_enabled"] in (True, False)
