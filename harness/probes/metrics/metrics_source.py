"""Where a suite's engine metrics come from: each endpoint's ``/metrics`` scraped by the harness, or the
cluster's own Prometheus queried with PromQL (``endpoints.prometheus`` in the cluster file).

Both answer the same two questions, in the harness's quantity names (``kv_usage``, ``migrations``, ...
of :data:`harness.probes.metrics.prometheus.ENGINE_PROFILES`) and keyed by the metrics URL the cluster file
names, so a suite asks them the same way and never branches on the source:

* :meth:`MetricsSource.read`: each endpoint's current values (summed over its label sets; a quantity
  the profile restricts to some label values, :data:`harness.probes.metrics.prometheus.QUANTITY_LABELS`,
  over those series only). With
  ``settled=True`` the values reflect the state at the moment of the call: a scrape is always live,
  a Prometheus waits (bounded) until it has scraped every endpoint again.
* :meth:`MetricsSource.series`: each endpoint's values over a past window. A scrape source can only
  give what it read itself meanwhile (its history of ``read``); a Prometheus gives every sample it
  scraped, with the scrape's own timestamps.

``label`` (``scrape`` or ``prometheus http://...``) goes into the verdicts' evidence, so a reader of
the report knows which way the numbers came.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import httpx

from harness.errors import ProbeError
from harness.probes.metrics.metrics_base import MetricsSource, Reading, Series
from harness.probes.metrics.prometheus import counts_for, parse_metrics
from harness.probes.metrics.promql import PrometheusSource

SCRAPE = "scrape"

class ScrapeSource(MetricsSource):
    """GET every endpoint's ``/metrics`` (with the cluster's API key, as its API wants) on each read.
    Keeps what it read, so that ``series`` can answer for the windows it was reading in."""

    label = SCRAPE

    def __init__(self, profile: str, *, api_key: str | None = None, timeout_s: float = 5.0) -> None:
        super().__init__(profile)
        self._http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._history: list[Reading] = []
        self._lock = threading.Lock()

    def _read_one(self, url: str, families: dict[str, str]) -> dict[str, float]:
        try:
            resp = self._http.get(url)
        except httpx.HTTPError as exc:
            raise ProbeError(f"cannot scrape {url}: {exc}", fix="check the metrics URL and that the server is up") \
                from exc
        if resp.status_code != 200:
            raise ProbeError(f"GET {url} answered HTTP {resp.status_code}", fix="check the metrics URL")
        out: dict[str, float] = {}
        for s in parse_metrics(resp.text):
            for quantity, family in families.items():
                if counts_for(s, family, self.labels(quantity)):
                    out[quantity] = out.get(quantity, 0.0) + s.value
        return out

    def read(self, urls: Sequence[str], quantities: Sequence[str], *, settled: bool = False) -> Reading:
        families = {q: self.family(q) for q in quantities}
        reading = Reading(time.time_ns())
        for url in urls:
            sent = time.time_ns()
            try:
                reading.values[url] = self._read_one(url, families)
            except ProbeError as exc:
                reading.errors[url] = str(exc)
                continue
            # the endpoint rendered its values between the request and the answer: the midpoint
            reading.times[url] = (sent + time.time_ns()) // 2
        with self._lock:
            self._history.append(reading)
        return reading

    def series(self, urls: Sequence[str], quantity: str, start_wall_ns: int, end_wall_ns: int) -> Series:
        with self._lock:
            history = list(self._history)
        return {url: [(r.time_of(url), r.values[url][quantity]) for r in history
                      if quantity in r.values.get(url, {}) and start_wall_ns <= r.time_of(url) <= end_wall_ns]
                for url in urls}

    def close(self) -> None:
        self._http.close()


def source_label(cluster: Any) -> str:
    """What :func:`metrics_source` would read ``cluster`` with, without contacting anything."""
    url = getattr(cluster, "prometheus_url", None)
    return f"prometheus {url}" if url else SCRAPE


def metrics_source(cluster: Any, profile: str | None = None) -> MetricsSource:
    """The cluster's Prometheus when its file names one (``endpoints.prometheus``), else direct scraping
    with the cluster's API key; ``profile`` defaults to the engine's."""
    profile = profile or cluster.spec.metric_profile
    if profile is None:
        raise ProbeError(f"engine {cluster.engine!r} has no metric profile",
                         fix="set engine: (vllm, sglang, dynamo) in the cluster file")
    if getattr(cluster, "prometheus_url", None):
        return PrometheusSource(cluster.prometheus_url, profile)
    return ScrapeSource(profile, api_key=cluster.api_key())


__all__ = ["MetricsSource", "Reading", "SCRAPE", "ScrapeSource", "Series", "metrics_source", "source_label"]
