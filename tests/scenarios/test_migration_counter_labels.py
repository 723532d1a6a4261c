"""6.1.2 on Dynamo counts moved streams only: ``dynamo_frontend_model_migration_total`` carries
``migration_type="ongoing_request"`` (a stream moved after its first token) and ``"new_request"``
(a request re-sent before its first token: no stream crossed anything). Read from a real Prometheus
text exposition served by a real HTTP server on loopback (the frontend's format, both labels), and
through the PromQL source against a loopback server that answers Prometheus' query API."""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs, urlparse

from harness.checks.migration_blackbox import measure
from harness.probes.metrics.promql import PrometheusSource
from harness.scenarios.migration_on_loss import counter_name, migration_count, migration_quantity
from harness.evidence.records import ClientFault, KillWindow
from tests.checks.test_migration_blackbox import T0, steady, stream
from tests.probes.conftest import QuietHandler, http_server


def frontend_page(ongoing: float, new: float) -> str:
    """Dynamo 1.6.1 frontend's /metrics as exposed: one series per migration_type and model."""
    return ("# HELP dynamo_frontend_model_migration_total Total number of request migrations\n"
            "# TYPE dynamo_frontend_model_migration_total counter\n"
            f'dynamo_frontend_model_migration_total{{migration_type="new_request",model="tiny-llama"}} {new}\n'
            f'dynamo_frontend_model_migration_total{{migration_type="ongoing_request",model="tiny-llama"}} {ongoing}\n'
            "# TYPE dynamo_frontend_queued_requests gauge\n"
            'dynamo_frontend_queued_requests{model="tiny-llama"} 0\n')


class Page(QuietHandler):
    text = frontend_page(0, 0)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.reply(Page.text)


def test_only_ongoing_migrations_count_and_the_k_largest_stalls_are_the_samples():
    """Planted defect: the counter summed over migration_type (the old reading). Over this kill the
    frontend moved 2 streams and re-sent 2 requests before their first token; the summed rise (4)
    would take the 4 largest stalls, sampling 2 streams that stayed on the surviving worker."""
    assert migration_quantity("dynamo") == "migrations_ongoing" and migration_quantity("vllm") == "migrations"
    with http_server(Page) as base:
        url = base + "/metrics"
        Page.text = frontend_page(ongoing=5, new=7)
        before = migration_count(url, "dynamo", quantity="migrations_ongoing")
        every_type = migration_count(url, "dynamo")
        Page.text = frontend_page(ongoing=7, new=9)
        after = migration_count(url, "dynamo", quantity="migrations_ongoing")
        assert (before, after, every_type) == (5.0, 7.0, 12.0)
        assert migration_count(url, "dynamo") - every_type == 4.0   # what the old reading rose by
    counter = counter_name("dynamo", "migrations_ongoing")
    assert counter == 'dynamo_frontend_model_migration{migration_type="ongoing_request"}'
    records = [stream("moved-a", steady(T0 - 0.1, 10) + steady(T0 + 0.2, 3)),     # 200 ms stall: moved
               stream("moved-b", steady(T0 - 0.1, 10) + steady(T0 + 0.15, 3)),    # 150 ms: moved
               stream("stayed-c", steady(T0 - 0.1, 10) + steady(T0 + 0.017, 3)),  # 17 ms: contention only
               stream("stayed-d", steady(T0 - 0.1, 10) + steady(T0 + 0.012, 3))]
    window = KillWindow("idle", ClientFault(T0, ("dynamo-0",), "aggregated", "kill dynamo-0"), after - before,
                        counter=counter)
    out = measure([window], records)
    assert sorted(s.request_id for s in out.samples) == ["moved-a", "moved-b"]
    how = out.samples[0].migration
    assert how is not None and how["k"] == 2 and how["counter"] == counter and how["decoding"] == 4
    assert "largest stalls" in how["identified_by"] and "ongoing_request" in how["identified_by"]


def test_a_stream_named_only_on_the_victim_did_not_move():
    """Planted defect: every stream whose chunks named the victim counted as moved (the old rule):
    one that named only the victim (the kill's instant fell after its worker had finished sending)
    is no migration sample."""
    records = [stream("moved", steady(T0 - 0.1, 10) + steady(T0 + 0.09, 5), served_by=("decode-1", "decode-0")),
               stream("never-left", steady(T0 - 0.1, 10) + steady(T0 + 0.01, 5), served_by=("decode-1",))]
    out = measure([KillWindow("idle", ClientFault(T0, ("decode-1",), "decode", "kill decode-1"))], records)
    assert [s.request_id for s in out.samples] == ["moved"] and not out.failures
    assert any("never-left" in u and "no change of worker" in u for u in out.unmeasured)


class FakeQueryApi:
    """Prometheus' instant-query API over stored series: evaluates the selector's ``__name__``,
    ``instance`` and other ``=~`` matchers and ``sum by (instance, __name__)`` as Prometheus does."""

    SERIES = [({"__name__": "dynamo_frontend_model_migration_total", "instance": "127.0.0.1:8400",
                "migration_type": "ongoing_request", "model": "tiny-llama"}, 3.0),
              ({"__name__": "dynamo_frontend_model_migration_total", "instance": "127.0.0.1:8400",
                "migration_type": "new_request", "model": "tiny-llama"}, 8.0),
              ({"__name__": "up", "instance": "127.0.0.1:8400"}, 1.0)]

    def __init__(self) -> None:
        self.queries: list[str] = []

    def answer(self, query: str) -> dict:
        self.queries.append(query)
        matchers = dict(re.findall(r"(\w+)=~`([^`]*)`", query))
        if query.startswith("up{") or query.startswith("timestamp("):
            matchers["__name__"] = "up"
        rows: dict[tuple, float] = {}
        for labels, value in self.SERIES:
            if all(re.fullmatch(rx.replace("\\", ""), labels.get(k, "")) for k, rx in matchers.items()):
                key = (labels["instance"], labels["__name__"])
                rows[key] = rows.get(key, 0.0) + value
        return {"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"instance": i, "__name__": n}, "value": [1.0, str(v)]} for (i, n), v in rows.items()]}}


def test_through_prometheus_the_query_selects_ongoing_request_only():
    """Planted defect: the PromQL source ignoring the profile's label restriction (it summed both
    migration types: 11 instead of 3)."""
    fake = FakeQueryApi()

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            query = parse_qs(urlparse(self.path).query)["query"][0]
            self.reply(json.dumps(fake.answer(query)), content_type="application/json")

    with http_server(Handler) as prom, PrometheusSource(prom, "dynamo") as source:
        reading = source.read(["http://127.0.0.1:8400/metrics"], ["migrations", "migrations_ongoing"])
    assert reading.values["http://127.0.0.1:8400/metrics"] == {"migrations": 11.0, "migrations_ongoing": 3.0}
    assert any("migration_type=~`ongoing_request`" in q for q in fake.queries)
