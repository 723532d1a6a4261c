import math
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from harness.errors import ProbeError
from harness.probes.prometheus import ENGINE_PROFILES, PrometheusScraper, histogram_quantile, parse_metrics


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
    from harness.engine.server import ServerProcess
    from harness.probes.streaming import CompletionRequest, StreamingClient

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
