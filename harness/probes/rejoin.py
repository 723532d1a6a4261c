"""When is a restarted (or resumed) worker of a foreign cluster back? When the cluster serves
through it again, not when its own health URL answers: a router whose circuit breaker still holds
the worker out leaves the cluster short of that worker however healthy it is (measured here:
vllm-router kept a restarted vLLM instance out for over 100 s after its ``/health`` answered 200).

From the moment the worker is healthy, while load flows, the watch polls (every ``POLL_S``):

1. **the worker's own metrics** (its ``metrics:`` URL, read with the engine's profile,
   harness/probes/prometheus.py): the first counter of new work on it that it exports rises above
   its value at the first read: prompt tokens (a request admitted and prefilled there), else
   finished requests, else generated tokens. Prompt tokens come first because a request that was
   already on the worker (stalled by a hang, then resumed) adds none: only new traffic does;
2. **the router's own view** of that worker, where the router on ``endpoints.metrics`` exports one
   (``ROUTER_VIEWS``): its count of requests sent to the worker (label ``worker`` = the worker's
   ``api`` URL) rises.

The worker is taken back at the first poll (at most one poll and one scrape late) where either
source has risen and, when the router exports its circuit breaker for the worker, that breaker is
closed: a half-open breaker lets a few trial requests through while the router still sends the
rest elsewhere (measured here: vllm-router's trial requests reached a restarted instance while the
other one, hung, got the load). The breaker's states are kept as evidence, each with its time. A worker with neither source cannot be observed: it counts as back when healthy,
and the result says so, naming that weaker check. Scrape failures are kept, never raised: a
metrics URL that does not answer is itself evidence.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import httpx

from harness.errors import ProbeError
from harness.probes.prometheus import ENGINE_PROFILES, Sample, parse_metrics

log = logging.getLogger(__name__)

POLL_S = 0.5
# preference order; worker_requests: an engine whose worker pages count only requests taken (Dynamo's
# system port), read last because a request that waited in a hung worker's socket counts when it resumes
SERVED_QUANTITIES = ("prompt_tokens", "requests_finished", "generation_tokens", "worker_requests")
BREAKER_STATES = {0: "closed", 1: "open", 2: "half_open"}
_KEPT_PROBLEMS = 5


@dataclass(frozen=True)
class RouterView:
    """What a router exports about each worker: requests it sent there, its circuit breaker."""

    sent: str          # counter family, one series per worker
    breaker: str       # gauge family: 0 closed, 1 open, 2 half_open
    label: str = "worker"


# router name -> its metric families (vllm-router 0.1.17 measured here; sglang-router from its source)
ROUTER_VIEWS = {
    "vllm-router": RouterView("vllm_router_processed_requests", "vllm_router_cb_state"),
    "sglang-router": RouterView("sgl_router_processed_requests", "sgl_router_cb_state"),
}


@dataclass
class Rejoin:
    """One worker's way back: healthy at ``healthy_wall``, first traffic at ``traffic_wall``, in the
    cluster's rotation (traffic, and the router's breaker closed where it exports one) at ``serving_wall``."""

    worker: str
    limit_s: float
    healthy_wall: float
    watched: list[str]                  # sources read, e.g. "vllm:prompt_tokens on http://...:8102/metrics"
    kept_out_by: str = "the cluster"    # the router's name when its view was found
    serving_wall: float | None = None
    traffic_wall: float | None = None   # the first rise (with a half-open breaker: a trial request)
    seen_by: str | None = None          # which of ``watched`` rose first
    watched_s: float = 0.0              # how long it was watched after it was healthy
    breaker: list[tuple[float, str]] = field(default_factory=list)  # (s after healthy, state) at each change
    problems: list[str] = field(default_factory=list)               # scrapes that failed (the last few)

    @property
    def observable(self) -> bool:
        return bool(self.watched)

    @property
    def back(self) -> bool:
        return self.serving_wall is not None

    @property
    def after_healthy_s(self) -> float | None:
        return None if self.serving_wall is None else max(0.0, self.serving_wall - self.healthy_wall)

    @property
    def kept_out_s(self) -> float | None:
        """How long the cluster kept the healthy worker out: until it was taken back, or at least
        as long as it was watched; None when that cannot be observed."""
        if not self.observable:
            return None
        return self.after_healthy_s if self.back else self.watched_s

    def sentence(self) -> str:
        """The one line the report shows for this worker's way back."""
        if not self.observable:
            why = (f"its metrics could not be read: {self.problems[-1]}" if self.problems
                   else "no metrics URL on the worker and no router view of it")
            return (f"{self.worker} answers its health URL; whether the cluster sends it traffic cannot be observed "
                    f"({why}): back by health alone, a weaker check")
        took = self.after_healthy_s
        if took is not None and took > self.limit_s:
            return f"{self.kept_out_by} kept {self.worker} out for {took:.0f} s after it was healthy"
        if took is not None:
            return f"{self.kept_out_by} took {self.worker} back {took:.1f} s after it was healthy"
        breaker = f" (its circuit breaker: {self.breaker[-1][1]})" if self.breaker else ""
        return f"{self.kept_out_by} kept {self.worker} out for {self.watched_s:.0f}+ s after it was healthy{breaker}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(observable=self.observable, back=self.back, kept_out_s=_round(self.kept_out_s),
                 after_healthy_s=_round(self.after_healthy_s), sentence=self.sentence())
        return d


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


@dataclass
class _Source:
    """One counter watched for a rise: the first of ``families`` that ``url`` exports, summed over
    its series (a router's: only the series whose ``label`` names the worker's URL)."""

    name: str
    url: str
    families: tuple[str, ...]
    label: str | None = None
    worker_url: str = ""
    family: str | None = None
    baseline: float | None = None
    absent: bool = False   # the URL answered without any of the families: nothing to watch there

    def describe(self) -> str:
        where = f" ({self.label}={self.worker_url})" if self.label else ""
        return f"{self.family or ' / '.join(self.families)} on {self.url}{where}"

    def mine(self, labels: tuple[tuple[str, str], ...]) -> bool:
        # a router labels a worker by its URL as the router was given it (a trailing slash or not)
        return self.label is None or dict(labels).get(self.label, "").rstrip("/") == self.worker_url.rstrip("/")


def _total(samples: list[Sample], family: str, keep: Callable[[tuple[tuple[str, str], ...]], bool]) -> float | None:
    """Sum of the ``family`` samples that ``keep`` accepts; None when the family is not exported."""
    found = [s for s in samples if s.name in (family, family + "_total")]
    return None if not found else sum(s.value for s in found if keep(s.labels))


def _any(_labels: tuple[tuple[str, str], ...]) -> bool:
    return True


class RejoinWatch:
    """Watch one worker from the moment it is healthy (``start``) until traffic runs through it
    (``wait``, resumable: wait up to a limit, then longer to learn when)."""

    def __init__(self, worker: str, *, worker_api: str, worker_metrics: str | None, profile: str | None,
                 router_metrics: str | None, limit_s: float, headers: Mapping[str, str] | None = None,
                 poll_s: float = POLL_S, nudge: Callable[[], None] | None = None) -> None:
        self.worker, self.worker_api, self.limit_s, self.poll_s = worker, worker_api, limit_s, poll_s
        # sends one small request through the cluster's API: traffic to watch for when no load runs
        # (6.1.2's idle phase); None: the caller's load is the traffic
        self._nudge = nudge
        self._headers = dict(headers or {})
        self._router_metrics = router_metrics
        self._router_read = not router_metrics   # True once the router's page was read (or there is none)
        self._breaker: _Source | None = None
        self._sources: list[_Source] = []
        quantities = ENGINE_PROFILES.get(profile or "", {})
        families = tuple(quantities[q] for q in SERVED_QUANTITIES if q in quantities)
        if worker_metrics and families:
            self._sources.append(_Source("worker", worker_metrics, families))
        self.healthy_mono: float | None = None
        self.result: Rejoin | None = None

    @classmethod
    def for_worker(cls, cluster: Any, worker: Any, limit_s: float, **kwargs: Any) -> RejoinWatch:
        """The watch of an inventory worker (a cluster file ``workers:`` entry) of ``cluster``."""
        metrics = getattr(worker, "metrics", None)
        return cls(str(worker.name), worker_api=str(worker.api), worker_metrics=str(metrics) if metrics else None,
                   profile=cluster.spec.metric_profile, router_metrics=cluster.metrics_url, limit_s=limit_s,
                   headers=cluster.auth_headers(), **kwargs)

    def start(self) -> Rejoin:
        """The worker is healthy now: find the router's view and read every source's starting value."""
        self.healthy_mono = time.monotonic()
        self.result = Rejoin(self.worker, self.limit_s, time.time(), watched=[])
        with httpx.Client(timeout=5.0, headers=self._headers) as http:
            self._poll(http)
        return self.result

    def hook(self, worker_id: str) -> str:
        """ProcessKill's ``rejoined`` hook: start now (the worker is healthy), wait up to the limit.
        A cluster that keeps the worker out is reported, never raised: a finding, not a failed revert."""
        del worker_id  # the watch knows its worker
        if self.result is None:
            self.start()
        return self.wait(self.limit_s).sentence()

    def wait(self, timeout_s: float) -> Rejoin:
        """Poll until the worker is back (traffic through it, the router's breaker for it closed where
        exported) or ``timeout_s`` more seconds have passed; resumable."""
        result = self.result or self.start()
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, headers=self._headers) as http:
            while (self._live() or not self._router_read) and not result.back and time.monotonic() < deadline:
                if self._nudge is not None:
                    self._nudge()
                time.sleep(self.poll_s)  # the cluster's own pace: nothing to do until the next scrape
                self._poll(http)
        if not result.back:
            result.watched_s = round(self._since_healthy(), 2)
        log.info("%s", result.sentence())
        return result

    # -- internals ---------------------------------------------------------------------------------

    def _live(self) -> list[_Source]:
        return [s for s in self._sources if not s.absent]

    def _since_healthy(self) -> float:
        return time.monotonic() - (self.healthy_mono or time.monotonic())

    def _scrape(self, http: httpx.Client, url: str, families: list[str]) -> list[Sample] | None:
        """The samples of ``families`` on ``url`` (other lines are skipped before parsing: a
        vLLM /metrics page is mostly histogram buckets); None when the scrape failed."""
        try:
            resp = http.get(url)
            if resp.status_code != 200:
                raise httpx.HTTPError(f"HTTP {resp.status_code}")
            prefixes = tuple(families)
            return parse_metrics("\n".join(line for line in resp.text.splitlines() if line.startswith(prefixes)))
        except (httpx.HTTPError, ProbeError) as exc:
            problems = self.result.problems if self.result else []
            problems.append(f"+{self._since_healthy():.1f} s {url}: {exc}")
            del problems[:-_KEPT_PROBLEMS]
            return None

    def _find_router(self, http: httpx.Client) -> None:
        """Does the router on endpoints.metrics export a view of its workers (ROUTER_VIEWS)? Asked
        until its page could be read once."""
        views = list(ROUTER_VIEWS.items())
        samples = self._scrape(http, self._router_metrics, [v.sent for _, v in views])  # type: ignore[arg-type]
        if samples is None:
            return
        self._router_read = True
        for name, view in views:
            if _total(samples, view.sent, _any) is not None:
                assert self.result is not None
                self.result.kept_out_by = name
                self._sources.append(_Source(name, self._router_metrics, (view.sent,), view.label, self.worker_api))
                self._breaker = _Source(name, self._router_metrics, (view.breaker,), view.label, self.worker_api)
                return

    def _poll(self, http: httpx.Client) -> None:
        result = self.result
        assert result is not None
        if not self._router_read:
            self._find_router(http)
        by_url: dict[str, list[Sample] | None] = {}
        for src in self._live():
            if src.url not in by_url:
                families = [f for s in self._sources + [self._breaker] if s and s.url == src.url for f in s.families]
                by_url[src.url] = self._scrape(http, src.url, families)
            value = None if by_url[src.url] is None else self._read(src, by_url[src.url])  # type: ignore[arg-type]
            if value is None:
                continue
            if src.baseline is None:
                src.baseline = value
            elif value > src.baseline and result.traffic_wall is None:
                result.traffic_wall, result.seen_by = time.time(), src.describe()
        result.watched = [s.describe() for s in self._live() if s.baseline is not None]
        if self._breaker is not None and by_url.get(self._breaker.url):
            self._note_breaker(by_url[self._breaker.url])  # type: ignore[arg-type]
        in_rotation = not result.breaker or result.breaker[-1][1] == "closed"
        if result.traffic_wall is not None and in_rotation and not result.back:
            result.serving_wall = time.time()

    @staticmethod
    def _read(src: _Source, samples: list[Sample]) -> float | None:
        if src.family is None:
            src.family = next((f for f in src.families if _total(samples, f, _any) is not None), None)
            if src.family is None:
                src.absent = True
                return None
        return _total(samples, src.family, src.mine)

    def _note_breaker(self, samples: list[Sample]) -> None:
        src, result = self._breaker, self.result
        assert src is not None and result is not None
        values = [s.value for s in samples if s.name == src.families[0] and src.mine(s.labels)]
        if values:
            state = BREAKER_STATES.get(int(values[0]), str(values[0]))
            if not result.breaker or result.breaker[-1][1] != state:
                result.breaker.append((round(self._since_healthy(), 2), state))


__all__ = ["POLL_S", "ROUTER_VIEWS", "Rejoin", "RejoinWatch", "RouterView", "SERVED_QUANTITIES"]
