"""When is a restarted (or resumed) worker of a foreign cluster back? **When it serves**: a request
SENT AFTER the revert gets tokens from it, and the cluster sends it its traffic again; never its
health URL alone (a router whose circuit breaker still holds the worker out leaves the cluster short
of it however healthy it is: vllm-router kept a restarted vLLM instance out for over 100 s after its
``/health`` answered 200), and never a counter that work queued during the fault can move (behind a
plain reverse proxy, a resumed vLLM's prompt-token counter rose 4.6 s after it was healthy while
requests sent to it after the resume still got no token for 2.6 s more: the counter was the
requests queued during the hang draining).

From the moment the worker is healthy again (``start``, after the revert), polled every ``POLL_S``:

1. **served** (``Rejoin.served_wall``): a request sent after the revert got a token from the worker.
   * A worker with an API of its own (its ``api`` is neither the cluster's nor another worker's):
     the watch's own probe, one short completion at a time sent straight to it, from ``start`` on.
     Work queued there during a hang is admitted first (first come, first served), so the probe's
     first token comes only once the worker takes new work.
   * Else a **restarted** worker (a kill's revert, ``restarted=True``): a new process counts only
     requests it got since it started, all sent after the revert: the first rise of a counter of its
     own metrics (prompt tokens, else finished requests, else generated tokens, else requests taken).
   * Else (a **resumed** worker with no API of its own, e.g. a Dynamo mocker behind its frontend):
     nothing tells its new requests from work queued during the hang (its frontend counts nothing per
     worker); **not observed**, never back by health alone (a hung mocker's registration can expire):
     a verdict that needs it cannot pass (inconclusive naming why, :func:`not_observed`).
2. **taken back** (``Rejoin.serving_wall``, judged against 6.1.4's ``rejoin_limit_s``): served, and
   the cluster's traffic reaches it: a counter rises over its value read once the worker was served
   (the probe's own request already counted), on the worker's own metrics (prompt tokens or requests
   taken; a restarted worker also finished requests or generated tokens, which a resumed worker's
   queued streams move as they finish) or in the router's view of it (``ROUTER_VIEWS``: its requests
   sent to the worker, label ``worker`` = its ``api`` URL); and, where the router exports its circuit
   breaker for the worker, that breaker closed (a half-open breaker lets trial requests through
   while the router sends the rest elsewhere). Served by the probe with no counter to read: taken
   back when served, and the sentence says that only a request sent straight to it was seen.

Scrape failures and failed probes are kept (the last few), never raised: a metrics URL that does not
answer is itself evidence. The breaker's states are kept as evidence, each with its time."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import httpx

from harness.errors import ProbeError
from harness.probes.metrics.prometheus import ENGINE_PROFILES, Sample, parse_metrics
from harness.probes.workers.rejoin_probe import Probe, ProbeLoop, own_api, straight_probe

log = logging.getLogger(__name__)

POLL_S = 0.5
# preference order of a restarted worker's own counters (a new process: every one counts only its new requests)
SERVED_QUANTITIES = ("prompt_tokens", "requests_finished", "generation_tokens", "worker_requests")
# a resumed worker's: counted at admission, as a request queued before the probe was already (finished
# requests and generated tokens rise as the streams it held finish)
ADMITTED_QUANTITIES = ("prompt_tokens", "worker_requests")
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
    """One worker's way back: healthy at ``healthy_wall``; a request sent after the revert served at
    ``served_wall``; the cluster's traffic on it (after that) at ``traffic_wall``; in the cluster's
    rotation (traffic, and the router's breaker closed where it exports one) at ``serving_wall``."""

    worker: str
    limit_s: float
    healthy_wall: float
    watched: list[str]                  # what was read, e.g. "vllm:prompt_tokens on http://...:8102/metrics"
    kept_out_by: str = "the cluster"    # the router's name when its view was found
    serving_wall: float | None = None
    traffic_wall: float | None = None   # the first rise after served (with a half-open breaker: a trial request)
    seen_by: str | None = None          # which of ``watched`` rose first
    watched_s: float = 0.0              # how long it was watched after it was healthy
    breaker: list[tuple[float, str]] = field(default_factory=list)  # (s after healthy, state) at each change
    problems: list[str] = field(default_factory=list)               # scrapes and probes that failed (the last few)
    served_wall: float | None = None    # the first token of a request sent after the revert
    served_how: str | None = None       # how that was seen
    probes: int = 0                     # requests the watch sent straight to the worker
    unobservable: str | None = None     # why whether it serves cannot be seen (then not observed, never back)
    # how late ``serving_wall`` may be: the time since the previous poll began (the rise happened in between)
    resolution_s: float | None = None

    @property
    def observable(self) -> bool:
        return bool(self.watched) and self.unobservable is None

    @property
    def back(self) -> bool:
        return self.serving_wall is not None

    @property
    def after_healthy_s(self) -> float | None:
        return None if self.serving_wall is None else max(0.0, self.serving_wall - self.healthy_wall)

    @property
    def served_after_healthy_s(self) -> float | None:
        return None if self.served_wall is None else max(0.0, self.served_wall - self.healthy_wall)

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
            why = self.unobservable or (f"its metrics could not be read: {self.problems[-1]}" if self.problems
                                        else "no metrics URL on the worker and no router view of it")
            return (f"{self.worker} answers its health URL; whether it serves requests sent after the revert cannot "
                    f"be observed ({why}): its rejoin was not observed, never taken as back by health alone")
        took, served = self.after_healthy_s, self.served_after_healthy_s
        if served is None and self.probes:   # its own requests, sent straight to it, got no token
            return (f"{self.worker} served no request sent after the revert for {self.watched_s:.0f}+ s after it "
                    "was healthy")
        if took is not None and took > self.limit_s:
            return f"{self.kept_out_by} kept {self.worker} out for {took:.0f} s after it was healthy"
        if took is not None:
            only = "; only a request sent straight to it was seen" if self.seen_by == self.served_how else ""
            how = f" (a request sent after the revert served +{served:.1f} s{only})" if self.probes else ""
            return f"{self.kept_out_by} took {self.worker} back {took:.1f} s after it was healthy{how}"
        breaker = f"its circuit breaker: {self.breaker[-1][1]}" if self.breaker else ""
        clause = "; ".join(([f"it served a request sent after the revert +{served:.1f} s"] if served is not None else [])
                           + ([breaker] if breaker else []))
        return (f"{self.kept_out_by} kept {self.worker} out for {self.watched_s:.0f}+ s after it was healthy"
                + (f" ({clause})" if clause else ""))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(observable=self.observable, back=self.back, kept_out_s=_round(self.kept_out_s),
                 after_healthy_s=_round(self.after_healthy_s), served_after_healthy_s=_round(self.served_after_healthy_s),
                 sentence=self.sentence())
        return d


def not_observed(rejoins: Any) -> str | None:
    """Why a verdict needing every faulted worker back cannot pass: the rejoins (``Rejoin`` or
    ``(label, Rejoin)``) not observed, each with its sentence; None when every one was."""
    pairs = [(x if isinstance(x, tuple) else (x.worker, x)) for x in rejoins]
    return "; ".join(f"rejoin not observed after {k}: {r.sentence()}" for k, r in pairs if not r.observable) or None


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
    """Watch one worker from the moment it is healthy after its revert (``start``) until it serves
    and the cluster's traffic runs through it (``wait``, resumable: wait up to a limit, then longer
    to learn when); ``close`` ends its probe."""

    def __init__(self, worker: str, *, worker_api: str, worker_metrics: str | None, profile: str | None,
                 router_metrics: str | None, limit_s: float, headers: Mapping[str, str] | None = None,
                 poll_s: float = POLL_S, nudge: Callable[[], None] | None = None, probe: Probe | None = None,
                 restarted: bool = False) -> None:
        self.worker, self.worker_api, self.limit_s, self.poll_s = worker, worker_api, limit_s, poll_s
        # sends one small request through the cluster's API: traffic to watch for when no load runs
        # (6.1.2's idle phase); None: the caller's load is the traffic
        self._nudge = nudge
        self._probe, self._loop = probe, None
        self._restarted = restarted
        # served seen on its own counters: a new process with no API of its own (its counters count only
        # requests sent after the revert; with a probe, its own request would count too)
        self._by_counter = restarted and probe is None
        self._headers = dict(headers or {})
        self._router_metrics = router_metrics
        self._router_read = not router_metrics   # True once the router's page was read (or there is none)
        self._breaker: _Source | None = None
        self._sources: list[_Source] = []
        quantities = ENGINE_PROFILES.get(profile or "", {})
        usable = SERVED_QUANTITIES if restarted else ADMITTED_QUANTITIES
        families = tuple(quantities[q] for q in usable if q in quantities)
        if worker_metrics and families:
            self._sources.append(_Source("worker", worker_metrics, families))
        self.healthy_mono: float | None = None
        self._polled: float | None = None   # wall time the last poll began
        self.result: Rejoin | None = None

    @classmethod
    def for_worker(cls, cluster: Any, worker: Any, limit_s: float, *, restarted: bool = False,
                   **kwargs: Any) -> RejoinWatch:
        """The watch of an inventory worker (a cluster file ``workers:`` entry) of ``cluster``;
        ``restarted``: its revert started a new process (a kill), else it resumed (a hang)."""
        metrics = getattr(worker, "metrics", None)
        probe = straight_probe(cluster, worker) if own_api(cluster, worker) else None
        return cls(str(worker.name), worker_api=str(worker.api), worker_metrics=str(metrics) if metrics else None,
                   profile=cluster.spec.metric_profile, router_metrics=cluster.metrics_url, limit_s=limit_s,
                   headers=cluster.auth_headers(), probe=probe, restarted=restarted, **kwargs)

    def start(self) -> Rejoin:
        """The worker is healthy now, after its revert: probe it, find the router's view, read every source."""
        self.healthy_mono = time.monotonic()
        self.result = Rejoin(self.worker, self.limit_s, time.time(), watched=[])
        if self._probe is not None:
            self._loop = ProbeLoop(self._probe, self.poll_s, self._keep)
        elif not self._restarted:
            self.result.unobservable = (f"it resumed, and without an API of its own to send a request to, its counters "
                                        "cannot tell its new requests from work queued while it was stopped")
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
        """Poll until the worker is back (served, then traffic through it, the router's breaker for it
        closed where exported) or ``timeout_s`` more seconds have passed; resumable."""
        result = self.result or self.start()
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, headers=self._headers) as http:
            while (result.unobservable is None and (result.observable or not self._router_read) and not result.back
                   and time.monotonic() < deadline):
                if self._nudge is not None:
                    self._nudge()
                time.sleep(self.poll_s)  # the cluster's own pace: nothing to do until the next scrape
                self._poll(http)
        if not result.back:
            result.watched_s = round(self._since_healthy(), 2)
        if result.back or not result.observable:
            self.close()
        log.info("%s", result.sentence())
        return result

    def close(self) -> None:
        if self._loop is not None:
            self._loop.stop()

    # -- internals ---------------------------------------------------------------------------------

    def _keep(self, problem: str) -> None:
        problems = self.result.problems if self.result else []
        problems.append(f"+{self._since_healthy():.1f} s {problem}")
        del problems[:-_KEPT_PROBLEMS]

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
            self._keep(f"{url}: {exc}")
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

    def _served(self, result: Rejoin) -> bool:
        """Has a request sent after the revert been served (see the module doc)? Counting the cluster's
        traffic starts over from the first read after that."""
        if result.served_wall is not None:
            return True
        if self._loop is not None:
            result.probes = self._loop.sent
            if self._loop.served is None:
                return False
            result.served_wall = self._loop.served[1]
            result.served_how = f"a request sent straight to {self.worker_api} after the revert"
            for src in self._sources:
                src.baseline = None   # the cluster's traffic counts from here (the probe's own is in)
            return True
        return False

    def _poll(self, http: httpx.Client) -> None:
        result = self.result
        assert result is not None
        previous, self._polled = self._polled, time.time()
        if not self._router_read:
            self._find_router(http)
        served = self._served(result)
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
            elif value > src.baseline and result.traffic_wall is None and (served or self._by_counter):
                result.traffic_wall, result.seen_by = time.time(), src.describe()
                if not served and src.name == "worker":  # a new process's own counter: requests sent after the revert
                    result.served_wall, result.served_how = result.traffic_wall, result.seen_by
                    served = True
                elif not served:
                    result.traffic_wall = result.seen_by = None   # the router's count: not served yet
        result.watched = [s.describe() for s in self._live() if s.baseline is not None]
        if self._loop is not None:
            result.watched.insert(0, f"requests sent straight to {self.worker_api} after the revert")
            if served and result.traffic_wall is None and not self._live():   # no counter of the cluster's traffic
                result.traffic_wall, result.seen_by = result.served_wall, result.served_how
        if self._breaker is not None and by_url.get(self._breaker.url):
            self._note_breaker(by_url[self._breaker.url])  # type: ignore[arg-type]
        in_rotation = not result.breaker or result.breaker[-1][1] == "closed"
        if served and result.traffic_wall is not None and in_rotation and not result.back:
            result.serving_wall = time.time()
            result.resolution_s = round(result.serving_wall - (previous or result.healthy_wall), 3)

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


__all__ = ["ADMITTED_QUANTITIES", "POLL_S", "ROUTER_VIEWS", "Rejoin", "RejoinWatch", "RouterView", "SERVED_QUANTITIES",
           "not_observed"]
