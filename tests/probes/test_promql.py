"""The PromQL source against a real HTTP server on loopback that answers as Prometheus' query API does
(canned JSON per query): parsing of vectors, matrices and scalars, instance -> metrics URL, the scrape
lag wait, and every error naming the Prometheus URL, the query and Prometheus' own error text. The
agreement with a real Prometheus server is tests/probes/test_promql_server.py. Also ``endpoints.prometheus``
in the cluster file and which source a cluster gets."""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

import pytest

from harness.cluster import ClusterHandle
from harness.clusterfile import json_schema, load_cluster
from harness.errors import ConfigError, ProbeError
from harness.probes.loadgen.kv_drive import KvMeter
from harness.probes.metrics.metrics_source import ScrapeSource, metrics_source, source_label
from harness.probes.metrics.promql import PromQL, PrometheusSource, instance_of
from tests.probes.conftest import http_server

A, B = "http://10.0.0.5:8101/metrics", "http://10.0.0.6:8101/metrics"


def _vector(*rows):
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": labels, "value": [t, str(v)]} for labels, t, v in rows]}}


class FakePrometheus:
    """What the fake answers: ``answer(query, params) -> (status, body)``; every request is kept."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlparse(self.path)
                params = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.requests.append((url.path, params))
                status, body = fake.answer(url.path, params)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _cluster_answer(now_s, kv=(0.5, 0.25), up=(1, 1), scraped_s=None):
    """Two vLLM workers (A and B) as a Prometheus scraping both would answer."""
    scraped_s = now_s if scraped_s is None else scraped_s

    def answer(path, params):
        q = params.get("query", "")
        if q.startswith("timestamp(up"):
            return 200, _vector(({"instance": "10.0.0.5:8101"}, now_s, scraped_s), ({"instance": "10.0.0.6:8101"}, now_s,
                                                                                     scraped_s))
        if q.startswith("up{"):
            return 200, _vector(({"instance": "10.0.0.5:8101"}, now_s, up[0]), ({"instance": "10.0.0.6:8101"}, now_s, up[1]),
                                ({"instance": "10.9.9.9:1"}, now_s, 1))  # another cluster's target: ignored
        if q.startswith("sum by (instance, __name__)"):
            return 200, _vector(({"__name__": "vllm:kv_cache_usage_perc", "instance": "10.0.0.5:8101"}, now_s, kv[0]),
                                ({"__name__": "vllm:kv_cache_usage_perc", "instance": "10.0.0.6:8101"}, now_s, kv[1]),
                                ({"__name__": "vllm:num_preemptions_total", "instance": "10.0.0.5:8101"}, now_s, 3))
        if q.endswith("s]"):  # a window: raw samples of two series of A (summed per scrape) and one of B
            return 200, {"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"instance": "10.0.0.5:8101", "engine": "0"}, "values": [[100.0, "0.1"], [101.0, "0.2"]]},
                {"metric": {"instance": "10.0.0.5:8101", "engine": "1"}, "values": [[100.0, "0.3"], [101.0, "0.3"]]},
                {"metric": {"instance": "10.0.0.6:8101"}, "values": [[99.0, "0.9"], [100.5, "0.4"]]}]}}
        return 400, {"status": "error", "errorType": "bad_data", "error": f"unexpected query {q}"}

    return answer


def test_a_read_maps_instances_to_the_cluster_files_urls_and_sums_a_counters_total():
    fake = FakePrometheus(_cluster_answer(time.time()))
    with http_server(fake.handler()) as url, PrometheusSource(url, "vllm") as source:
        reading = source.read([A, B], ["kv_usage", "preemptions"])
        assert source.label == f"prometheus {url}"
    assert reading.values == {A: {"kv_usage": 0.5, "preemptions": 3.0}, B: {"kv_usage": 0.25}} and not reading.errors
    assert reading.total("kv_usage") == 0.75
    query = next(p["query"] for path, p in fake.requests if p["query"].startswith("sum"))
    # only this cluster's instances, a family with or without _total, dots of an address escaped
    assert r"instance=~`10\.0\.0\.5:8101|10\.0\.0\.6:8101`" in query and "vllm:num_preemptions_total" in query


def test_a_target_prometheus_does_not_scrape_or_failed_to_scrape_is_named_and_a_meter_drops_it():
    fake = FakePrometheus(_cluster_answer(time.time(), up=(1, 0)))
    c = "http://10.0.0.7:9000/metrics"
    with http_server(fake.handler()) as url:
        reading = PrometheusSource(url, "vllm").read([A, B, c], ["kv_usage"])
        assert list(reading.values) == [A]
        assert "last scrape of http://10.0.0.6:8101/metrics failed (up == 0)" in reading.errors[B]
        assert 'does not scrape http://10.0.0.7:9000/metrics (no `up` series with instance="10.0.0.7:9000")' \
            in reading.errors[c]
        meter = KvMeter([A, B, c], "vllm", source=PrometheusSource(url, "vllm"))
        meter.check()
        assert meter.urls == [A] and set(meter.dropped) == {B, c}
        assert meter.read().kv_use == 0.5
        meter.close()


def test_a_window_is_prometheus_raw_samples_summed_per_scrape_inside_the_window():
    fake = FakePrometheus(_cluster_answer(time.time(), scraped_s=1e10))
    with http_server(fake.handler()) as url:
        series = PrometheusSource(url, "vllm").series([A, B], "kv_usage", int(100e9), int(101e9))
    assert series == {A: [(100_000_000_000, pytest.approx(0.4)), (101_000_000_000, pytest.approx(0.5))],
                      B: [(100_500_000_000, 0.4)]}  # B's sample at 99 s is before the window
    path, params = fake.requests[-1]
    assert path == "/api/v1/query" and params["time"] == "101.000" and params["query"].endswith("[2s]")


def test_a_settled_read_waits_for_a_scrape_after_it_and_says_which_target_lags():
    fake = FakePrometheus(_cluster_answer(time.time(), scraped_s=time.time() - 60))
    with http_server(fake.handler()) as url:
        source = PrometheusSource(url, "vllm", max_lag_s=0.5, poll_s=0.1)
        with pytest.raises(ProbeError, match=r"has not scraped http://10\.0\.0\.5:8101/metrics \(last 6\d\.\d s before"):
            source.read([A, B], ["kv_usage"], settled=True)
        assert source.read([A, B], ["kv_usage"]).values[A]["kv_usage"] == 0.5  # unsettled: what it has


def test_prometheus_errors_name_the_url_the_query_and_its_error():
    def answer(path, params):
        if "broken" in params["query"]:
            return 400, {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}
        return 200, "<html>not an API</html>"

    with http_server(FakePrometheus(answer).handler()) as url:
        client = PromQL(url)
        with pytest.raises(ProbeError, match=rf"Prometheus {url}: query 'broken\(' failed \(HTTP 400\): "
                                             r"bad_data: parse error at char 3"):
            client.instant("broken(")
        with pytest.raises(ProbeError, match=r"without JSON .*is it a Prometheus\?"):
            client.instant("up")
        with pytest.raises(ProbeError, match="step > 0"):
            client.range("up", 10, 5, 1)
    with pytest.raises(ProbeError, match=r"Prometheus http://127\.0\.0\.1:9: query 'up' not answered"):
        PromQL("http://127.0.0.1:9", timeout_s=2).instant("up")


def test_a_range_query_and_a_scalar_parse():
    def answer(path, params):
        if path == "/api/v1/query_range":
            assert (params["start"], params["end"], params["step"]) == ("10.000", "12.000", "1")
            return 200, {"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"instance": "x:1"}, "values": [[10, "1"], [11, "NaN"], [12, "+Inf"]]}]}}
        return 200, {"status": "success", "data": {"resultType": "scalar", "result": [5.0, "2"]}}

    with http_server(FakePrometheus(answer).handler()) as url:
        client = PromQL(url)
        [s] = client.range("up", 10, 12, 1)
        assert s.labels == {"instance": "x:1"} and s.points[0] == (10.0, 1.0) and s.points[2][1] == float("inf")
        assert client.instant("scalar(1)")[0].points == [(5.0, 2.0)]


def test_instances_are_host_and_port_and_two_urls_on_one_target_are_refused():
    assert instance_of("http://10.0.0.5/metrics") == "10.0.0.5:80"
    assert instance_of("https://[::1]:9/metrics") == "[::1]:9"
    with pytest.raises(ProbeError, match="are one Prometheus target"):
        PrometheusSource("http://127.0.0.1:9", "vllm")._instances([A, "http://10.0.0.5:8101/other"])
    with pytest.raises(ProbeError, match="unknown engine profile"):
        PrometheusSource("http://127.0.0.1:9", "nope")


CLUSTER = """\
version: 2
name: p
kind: external
engine: vllm
endpoints: {api: http://10.0.0.5:8000, metrics: http://10.0.0.5:8000/metrics%s}
"""


def test_endpoints_prometheus_selects_the_source_and_a_metrics_page_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER % ", prometheus: http://10.0.0.9:9090/")
    spec = load_cluster(path)
    handle = ClusterHandle(spec, spec.checklist(), spec.endpoints.api, spec.endpoints.metrics, None)
    assert handle.prometheus_url == "http://10.0.0.9:9090" and handle.describe()["prometheus_url"] == handle.prometheus_url
    assert source_label(handle) == "prometheus http://10.0.0.9:9090"
    with metrics_source(handle) as source:
        assert isinstance(source, PrometheusSource) and source.profile == "vllm"
    path.write_text(CLUSTER % "")
    spec = load_cluster(path)
    handle = ClusterHandle(spec, spec.checklist(), spec.endpoints.api, spec.endpoints.metrics, None)
    assert handle.prometheus_url is None and source_label(handle) == "scrape"
    with handle.metrics_source() as source:
        assert isinstance(source, ScrapeSource)
    path.write_text(CLUSTER % ", prometheus: http://10.0.0.9:9090/metrics")
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert "`endpoints.prometheus`" in str(err.value) and "write the base URL, e.g. http://10.0.0.9:9090" in str(err.value)
    assert "prometheus" in json_schema()["$defs"]["Endpoints"]["properties"]


def test_direct_scraping_times_each_endpoint_when_it_answered_not_when_the_read_began():
    """Direct scraping reads the endpoints one after another; on a loaded machine a slow first endpoint held
    the second one's answer seconds after the read began, and a ramp read that way looked late against
    Prometheus' own scrape times (CI 2026-12-07, test_promql_server). Each endpoint's series point is timed
    at its own request/answer midpoint. Fails if ``series`` stamps every endpoint with the read's start."""
    from tests.probes.conftest import QuietHandler

    class Slow(QuietHandler):
        def do_GET(self):
            time.sleep(0.6)
            self.reply("vllm:kv_cache_usage_perc 0.25\n")

    class Fast(QuietHandler):
        def do_GET(self):
            self.reply("vllm:kv_cache_usage_perc 0.5\n")

    with http_server(Slow) as slow, http_server(Fast) as fast, ScrapeSource("vllm") as source:
        urls = [f"{slow}/metrics", f"{fast}/metrics"]
        reading = source.read(urls, ["kv_usage"])
        assert reading.values == {urls[0]: {"kv_usage": 0.25}, urls[1]: {"kv_usage": 0.5}}
        began = reading.t_wall_ns
        assert 0.25e9 <= reading.time_of(urls[0]) - began <= 0.6e9, reading.times
        assert reading.time_of(urls[1]) - began >= 0.55e9, reading.times
        series = source.series(urls, "kv_usage", began, time.time_ns())
        assert series == {urls[0]: [(reading.time_of(urls[0]), 0.25)], urls[1]: [(reading.time_of(urls[1]), 0.5)]}
        # a window that ends before the slow endpoint answered holds neither endpoint's point
        assert source.series(urls, "kv_usage", began, began + int(0.2e9)) == {urls[0]: [], urls[1]: []}
