"""A real NVIDIA Dynamo 1.6.1 frontend with one prefill and two decode mocker workers, supervised
(clusters/dynamo-disagg.yaml): READY lists every role, a decode worker's SIGKILL under load is absorbed by
request migration, and the only prefill worker's loss is a clear HTTP 503, not a hang or a silent cut.

Its own cluster (tests/realengine/pool.py): the only module in disagg mode (one prefill, two decode)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.probes.client.request_shape import request_shape
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from tests.realengine.conftest import healthy, kill_under_streams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DYNAMO_MODE = "disagg"


def test_ready_lists_the_prefill_and_both_decode_workers(dynamo_cluster):
    assert dynamo_cluster.ready["registered"] == {"prefill": 1, "backend": 2}
    assert {w["role"] for w in dynamo_cluster.spec["workers"]} == {"prefill", "decode"}
    with StreamingClient(dynamo_cluster.api, request_shape=request_shape("dynamo")) as client:
        rec = client.send(CompletionRequest("prefill there, decode here", max_tokens=16, ignore_eos=True))
    assert rec.ok and sum(rec.chunk_tokens) == rec.completion_tokens == 16


def test_a_killed_decode_worker_s_streams_migrate_and_nothing_is_lost(dynamo_cluster):
    out = kill_under_streams(dynamo_cluster, "decode-1")
    for rec in out.records:
        assert rec is not None and rec.ok and sum(rec.chunk_tokens) == rec.completion_tokens == 400, rec
    assert 1 <= out.migrated <= len(out.records), out.migrated


def test_killing_the_only_prefill_worker_is_a_named_503_until_it_is_back(dynamo_cluster):
    pid_file = Path(dynamo_cluster.ready["workers"]["prefill-0"]["pid_file"])
    old = int(pid_file.read_text())
    outcomes = []
    with StreamingClient(dynamo_cluster.api, request_shape=request_shape("dynamo"), timeout_s=30) as client:
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (outcomes and outcomes[-1].ok and any(r.http_status == 503 for r in outcomes)):
            assert time.monotonic() < deadline, [(r.status, r.http_status, r.error_message) for r in outcomes]
            outcomes.append(client.send(CompletionRequest("is prefill there?", max_tokens=4, ignore_eos=True)))
    refused = [r for r in outcomes if not r.ok]
    # each refusal is the frontend's own clear answer; then the supervisor's restart serves again
    assert refused and all(r.http_status == 503 and r.error_message == "Service temporarily unavailable"
                           for r in refused), [(r.status, r.http_status, r.error_message) for r in refused]
    assert int(pid_file.read_text()) != old and healthy(dynamo_cluster.worker("prefill-0")["health"])
