"""A real NVIDIA Dynamo 1.6.1 frontend with two aggregated mocker workers, supervised (clusters/dynamo-agg.yaml):
the launcher's READY, the request shape Dynamo accepts, token counting without text, the 6.2 suite as a
user runs it, and a SIGKILL under load that Dynamo's request migration absorbs. One cluster for the module
(it starts in about 5 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.errors import ConfigError
from harness.probes.request_shape import check_request_shape, request_shape
from harness.probes.streaming import CompletionRequest, StreamingClient
from tests.realengine.conftest import REPO, healthy, kill_under_streams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DYNAMO_MODE = "agg"


def test_ready_means_every_worker_registered_and_serving(dynamo_cluster):
    ready = dynamo_cluster.ready
    assert ready["registered"] == {"backend": 2} and set(ready["workers"]) == {"dynamo-0", "dynamo-1"}
    health = httpx.get(f"{dynamo_cluster.api}/health", timeout=10).json()
    assert sum(i["endpoint"] == "generate" for i in health["instances"]) == 2
    for name, worker in ready["workers"].items():
        assert healthy(worker["health"]), name
        assert int(Path(worker["pid_file"]).read_text()) == worker["pid"]
        spec = dynamo_cluster.worker(name)
        assert spec["process"]["pid_file"] == worker["pid_file"] and spec["health"] == worker["health"]


def test_the_dynamo_shape_is_accepted_and_return_token_ids_would_be_refused(dynamo_cluster):
    """The launcher leaves DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS unset, as a user's Dynamo may."""
    check_request_shape(dynamo_cluster.api, request_shape("dynamo"))
    with pytest.raises(ConfigError, match="rejects request field\\(s\\) return_token_ids"):
        check_request_shape(dynamo_cluster.api, request_shape("vllm"))


def test_streams_carry_the_tokens_usage_says_although_their_text_is_empty(dynamo_cluster):
    with StreamingClient(dynamo_cluster.api, request_shape=request_shape("dynamo")) as client:
        records = [client.send(CompletionRequest(f"count me {i}", max_tokens=24, ignore_eos=True, chat=i % 2 == 1))
                   for i in range(4)]
    for rec in records:
        assert rec.ok and rec.token_source == "usage", rec
        assert sum(rec.chunk_tokens) == rec.completion_tokens == 24 and rec.first_token_ns == rec.chunk_ns[0]
    assert not "".join(r.text for r in records)  # the mocker's tokens detokenize to nothing


def test_the_62_suite_measures_ttft_and_tpot_and_nothing_is_lost(dynamo_cluster, tmp_path):
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/test_62_slo.py", "-p", "no:cacheprovider",
                           "--cluster=dynamo-agg", f"--report-dir={reports}", "--load-duration=5", "--live=plain"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-2000:]
    verdicts = {v["item"]: v for v in json.loads((reports / "latest" / "results.json").read_text())["verdicts"]}
    for item in ("6.2.ttft", "6.2.tpot"):
        assert verdicts[item]["status"] in ("pass", "fail"), verdicts[item]["reason"]
        assert verdicts[item]["evidence"]["server"]["observations"] > 0  # the frontend's own histogram beside
    lost = verdicts["nothing-lost"]
    assert lost["status"] == "pass" and lost["evidence"]["tokens_counted_by"] == {"usage": lost["evidence"]["completed"]}


def test_a_killed_worker_s_streams_migrate_and_nothing_is_lost(dynamo_cluster):
    records, migrated = kill_under_streams(dynamo_cluster, "dynamo-0")
    for rec in records:  # every stream completed with every token: none was cut, none failed
        assert rec is not None and rec.ok and sum(rec.chunk_tokens) == rec.completion_tokens == 400, rec
    # round robin put about half of them on the victim: each one it held migrated
    assert 1 <= migrated <= len(records), migrated
    assert "dynamo-0 (pid" in dynamo_cluster.launcher_log() and "exited with code -9" in dynamo_cluster.launcher_log()
