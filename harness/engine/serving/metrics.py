"""Prometheus metrics of the OpenAI-compatible API layer.

Two sources: latencies and counters observed by the API layer as it streams each request
(``ServingMetrics.track``), and engine state pulled from ``client.stats()`` at scrape time by
a custom collector, so a scrape always shows the engine as it is now and nothing polls it in
between. Every metric lives in one registry per app: tests build many apps in one process,
and a PD router serving next to a worker must not share counters with it.

Names, types, labels and their vLLM / SGLang counterparts are documented in docs/metrics.md.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from harness.engine.core.types import EngineClient, FinishReason, TokenEvent

logger = logging.getLogger(__name__)

PREFIX = "pdengine"

# Bucket edges include the Section 6.2 dashboard targets (TTFT P50/P99 < 200/500 ms, TPOT
# P50/P99 < 30/80 ms) so that histogram_quantile is exact at the thresholds the suites judge, and
# below them no bucket's upper edge is more than twice its lower one: a quantile read from these
# buckets is never "bucket-limited" (harness/checks/slo.py) in the range the targets care about.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
               0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class ServingMetrics:
    """The API layer's metrics for one engine client, registered in ``registry``."""

    def __init__(self, client: EngineClient, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.model_name = client.model_name
        labels = ["model_name"]
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token.",
                              labels, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between two consecutive token-bearing engine outputs of a request.",
                             labels, buckets=ITL_BUCKETS, registry=registry)
        self.tpot = Histogram(f"{PREFIX}_request_time_per_output_token_seconds",
                              "Per request: (E2E - TTFT) / (output tokens - 1).",
                              labels, buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from request arrival to its last output (finished or aborted).",
                             labels, buckets=E2E_BUCKETS, registry=registry)
        self.finished = Counter(f"{PREFIX}_requests_finished",
                                "Requests that ended, by finish reason (stop, length, abort, error).",
                                [*labels, "finished_reason"], registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Output tokens delivered to clients.", labels, registry=registry)
        self.http_errors = Counter(f"{PREFIX}_http_errors",
                                   "Error responses of the API, by HTTP status and OpenAI error code.",
                                   ["status", "code"], registry=registry)
        for reason in FinishReason:  # so rate() sees every reason from the first scrape on
            self.finished.labels(self.model_name, reason.value)
        registry.register(EngineStatsCollector(client))

    def track(self, arrival_time: float, *, ttft_on_write: bool = False) -> "RequestTracker":
        """Start timing one request that arrived at ``arrival_time`` (time.monotonic()).
        ``ttft_on_write``: a streamed request's TTFT is stamped when its first chunk is written to
        the client's socket (:meth:`RequestTracker.first_write`), not when the engine produced it."""
        return RequestTracker(self, arrival_time, ttft_on_write=ttft_on_write)

    def count_error(self, status: int, code: str | None) -> None:
        self.http_errors.labels(str(status), code or "").inc()


class RequestTracker:
    """Times one request from the events it streams; ends exactly once (finish or abort)."""

    def __init__(self, metrics: ServingMetrics, arrival_time: float, *, ttft_on_write: bool = False) -> None:
        self._m = metrics
        self._arrival = arrival_time
        self._ttft_on_write = ttft_on_write
        self._ttft_observed = False
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._num_prompt = 0
        self._num_output = 0
        self.done = False

    def observe(self, event: TokenEvent) -> None:
        now = time.monotonic()
        label = self._m.model_name
        self._num_prompt = event.num_prompt_tokens or self._num_prompt
        if event.token_ids:
            if self._first_token_at is None:
                self._first_token_at = now
                if not self._ttft_on_write:
                    self._observe_ttft(now)
            else:
                self._m.itl.labels(label).observe(now - self._last_token_at)
            self._last_token_at = now
            self._num_output += len(event.token_ids)
        if event.finished:
            self._end(event.finish_reason or FinishReason.STOP, now)

    def first_write(self) -> bool:
        """The first chunk of a streamed response was handed to the client's socket: the TTFT a
        client sees (Nagle, a slow event loop or a full socket buffer count; a queue inside the
        engine alone would not). Once per request; the first token's own time still starts TPOT.
        True once the TTFT is observed (a chunk before the first token does not count)."""
        if self._ttft_on_write and self._first_token_at is not None:
            self._observe_ttft(time.monotonic())
        return self._ttft_observed

    def _observe_ttft(self, now: float) -> None:
        if not self._ttft_observed:
            self._ttft_observed = True
            self._m.ttft.labels(self._m.model_name).observe(now - self._arrival)

    def abort(self, reason: FinishReason = FinishReason.ABORT) -> None:
        """The stream ended before the engine finished it: the client went away (ABORT) or
        the engine raised (ERROR). A no-op once the request has ended."""
        if not self.done:
            self._end(reason, time.monotonic())

    def discard(self) -> None:
        """The engine refused the request before it started (bad input, admission control):
        it is an HTTP error (``pdengine_http_errors_total``), not a finished request."""
        self.done = True

    def _end(self, reason: FinishReason, now: float) -> None:
        self.done = True
        label = self._m.model_name
        self._m.e2e.labels(label).observe(now - self._arrival)
        self._m.finished.labels(label, reason.value).inc()
        self._m.prompt_tokens.labels(label).inc(self._num_prompt)
        self._m.generation_tokens.labels(label).inc(self._num_output)
        if self._first_token_at is not None and self._num_output > 1:
            tpot = (now - self._first_token_at) / (self._num_output - 1)
            self._m.tpot.labels(label).observe(tpot)


def engine_alive(client: EngineClient) -> bool:
    """A client may expose ``alive`` (not part of the protocol: stats() of a dead engine can
    still answer with its last values); without it, a client counts as alive."""
    return bool(getattr(client, "alive", True))


class EngineStatsCollector(Collector):
    """Reads ``client.stats()`` at scrape time. A dead engine yields ``pdengine_engine_up 0``
    (with its last stats, or none when stats() raises) instead of breaking the whole scrape."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    def describe(self) -> Iterable[Metric]:
        return []  # collect() calls the engine; do not call it at registration time

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name"]
        model = [self._client.model_name]
        up = GaugeMetricFamily(f"{PREFIX}_engine_up", "1 while the engine is alive and answers stats(), else 0.",
                               labels=labels)
        try:
            stats = self._client.stats()
        except Exception as exc:  # a dead engine must still be visible in the scrape
            logger.warning("engine stats unavailable at scrape time: %s", exc)
            up.add_metric(model, 0.0)
            yield up
            return
        up.add_metric(model, 1.0 if engine_alive(self._client) else 0.0)
        yield up

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            family.add_metric(model, float(value))
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            family.add_metric(model, float(value))
            return family

        total = stats.kv_blocks_total
        yield gauge("num_requests_running", "Requests in the engine's running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests queued in the engine, not yet running.",
                    stats.num_waiting)
        yield gauge("kv_cache_blocks_used", "KV cache blocks in use (HBM tier).", stats.kv_blocks_used)
        yield gauge("kv_cache_blocks_total", "KV cache blocks in the pool (HBM tier).", total)
        yield gauge("kv_cache_block_bytes", "Bytes per KV cache block.", stats.kv_block_bytes)
        yield gauge("kv_cache_usage_ratio", "Used / total KV cache blocks, 0 to 1.",
                    stats.kv_blocks_used / total if total else 0.0)
        yield gauge("spec_decode_enabled", "1 while speculative decoding is on.", int(stats.spec_enabled))
        yield counter("spec_decode_draft_tokens", "Draft tokens proposed by the draft model.",
                      stats.spec_draft_tokens)
        yield counter("spec_decode_accepted_tokens", "Draft tokens accepted by the target model.",
                      stats.spec_accepted_tokens)
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start.",
                    stats.spec_acceptance_rate)
        if stats.extra:
            extra = GaugeMetricFamily(f"{PREFIX}_engine_stat",
                                      "Implementation-specific engine values (EngineStats.extra).",
                                      labels=[*labels, "name"])
            for name, value in sorted(stats.extra.items()):
                extra.add_metric([*model, name], float(value))
            yield extra
