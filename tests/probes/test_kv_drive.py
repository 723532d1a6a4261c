"""The KV-use drive against a real HTTP server on loopback (an OpenAI-style SSE endpoint plus a
Prometheus /metrics whose KV use is the share of a 4-stream pool in use): the meter reads the fullest
endpoint, the drive ramps until each threshold is crossed, stops sending, lets every stream end and
sees KV use fall back."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.errors import ProbeError
from harness.probes.loadgen.kv_drive import DrivePlan, KvDrive, KvMeter
from harness.probes.client.records import read_records
from harness.probes.client.streaming import AsyncStreamingClient

POOL = 4  # streams that fill the fake engine's KV pool


class Engine:
    def __init__(self, kv_family="vllm:kv_cache_usage_perc"):
        self.in_flight, self.preemptions, self.kv_family = 0, 0, kv_family
        self.lock = threading.Lock()


def _handler(engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            with engine.lock:
                kv, waiting = min(1.0, engine.in_flight / POOL), max(0, engine.in_flight - POOL)
            body = (f'{engine.kv_family}{{engine="0"}} {kv}\nvllm:num_requests_waiting{{engine="0"}} {waiting}\n'
                    f'vllm:num_requests_running{{engine="0"}} {min(engine.in_flight, POOL)}\n'
                    f'vllm:num_preemptions_total{{engine="0"}} {engine.preemptions}\n').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with engine.lock:
                engine.in_flight += 1
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                n = req["max_tokens"]
                for i in range(n):
                    self._chunk({"id": "x", "choices": [{"index": 0, "text": "t", "finish_reason":
                                                          "length" if i == n - 1 else None}]})
                    time.sleep(0.4 / n)
                self._chunk({"id": "x", "choices": [], "usage": {"prompt_tokens": len(req["prompt"]) // 4,
                                                                  "completion_tokens": n}})
                self._write(b"data: [DONE]\n\n")
                self._write(b"")
            finally:
                with engine.lock:
                    engine.in_flight -= 1

        def _chunk(self, msg):
            self._write(f"data: {json.dumps(msg)}\n\n".encode())

        def _write(self, data):
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


@pytest.fixture
def engine():
    eng = Engine()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(eng))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    eng.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield eng
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_meter_keeps_endpoints_with_a_kv_metric_and_reads_the_fullest(engine):
    other = Engine(kv_family="something_else")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(other))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        without = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        meter = KvMeter([f"{engine.url}/metrics", without], "vllm")
        meter.check()
        assert meter.urls == [f"{engine.url}/metrics"]
        assert "exposes no vllm:kv_cache_usage_perc" in meter.dropped[without]
        engine.in_flight = 3
        sample = meter.read(concurrency=5)
        assert (sample.kv_use, sample.running, sample.waiting, sample.concurrency) == (0.75, 3.0, 0.0, 5)
        engine.in_flight = 0
        lonely = KvMeter([without], "vllm")
        with pytest.raises(ProbeError, match="no metrics endpoint exposes vllm:kv_cache_usage_perc"):
            lonely.check()
        meter.close()
        lonely.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    with pytest.raises(ProbeError, match="names no KV-use metric"):
        KvMeter([f"{engine.url}/metrics"], "pdengine-typo")


def test_the_plan_refuses_thresholds_out_of_order():
    with pytest.raises(ProbeError, match="ascending"):
        DrivePlan(thresholds=(0.9, 0.8), prompt_tokens=10, output_tokens=10)
    assert DrivePlan(thresholds=(0.8,), prompt_tokens=10, output_tokens=10, max_concurrency=64).ramp_step == 2


def test_the_drive_crosses_each_threshold_then_stops_and_kv_use_falls_back(engine, tmp_path):
    plan = DrivePlan(thresholds=(0.5, 0.75), prompt_tokens=50, output_tokens=8, max_concurrency=6,
                     ramp_budget_s=30, hold_s=1.0, step_down_timeout_s=10, sample_s=0.1)
    meter = KvMeter([f"{engine.url}/metrics"], "vllm")
    meter.check()

    async def run():
        async with AsyncStreamingClient(engine.url, model="m", timeout_s=30) as client:
            return await KvDrive(client, meter, plan, tmp_path / "requests.jsonl").run()

    result = asyncio.run(run())
    meter.close()
    assert set(result.crossed_wall_ns) == {0, 1}, result.ramp_ended
    assert result.ramp_ended == "every threshold crossed and held"
    assert result.records and all(r.ok and 6 <= r.completion_tokens <= 10 for r in result.records)  # 8 +-25 %
    assert abs(result.chars_per_token - 4.0) < 0.1  # the server counts one token per 4 characters
    assert {r.prompt_tokens for r in result.records} <= {49, 50}  # prompts sized from that calibration
    assert len({r.prompt[:20] for r in result.records}) == len(result.records)  # each prompt's start is unique
    assert result.step_down_s is not None and result.drained_wall_ns >= result.stopped_wall_ns
    assert engine.in_flight == 0  # every stream ended: none was cut
    assert all(r.start_wall_ns() <= result.stopped_wall_ns for r in result.records)
    assert sorted(r.request_id for r in read_records(tmp_path / "requests.jsonl")) == \
        sorted(r.request_id for r in result.records)


def test_a_threshold_the_load_cannot_reach_ends_the_ramp_with_the_reason(engine):
    plan = DrivePlan(thresholds=(0.5, 0.99), prompt_tokens=20, output_tokens=8, max_concurrency=2,
                     ramp_budget_s=1.5, hold_s=0.5, step_down_timeout_s=10, sample_s=0.1)
    meter = KvMeter([f"{engine.url}/metrics"], "vllm")

    async def run():
        async with AsyncStreamingClient(engine.url, model="m", timeout_s=30) as client:
            return await KvDrive(client, meter, plan).run()

    result = asyncio.run(run())
    meter.close()
    assert 1 not in result.crossed_wall_ns  # two streams fill half of the pool at most
    assert result.ramp_ended.startswith("KV use did not cross 0.99 within 2 s at up to 2 streams")
    assert engine.in_flight == 0
