"""One prefill + one decode vLLM with vLLM's file-based example KV connector behind vllm-router's PD mode
(clusters/vllm-pd.yaml). The proof that KV moved is vLLM's own counter on the decode instance:
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``. Slow: two vLLM starts.

Its own cluster (tests/realengine/pool.py): the only module in PD mode."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.realengine.conftest import healthy, pgrep, scrape, stream_chat, stream_chat_outcome

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # vLLM start-up and restarts take minutes under load
VLLM_MODE = "pd"
EXTERNAL = "vllm:prompt_tokens_by_source_total{"


def _by_source(metrics_url: str, source: str) -> float:
    return sum(v for k, v in scrape(metrics_url).items()
               if k.startswith(EXTERNAL) and f'source="{source}"' in k)


def test_pd_router_streams_and_the_decode_instance_loads_the_prompt_kv(vllm_cluster):
    prefill, decode = vllm_cluster.worker("prefill-0"), vllm_cluster.worker("decode-0")
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    moved_before = _by_source(decode["metrics"], "external_kv_transfer")
    prefill_computed_before = _by_source(prefill["metrics"], "local_compute")
    # A few hundred tokens (several 32-token blocks), different each time so no local prefix cache hit.
    for i in range(3):
        prompt = f"request {i}: " + " ".join(f"the quick brown fox {j} jumps over the lazy dog" for j in range(10))
        stream_chat(vllm_cluster.api, vllm_cluster.spec["model"], prompt, 16)  # all 16 tokens, then [DONE]
    moved = _by_source(decode["metrics"], "external_kv_transfer") - moved_before
    computed_on_prefill = _by_source(prefill["metrics"], "local_compute") - prefill_computed_before
    assert computed_on_prefill >= 3 * 200, computed_on_prefill  # the prompts were prefilled there
    assert moved >= 3 * 32 * 5, f"decode loaded only {moved} prompt tokens over the KV connector"


def test_both_instances_export_vllm_metrics(vllm_cluster):
    for worker in vllm_cluster.spec["workers"]:
        samples = scrape(worker["metrics"])
        assert any(k.startswith("vllm:kv_cache_usage_perc") for k in samples), worker["name"]


def test_a_killed_decode_instance_fails_requests_clearly_then_comes_back_and_kv_moves_again(vllm_cluster):
    decode = vllm_cluster.worker("decode-0")
    [engine] = pgrep(decode["process"]["pgrep"])
    subprocess.run(["kill", "-KILL", str(engine)], check=True)
    # With the only decode down, the router answers every request with an error (HTTP 500 naming the
    # decode URL once its API server is gone, or an error event before): none hangs, none is cut.
    deadline = time.monotonic() + 600
    while not (pgrep(decode["process"]["pgrep"]) not in ([], [engine]) and healthy(decode["health"])):
        outcome = stream_chat_outcome(vllm_cluster.api, vllm_cluster.spec["model"], "decode is down", 4)
        assert outcome.error or outcome.completion_tokens == 4, outcome
        assert time.monotonic() < deadline, "decode-0 did not come back:\n" + vllm_cluster.launcher_log()[-3000:]
        time.sleep(2)
    moved_before = _by_source(decode["metrics"], "external_kv_transfer")  # a new process: counters restart
    prompt = "after the restart: " + " ".join(f"alpha beta gamma {j}" for j in range(40))
    stream_chat(vllm_cluster.api, vllm_cluster.spec["model"], prompt, 8)
    assert _by_source(decode["metrics"], "external_kv_transfer") - moved_before >= 32 * 5
