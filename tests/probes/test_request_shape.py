"""Per-engine request shape: only the extensions an engine's server accepts are sent, and a server that
rejects one is named at attach time (a real HTTP server here, strict like Dynamo 1.6.1's frontend)."""

import json
from http.server import BaseHTTPRequestHandler

import pytest

from harness.errors import ConfigError
from harness.probes.loadgen.calibrate import measure_chars_per_token
from harness.probes.client.request_shape import REQUEST_SHAPES, check_request_shape, request_shape
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from harness.probes.loadgen.workload import LoadProfile
from tests.probes.conftest import http_server

OPENAI_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos"}


class _StrictServer(BaseHTTPRequestHandler):
    """Answers like Dynamo 1.6.1's frontend: 400 naming fields it does not support; otherwise a stream whose
    tokens have no text and whose every chunk carries usage (when asked for)."""

    bodies: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, {"data": [{"id": "strict-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        unknown = sorted(set(body) - OPENAI_FIELDS)
        if unknown:
            names = ", ".join(f"`{k}`" for k in unknown)
            return self._send(400, {"message": f"Validation: Unsupported parameter(s): {names}",
                                    "type": "Bad Request", "code": 400})
        per_chunk = (body.get("stream_options") or {}).get("continuous_usage_stats")
        prompt_tokens = len(body.get("prompt", "")) // 4 + 1
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(1, n + 1):
            chunk = {"id": "c", "choices": [{"index": 0, "text": ""}]}
            if per_chunk:
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": i}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"id": "c", "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

    def _send(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def strict_server():
    _StrictServer.bodies = []
    with http_server(_StrictServer) as url:
        yield url


def test_each_engine_gets_only_the_extensions_its_server_accepts():
    req = CompletionRequest("hi", max_tokens=4, ignore_eos=True, priority=3)
    bundled = req.body("m")  # the default: the bundled engine takes every extension
    assert bundled["return_token_ids"] and bundled["ignore_eos"] and bundled["priority"] == 3
    assert "continuous_usage_stats" not in bundled["stream_options"]
    dynamo = req.body("m", REQUEST_SHAPES["dynamo"])
    assert "return_token_ids" not in dynamo and "priority" not in dynamo and dynamo["ignore_eos"]
    assert dynamo["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "ignore_eos" not in CompletionRequest("hi").body("m", REQUEST_SHAPES["dynamo"])  # not asked: not sent


def test_unknown_engine_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match="engine 'tgi' has no request shape.*dynamo"):
        request_shape("tgi")
    with pytest.raises(ConfigError, match="'tgi'"):
        LoadProfile(engine="tgi")


def test_a_strict_server_streams_empty_text_tokens_counted_by_per_chunk_usage(strict_server):
    with StreamingClient(strict_server, request_shape=request_shape("dynamo")) as client:
        rec = client.send(CompletionRequest("hello there", max_tokens=5, ignore_eos=True))
    assert rec.ok and rec.text == "" and rec.token_source == "usage"
    assert rec.chunk_tokens == [1] * 5 and rec.completion_tokens == 5 and rec.first_token_ns == rec.chunk_ns[0]
    check_request_shape(strict_server, request_shape("dynamo"))  # accepted: no error


def test_attaching_with_a_shape_the_server_rejects_names_the_field_and_the_shape(strict_server):
    with pytest.raises(ConfigError) as err:
        check_request_shape(strict_server, request_shape("vllm"))
    msg = str(err.value)
    assert "rejects request field(s) return_token_ids" in msg and "'vllm' request shape" in msg
    assert "Unsupported parameter(s): `return_token_ids`" in msg and "engine:" in msg


def test_calibration_names_a_rejected_field_instead_of_a_generic_failure(strict_server):
    with pytest.raises(ConfigError, match="rejects request field\\(s\\) return_token_ids.*'openai' request shape"):
        measure_chars_per_token(strict_server, shape=request_shape("openai"))
    per_token, _ = measure_chars_per_token(strict_server, shape=request_shape("dynamo"))
    assert 3.0 < per_token < 5.0  # the server counts one token per 4 characters


def test_dynamo_s_top_level_error_body_is_parsed(strict_server):
    """Dynamo answers {"message", "type", "code"} without OpenAI's "error" wrapper."""
    with StreamingClient(strict_server, request_shape=request_shape("vllm")) as client:
        rec = client.send(CompletionRequest("x"))
    assert (rec.http_status, rec.error_class) == (400, "Bad Request")
    assert rec.error_message == "Validation: Unsupported parameter(s): `return_token_ids`"


def test_every_engine_a_cluster_file_may_name_has_a_request_shape():
    from harness.clusterfile.base import ENGINES

    assert set(REQUEST_SHAPES) == set(ENGINES)


def test_attaching_checks_the_shape_and_a_dry_run_sends_nothing(strict_server, tmp_path):
    from harness.cluster import open_cluster
    from harness.clusterfile import load_cluster

    path = tmp_path / "strict.yaml"
    path.write_text(f"version: 2\nname: strict\nkind: external\nengine: vllm\nendpoints: {{api: {strict_server}}}\n")
    spec = load_cluster(str(path))
    with pytest.raises(ConfigError, match="'vllm' request shape"):
        with open_cluster(spec):
            pass
    _StrictServer.bodies = []
    with open_cluster(spec, send=False) as handle:
        assert handle.engine == "vllm"
    assert _StrictServer.bodies == []
