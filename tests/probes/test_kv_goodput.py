"""The engine's own KV goodput for item 6.1.1, read from a real HTTP metrics endpoint serving vLLM's
NIXL histograms (the shape vLLM 0.32 exposes), and the reasons given where it cannot be read."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.cluster import ClusterHandle
from harness.clusterfile import load_cluster
from harness.probes.metrics.kv_goodput import engine_kv_goodput

NIXL = """# HELP vllm:nixl_bytes_transferred Number of bytes transferred per NIXL transfer.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="1e+06",model_name="m"} 2.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 4.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 5.0e+08
# HELP vllm:nixl_xfer_time_seconds Transfer duration for NIXL KV cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.5
"""


@pytest.fixture
def metrics_url():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = NIXL.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def _handle(tmp_path, engine, metrics):
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: external\nengine: {engine}\nendpoints: {{api: http://127.0.0.1:9"
                    + (f", metrics: '{metrics}'" if metrics else "") + "}\n")
    spec = load_cluster(path)
    return ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", metrics, None)


def test_vllm_nixl_bytes_over_transfer_time_against_the_line_rate(tmp_path, metrics_url):
    got = engine_kv_goodput(_handle(tmp_path, "vllm", metrics_url), line_bps=10e9)
    assert got["gbit_per_s"] == 8.0 and got["line_rate_fraction"] == 0.8  # 500 MB in 0.5 s = 8 Gbit/s
    assert got["transfers"] == 4 and "nixl_bytes_transferred_sum" in got["source"]


def test_no_profile_counter_or_no_endpoint_says_why(tmp_path, metrics_url):
    assert "counts no KV transfer" in engine_kv_goodput(_handle(tmp_path, "sglang", metrics_url))["unavailable"]
    assert "no endpoints.metrics" in engine_kv_goodput(_handle(tmp_path, "vllm", None))["unavailable"]
