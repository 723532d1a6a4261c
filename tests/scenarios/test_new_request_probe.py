"""6.1.4's "a new request after the fault" is measured by an open-loop probe, never by the load's
closed-loop users (which, all blocked on a hung worker, send nothing: +5.38 s was once reported
where a request sent 0.06 s after the stop got its first token at +0.09 s).

A real HTTP server on loopback stands for the cluster's API: while "hung" it holds every request
it gets, then answers each with one token. Assertions are on the order of events, not on times."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler

from harness.checklists import Checklist
from harness.checks.reschedule_blackbox import measure_client_view
from harness.cluster import ClusterHandle
from harness.clusterfile.load import parse_cluster
from harness.probes.client.records import RequestRecord
from harness.evidence.records import ClientFault
from harness.scenarios.reschedule_blackbox import NewRequestProbe
from tests.probes.conftest import http_server

NS = 1_000_000_000


class Api:
    """Holds requests while ``hung``; counts what it received and answered."""

    def __init__(self, chunk: dict | None = None) -> None:
        self.chunk = chunk or {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        self.released = threading.Event()
        self.received = 0
        self.answered = 0
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with api.lock:
                    api.received += 1
                api.released.wait(60)
                body = f"data: {json.dumps(api.chunk)}\n\ndata: [DONE]\n\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with api.lock:
                    api.answered += 1

            def log_message(self, *args: object) -> None:
                pass
        return H


def cluster(url: str, engine: str = "vllm") -> ClusterHandle:
    spec = parse_cluster({"version": 2, "kind": "external", "engine": engine, "model": "m",
                          "endpoints": {"api": url}, "hosts": [{"name": "localhost", "address": "127.0.0.1", "roles": ["decode"]}],
                          "safety": {"production": False}}, source="probe-test")
    return ClusterHandle(spec, Checklist.load(), url, None, None)


def test_the_probe_keeps_sending_while_earlier_requests_hang_and_stops_once_one_is_served():
    """Planted defect: a closed-loop probe (the next request only after the previous one ended), or
    the load's users alone: while the cluster holds every request it would have sent one. Here three
    are received before any is answered; close() waits for every probe sent."""
    api = Api()
    with http_server(api.handler()) as url:
        probe = NewRequestProbe(cluster(url), period_s=0.05, window_s=30.0)
        fault = ClientFault(time.time(), ("w0",), "aggregated", "hang w0")
        probe.start(fault)
        deadline = time.monotonic() + 30
        while api.received < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with api.lock:
            received, answered = api.received, api.answered
        released = time.time()
        api.released.set()
        records = probe.close()
    assert received >= 3 and answered == 0            # open loop: sent without waiting for an answer
    assert all(r.request_id.startswith("newreq-0-") for r in records) and len(records) >= 3
    assert all(r.ok and r.first_token_ns is not None for r in records)
    assert len(records) == api.received                # close() waited for every probe sent

    # the client view: the load's only request sent after the fault was sent long after (its users were
    # blocked); the probe's first success is the new request
    late = RequestRecord(request_id="load-7", sent_ns=int((released + 5) * NS),
                         first_token_ns=int((released + 5.1) * NS), chunk_ns=[int((released + 5.1) * NS)],
                         chunk_tokens=[1], end_ns=int((released + 5.2) * NS), status="ok")
    [sample] = measure_client_view([fault], [late] + records)
    assert sample.first_new_request.startswith("newreq-0-")
    assert fault.wall < fault.wall + sample.first_new_success_s < released + 5


def test_a_dynamo_chunk_with_a_token_and_no_text_serves_the_probe():
    """Dynamo's mocker streams tokens that detokenize to empty text, counted by the chunk's usage
    (docs/dynamo.md "Token counting"). Planted defect: the first token taken only from a chunk with
    text: the probe would never see one served, keep sending for its whole window, and the client view
    would name no new request after the fault."""
    api = Api({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})
    api.released.set()
    with http_server(api.handler()) as url:
        probe = NewRequestProbe(cluster(url, engine="dynamo"), period_s=0.05, window_s=30.0)
        fault = ClientFault(time.time(), ("w0",), "aggregated", "hang w0")
        probe.start(fault)
        deadline = time.monotonic() + 30   # only ends a hung test: the assertions are on what came back
        while not any(r.first_token_ns is not None for r in probe.sent()) and time.monotonic() < deadline:
            time.sleep(0.01)
        records = probe.close()
    assert records and all(r.ok and r.first_token_ns is not None and r.text == "" for r in records), records
    [sample] = measure_client_view([fault], records)
    assert sample.first_new_request.startswith("newreq-0-") and sample.first_new_success_s is not None
