"""Scrape Prometheus ``/metrics`` as a time series while a run goes on.

A background thread scrapes every ``interval_s`` and keeps every sample with the wall and
monotonic time of its scrape. Engine profiles map each engine's metric names to the
harness's own quantities (TTFT, ITL, queue depth, KV use, transfer bytes and failures,
migrations, rejections), so a suite asks for ``kv_usage`` whether the cluster runs the
reference engine, vLLM, SGLang or Dynamo. Scrape failures during a fault are recorded,
not raised: a dead endpoint is itself a measurement.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import httpx
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from harness.errors import ProbeError
from harness.urls import http_url

log = logging.getLogger(__name__)

HISTOGRAMS = ("ttft_seconds", "itl_seconds", "tpot_seconds", "e2e_seconds")

# quantity -> metric family name, per engine (names from each project's docs; REFERENCE.md)
ENGINE_PROFILES: dict[str, dict[str, str]] = {
    "pdengine": {
        "ttft_seconds": "pdengine_time_to_first_token_seconds",
        "itl_seconds": "pdengine_inter_token_latency_seconds",
        "tpot_seconds": "pdengine_request_time_per_output_token_seconds",
        "e2e_seconds": "pdengine_e2e_request_latency_seconds",
        "requests_running": "pdengine_num_requests_running",
        "requests_waiting": "pdengine_num_requests_waiting",
        "kv_usage": "pdengine_kv_cache_usage_ratio",
        "kv_blocks_used": "pdengine_kv_cache_blocks_used",
        "kv_blocks_total": "pdengine_kv_cache_blocks_total",
        "prompt_tokens": "pdengine_prompt_tokens",
        "generation_tokens": "pdengine_generation_tokens",
        "requests_finished": "pdengine_requests_finished",
        "http_errors": "pdengine_http_errors",
        "spec_enabled": "pdengine_spec_decode_enabled",
        "spec_draft_tokens": "pdengine_spec_decode_draft_tokens",
        "spec_accepted_tokens": "pdengine_spec_decode_accepted_tokens",
        "engine_up": "pdengine_engine_up",
        # PD router (docs/pd.md): per worker and path, summed by series()
        "kv_transfer_bytes": "pdengine_kv_transfer_bytes",
        "kv_transfer_seconds": "pdengine_kv_transfer_seconds",
        "kv_transfer_retries": "pdengine_kv_transfer_retries",
        "kv_transfer_fallbacks": "pdengine_kv_transfer_fallbacks",
        "kv_transfer_failures": "pdengine_kv_transfer_failures",
        "kv_transfer_rejected_frames": "pdengine_kv_transfer_rejected_frames",
        "workers_up": "pdengine_worker_up",
        "worker_queue_depth": "pdengine_worker_queue_depth",
        "admission_queue": "pdengine_router_admission_queue",
        "reschedules": "pdengine_router_reschedules",
        "reschedule_failures": "pdengine_router_reschedule_failures",
        "admission_timeouts": "pdengine_router_admission_timeouts",
        "worker_down_events": "pdengine_router_worker_down_events",
        "degradation_level": "pdengine_degradation_level",
    },
    "vllm": {
        "ttft_seconds": "vllm:time_to_first_token_seconds",
        "itl_seconds": "vllm:inter_token_latency_seconds",
        "tpot_seconds": "vllm:request_time_per_output_token_seconds",
        "e2e_seconds": "vllm:e2e_request_latency_seconds",
        "requests_running": "vllm:num_requests_running",
        "requests_waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc",
        "prompt_tokens": "vllm:prompt_tokens",
        "generation_tokens": "vllm:generation_tokens",
        "requests_finished": "vllm:request_success",
        "preemptions": "vllm:num_preemptions",
        "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
        "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
        # NIXL's byte and time series are histograms (one observation per transfer): the totals are
        # their _sum, the number of transfers their _count, so series()/rate() read those samples
        "kv_transfer_bytes": "vllm:nixl_bytes_transferred_sum",
        "kv_transfers": "vllm:nixl_bytes_transferred_count",
        "kv_transfer_seconds": "vllm:nixl_xfer_time_seconds_sum",
        "kv_transfer_failures": "vllm:nixl_num_failed_transfers",
        # prompt tokens by where their KV came from; series("prompt_tokens_by_source",
        # source="external_kv_transfer") shows KV that moved in from a prefill instance
        "prompt_tokens_by_source": "vllm:prompt_tokens_by_source",
    },
    "sglang": {
        "ttft_seconds": "sglang:time_to_first_token_seconds",
        "itl_seconds": "sglang:inter_token_latency_seconds",
        "e2e_seconds": "sglang:e2e_request_latency_seconds",
        "requests_running": "sglang:num_running_reqs",
        "requests_waiting": "sglang:num_queue_reqs",
        "kv_usage": "sglang:token_usage",
        "prompt_tokens": "sglang:prompt_tokens",
        "generation_tokens": "sglang:generation_tokens",
        "kv_transfer_failures": "sglang:num_transfer_failed_reqs",
        "kv_transfer_retries": "sglang:num_prefill_retries",
    },
    "dynamo": {
        "ttft_seconds": "dynamo_frontend_time_to_first_token_seconds",
        "itl_seconds": "dynamo_frontend_inter_token_latency_seconds",
        "e2e_seconds": "dynamo_frontend_request_duration_seconds",
        "requests_waiting": "dynamo_frontend_queued_requests",
        "requests_finished": "dynamo_frontend_requests",
        "migrations": "dynamo_frontend_model_migration",        # every migration_type (QUANTITY_LABELS)
        # only streams moved after their first token: migration_type="ongoing_request" (a request sent
        # to a dead worker before its first token is "new_request": no stream crossed anything)
        "migrations_ongoing": "dynamo_frontend_model_migration",
        "rejections": "dynamo_frontend_model_rejection",   # _total: requests refused as overloaded (HTTP 529/503)
        # worker kvstats (each worker's system port, DYN_SYSTEM_PORT): KV use 0..1 and blocks
        "kv_usage": "dynamo_component_kvstats_gpu_cache_usage_percent",
        "kv_blocks_used": "dynamo_component_kvstats_active_blocks",
        "kv_blocks_total": "dynamo_component_kvstats_total_blocks",
        # each worker's system port: requests its handlers took (counts a restarted worker's new traffic)
        "worker_requests": "dynamo_component_requests",
    },
}

# profile -> quantity -> the label values its samples must carry (a quantity not listed: every series of
# its family, summed). Two quantities may read one family with different labels.
QUANTITY_LABELS: dict[str, dict[str, dict[str, str]]] = {
    "dynamo": {"migrations_ongoing": {"migration_type": "ongoing_request"}},
}


def quantity_labels(profile: str | None, quantity: str) -> dict[str, str]:
    """The labels a sample of ``quantity`` must carry in ``profile`` ({}: any)."""
    return QUANTITY_LABELS.get(profile or "", {}).get(quantity, {})


def counts_for(sample: Sample, family: str, labels: dict[str, str]) -> bool:
    """Is ``sample`` one of the series of ``family`` (with or without ``_total``) carrying ``labels``?"""
    if sample.name not in (family, family + "_total"):
        return False
    have = dict(sample.labels)
    return all(have.get(k) == v for k, v in labels.items())


# the cluster file's ``engine:`` -> metric profile; None: the engine exposes no Prometheus metrics
ENGINE_PROFILE_OF = {"bundled": "pdengine", "vllm": "vllm", "sglang": "sglang", "dynamo": "dynamo", "openai": None}


def engine_of(cluster: object) -> str:
    """The engine a cluster runs (``engine:`` of the cluster file; files without one: bundled)."""
    return getattr(cluster, "engine", None) or "bundled"


def profile_for(cluster: object) -> str | None:
    """The metric profile to scrape ``cluster`` with, or None when its engine has no metrics."""
    engine = engine_of(cluster)
    if engine not in ENGINE_PROFILE_OF:
        raise ProbeError(f"engine {engine!r} has no metric profile",
                         fix=f"set engine: to one of {', '.join(ENGINE_PROFILE_OF)}")
    return ENGINE_PROFILE_OF[engine]


@dataclass(frozen=True)
class Sample:
    t_wall_ns: int
    t_mono_ns: int
    name: str                        # sample name as exposed (``_total``, ``_bucket`` ... included)
    labels: tuple[tuple[str, str], ...]
    value: float


def parse_metrics(text: str, t_wall_ns: int = 0, t_mono_ns: int = 0) -> list[Sample]:
    """Samples of one Prometheus text exposition (prometheus_client's own parser)."""
    try:
        return [Sample(t_wall_ns, t_mono_ns, s.name, tuple(sorted(s.labels.items())), float(s.value))
                for family in text_string_to_metric_families(text) for s in family.samples]
    except (ValueError, TypeError, IndexError) as exc:
        raise ProbeError(f"response is not Prometheus text format: {exc}",
                         fix="point the scraper at the server's /metrics endpoint") from exc


def _matches(sample_name: str, family: str) -> bool:
    return sample_name == family or sample_name == family + "_total"


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (le, count) buckets: linear
    interpolation inside the bucket holding the q-th observation; NaN with no observations."""
    if not 0 <= q <= 1:
        raise ProbeError(f"quantile must be in [0, 1], got {q!r}", fix="pass e.g. 0.99 for p99")
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):  # the q-th observation is above the last finite bound
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return buckets[-1][0]


class PrometheusScraper:
    """Scrapes ``url`` every ``interval_s`` in a background thread.

    ``start()`` scrapes once synchronously and raises ProbeError if the endpoint is wrong
    (unreachable or not Prometheus text), so a misconfigured run fails before its load."""

    def __init__(self, url: str, interval_s: float = 1.0, *, engine: str = "pdengine", timeout_s: float = 5.0,
                 api_key: str | None = None) -> None:
        if interval_s <= 0:
            raise ProbeError(f"scrape interval must be > 0 s, got {interval_s!r}", fix="pass e.g. interval_s=1.0")
        if engine not in ENGINE_PROFILES:
            raise ProbeError(f"unknown engine profile {engine!r}", fix=f"use one of {', '.join(ENGINE_PROFILES)}")
        self.url = http_url(url, "metrics URL", "http://127.0.0.1:8000/metrics")
        self.interval_s = interval_s
        self.profile = ENGINE_PROFILES[engine]
        self.samples: list[Sample] = []
        self.errors: list[tuple[int, str]] = []   # (wall ns, message) of failed scrapes
        self.scrapes = 0
        self._http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape_once(self) -> list[Sample]:
        t_wall, t_mono = time.time_ns(), time.monotonic_ns()
        resp = self._http.get(self.url)
        if resp.status_code != 200:
            raise ProbeError(f"GET {self.url} answered HTTP {resp.status_code}",
                             fix="check the metrics URL (usually /metrics on the API port)")
        samples = parse_metrics(resp.text, t_wall, t_mono)
        with self._lock:
            self.samples.extend(samples)
            self.scrapes += 1
        return samples

    def start(self) -> PrometheusScraper:
        if self._thread is not None:
            raise ProbeError("scraper already started", fix="create one scraper per run")
        try:
            self.scrape_once()
        except httpx.HTTPError as exc:
            raise ProbeError(f"cannot scrape {self.url}: {exc}", fix="check the server is up and the URL") from exc
        self._thread = threading.Thread(target=self._loop, name="prometheus-scraper", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.scrape_once()
            except (httpx.HTTPError, ProbeError) as exc:
                log.debug("scrape of %s failed: %s", self.url, exc)
                with self._lock:
                    self.errors.append((time.time_ns(), str(exc) or type(exc).__name__))

    def stop(self) -> None:
        """Stop the thread (after one last scrape, so the series covers the run's end). Idempotent."""
        if self._thread is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            try:
                self.scrape_once()
            except (httpx.HTTPError, ProbeError) as exc:
                self.errors.append((time.time_ns(), str(exc)))
        self._http.close()

    def __enter__(self) -> PrometheusScraper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- reading the series

    def family(self, quantity: str) -> str:
        try:
            return self.profile[quantity]
        except KeyError:
            raise ProbeError(f"quantity {quantity!r} has no metric in this engine profile",
                             fix=f"use one of {', '.join(sorted(self.profile))}") from None

    def frame(self) -> pd.DataFrame:
        """Every sample: t_wall_ns, t_mono_ns, name, labels (dict), value."""
        with self._lock:
            rows = [(s.t_wall_ns, s.t_mono_ns, s.name, dict(s.labels), s.value) for s in self.samples]
        return pd.DataFrame(rows, columns=["t_wall_ns", "t_mono_ns", "name", "labels", "value"])

    def series(self, quantity: str, **label_filter: str) -> pd.DataFrame:
        """One value per scrape (t_wall_ns, value) of a gauge or counter quantity, summed over
        the label sets that match ``label_filter`` (e.g. all workers of a PD cluster)."""
        family = self.family(quantity)
        with self._lock:
            rows = [(s.t_wall_ns, s.value) for s in self.samples
                    if _matches(s.name, family) and _labels_match(s.labels, label_filter)]
        df = pd.DataFrame(rows, columns=["t_wall_ns", "value"])
        return df.groupby("t_wall_ns", as_index=False)["value"].sum()

    def rate(self, quantity: str, **label_filter: str) -> pd.DataFrame:
        """Per-second increase of a counter quantity between consecutive scrapes (t_wall_ns of
        the later scrape, per_s). A drop (a restarted process reset its counter) counts the new
        value as the increase, as Prometheus' rate() does."""
        df = self.series(quantity, **label_filter)
        dt_s = df["t_wall_ns"].diff() / 1e9
        dv = df["value"].diff()
        dv = dv.where(dv >= 0, df["value"])
        out = pd.DataFrame({"t_wall_ns": df["t_wall_ns"], "per_s": dv / dt_s})
        return out.iloc[1:].reset_index(drop=True)

    def quantile(self, quantity: str, q: float, *, start_wall_ns: int | None = None,
                 end_wall_ns: int | None = None) -> float:
        """q-quantile of a histogram quantity over the observations made between two scrapes:
        the last scrape at or before ``start_wall_ns`` (default: since the server started) and the last one
        at or before ``end_wall_ns`` (default: the last). Bucket counts are summed over label sets."""
        family = self.family(quantity)
        if quantity not in HISTOGRAMS:
            raise ProbeError(f"{quantity!r} is not a histogram", fix=f"use one of {', '.join(HISTOGRAMS)}")
        with self._lock:
            per_scrape: dict[int, dict[float, float]] = {}
            for s in self.samples:
                if s.name == family + "_bucket":
                    le = float(dict(s.labels)["le"])
                    scrape = per_scrape.setdefault(s.t_wall_ns, {})
                    scrape[le] = scrape.get(le, 0.0) + s.value
        times = sorted(per_scrape)
        if not times:
            return math.nan
        t_start = None if start_wall_ns is None else max((t for t in times if t <= start_wall_ns), default=None)
        t_end = max((t for t in times if end_wall_ns is None or t <= end_wall_ns), default=None)
        if t_end is None:
            return math.nan  # nothing observed by end_wall_ns
        end = per_scrape[t_end]
        begin = per_scrape[t_start] if t_start is not None else {}  # none: counts since the server started
        return histogram_quantile(q, [(le, end[le] - begin.get(le, 0.0)) for le in end])


def _labels_match(labels: tuple[tuple[str, str], ...], wanted: dict[str, str]) -> bool:
    if not wanted:
        return True
    have = dict(labels)
    return all(have.get(k) == v for k, v in wanted.items())
