"""One prefill + one decode vLLM with vLLM's file-based example KV connector behind vllm-router's PD mode
(clusters/vllm-pd.yaml). The proof that KV moved is vLLM's own counter on the decode instance:
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``. Slow: two vLLM starts."""

from __future__ import annotations

import pytest

from tests.realengine.conftest import scrape, stream_chat

pytestmark = pytest.mark.slow
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
