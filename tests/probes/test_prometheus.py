import math
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from harness.errors import ProbeError
from harness.probes.metrics.prometheus import ENGINE_PROFILES, PrometheusScraper, histogram_quantile, parse_metrics


def _exposition() -> str:
    """A real exposition written by prometheus_client: 100 TTFT observations, two workers' gauges."""
    reg = CollectorRegistry()
    h = Histogram("pdengine_time_to_first_token_seconds", "ttft", ["model_name"],
                  buckets=(0.1, 0.2, 0.5, 1.0), registry=reg)
    for i in range(100):
        h.labels("tiny").observe(0.15 if i < 90 else 0.7)  # 90 in (0.1, 0.2], 10 in (0.5, 1.0]
    g = Gauge("pdengine_num_requests_running", "running", ["worker"], registry=reg)
    g.labels("decode-0").set(3)
    g.labels("decode-1").set(4)
    Counter("pdengine_generation_tokens", "tokens", registry=reg).inc(42)
    return generate_latest(reg).decode()


def test_parse_keeps_every_sample_with_labels_and_scrape_time():
    samples = parse_metrics(_exposition(), t_wall_ns=5, t_mono_ns=6)
    by_name = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    assert by_name["pdengine_generation_tokens_total"][0].value == 42
    assert sorted(s.value for s in by_name["pdengine_num_requests_running"]) == [3, 4]
    buckets = {dict(s.labels)["le"]: s.value for s in by_name["pdengine_time_to_first_token_seconds_bucket"]}
    assert buckets["0.2"] == 90 and buckets["+Inf"] == 100
    assert all(s.t_wall_ns == 5 and s.t_mono_ns == 6 for s in samples)
    with pytest.raises(ProbeError, match="not Prometheus text format"):
        parse_metrics("<html>not metrics</html>\n")


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 0), (0.2, 90), (0.5, 90), (1.0, 100), (math.inf, 100)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.1 * 50 / 90)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.2)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 9 / 10)
    assert math.isnan(histogram_quantile(0.5, [(0.1, 0), (math.inf, 0)]))
    assert histogram_quantile(0.99, [(0.1, 0), (math.inf, 5)]) == 0.1   # above the last bound
    with pytest.raises(ProbeError, match="quantile must be in"):
        histogram_quantile(99, buckets)


def test_every_profile_maps_the_core_quantities():
    for engine, profile in ENGINE_PROFILES.items():
        assert {"ttft_seconds", "itl_seconds", "e2e_seconds", "requests_waiting"} <= set(profile), engine


def test_scraper_rejects_bad_configuration_and_an_unreachable_endpoint():
    with pytest.raises(ProbeError, match="unknown engine profile 'trt'"):
        PrometheusScraper("http://127.0.0.1:1/metrics", engine="trt")
    with pytest.raises(ProbeError, match="interval must be > 0"):
        PrometheusScraper("http://127.0.0.1:1/metrics", interval_s=0)
    with pytest.raises(ProbeError, match="no http"):
        PrometheusScraper("127.0.0.1:1/metrics")
    scraper = PrometheusScraper("http://127.0.0.1:1/metrics")
    with pytest.raises(ProbeError, match="cannot scrape"):
        scraper.start()
    scraper.stop()
    with pytest.raises(ProbeError, match="has no metric in this engine profile"):
        scraper.series("goodput")


@pytest.mark.slow
def test_scraper_collects_series_from_a_real_server():
    from harness.engine.serving.server import ServerProcess
    from harness.probes.client.streaming import CompletionRequest, StreamingClient

    with ServerProcess("tiny") as server:
        with PrometheusScraper(server.url + "/metrics", interval_s=0.2) as scraper:
            with StreamingClient(server.url) as client:
                records = [client.send(CompletionRequest(f"probe {i}", max_tokens=5, ignore_eos=True))
                           for i in range(3)]
            scraper.scrape_once()  # sees all three requests
            mid_wall = time.time_ns()
        assert all(r.ok for r in records)
    assert scraper.scrapes >= 2 and not scraper.errors
    tokens = scraper.series("generation_tokens")
    assert tokens["value"].iloc[-1] == 15   # a fresh server, three requests of 5 tokens
    assert tokens["t_wall_ns"].is_monotonic_increasing
    rate = scraper.rate("generation_tokens")
    assert (rate["per_s"] >= 0).all()
    # integrating the rate over the scrape intervals gives back the increase
    dt_s = tokens["t_wall_ns"].diff().iloc[1:].reset_index(drop=True) / 1e9
    assert (rate["per_s"] * dt_s).sum() == pytest.approx(tokens["value"].iloc[-1] - tokens["value"].iloc[0])
    assert set(scraper.series("engine_up")["value"]) == {1.0}
    assert scraper.series("kv_blocks_total")["value"].iloc[-1] > 0
    ttft_p50 = scraper.quantile("ttft_seconds", 0.5)
    assert 0 < ttft_p50 < 60
    # the window before any traffic has no observations
    assert math.isnan(scraper.quantile("ttft_seconds", 0.5, start_wall_ns=0, end_wall_ns=0))
    assert scraper.quantile("ttft_seconds", 0.5, end_wall_ns=mid_wall) == ttft_p50
    frame = scraper.frame()
    assert {"t_wall_ns", "t_mono_ns", "name", "labels", "value"} <= set(frame.columns) and len(frame) > 20


# Real-shaped expositions (names, types and labels as each engine exports them; REFERENCE.md and
# the engines' metric docs), read through each engine's profile.
VLLM_TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 40.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 600.0
# HELP vllm:nixl_bytes_transferred Bytes transferred per NIXL KV Cache transfer.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="1048576.0",model_name="m"} 1.0
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 3.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 9437184.0
# HELP vllm:nixl_xfer_time_seconds Transfer duration for NIXL KV Cache transfers.
# TYPE vllm:nixl_xfer_time_seconds histogram
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.01",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 3.0
vllm:nixl_xfer_time_seconds_sum{engine="0",model_name="m"} 0.012
# HELP vllm:nixl_num_failed_transfers Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 1.0
"""

SGLANG_TEXT = """\
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.61
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7.0
"""

DYNAMO_TEXT = """\
# HELP dynamo_frontend_model_rejection_total Total number of requests rejected due to resource exhaustion
# TYPE dynamo_frontend_model_rejection_total counter
dynamo_frontend_model_rejection_total{endpoint="chat_completions",model="m"} 4
dynamo_frontend_model_rejection_total{endpoint="completions",model="m"} 1
# HELP dynamo_component_kvstats_gpu_cache_usage_percent GPU cache usage as a percentage (0.0-1.0)
# TYPE dynamo_component_kvstats_gpu_cache_usage_percent gauge
dynamo_component_kvstats_gpu_cache_usage_percent{dp_rank="0"} 0.875
# HELP dynamo_component_kvstats_active_blocks Number of active KV cache blocks currently in use
# TYPE dynamo_component_kvstats_active_blocks gauge
dynamo_component_kvstats_active_blocks{dp_rank="0"} 700
# HELP dynamo_component_kvstats_total_blocks Total number of KV cache blocks available
# TYPE dynamo_component_kvstats_total_blocks gauge
dynamo_component_kvstats_total_blocks{dp_rank="0"} 800
"""


def _scraper_with(engine: str, text: str) -> PrometheusScraper:
    scraper = PrometheusScraper("http://127.0.0.1:1/metrics", engine=engine)
    scraper.samples.extend(parse_metrics(text, t_wall_ns=1))
    scraper.stop()
    return scraper


def _value(scraper: PrometheusScraper, quantity: str, **labels: str) -> float:
    [value] = scraper.series(quantity, **labels)["value"].tolist()
    return value


def test_vllm_profile_reads_kv_use_nixl_histogram_totals_and_kv_by_source():
    s = _scraper_with("vllm", VLLM_TEXT)
    assert _value(s, "kv_usage") == 0.25
    assert _value(s, "kv_transfer_bytes") == 9437184.0 and _value(s, "kv_transfers") == 3.0
    assert _value(s, "kv_transfer_seconds") == pytest.approx(0.012)
    assert _value(s, "kv_transfer_failures") == 1.0
    assert _value(s, "prompt_tokens_by_source", source="external_kv_transfer") == 600.0
    assert _value(s, "prompt_tokens_by_source") == 640.0   # all sources summed


def test_sglang_profile_reads_token_usage_as_kv_use():
    s = _scraper_with("sglang", SGLANG_TEXT)
    assert _value(s, "kv_usage") == 0.61 and _value(s, "requests_waiting") == 7.0


def test_dynamo_profile_reads_the_frontend_rejection_counter_and_kvstats():
    s = _scraper_with("dynamo", DYNAMO_TEXT)
    assert _value(s, "rejections") == 5.0
    assert _value(s, "rejections", endpoint="completions") == 1.0
    assert _value(s, "kv_usage") == 0.875
    assert (_value(s, "kv_blocks_used"), _value(s, "kv_blocks_total")) == (700, 800)


def test_engine_of_a_cluster_selects_its_profile():
    from types import SimpleNamespace

    from harness.probes.metrics.prometheus import profile_for

    assert profile_for(SimpleNamespace()) == "pdengine"                 # a file without engine: (bundled)
    assert profile_for(SimpleNamespace(engine="vllm")) == "vllm"
    assert profile_for(SimpleNamespace(engine="openai")) is None        # no metrics endpoint
    with pytest.raises(ProbeError, match="has no metric profile"):
        profile_for(SimpleNamespace(engine="trtllm"))
