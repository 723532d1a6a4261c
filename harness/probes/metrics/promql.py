"""The cluster's own Prometheus as a metrics source: PromQL over its HTTP API (``/api/v1/query``,
``/api/v1/query_range``) instead of scraping every worker (``endpoints.prometheus`` in the cluster file).

Three things make a Prometheus answer differ from a scrape, and :class:`PrometheusSource` handles each:

* **Names.** A counter is stored with its ``_total`` sample name; quantities are looked up through
  the same engine profiles as :class:`harness.probes.metrics.prometheus.PrometheusScraper`, matching the family
  name with or without ``_total``, summed per endpoint over its other labels as a scrape is (a quantity
  the profile restricts to some label values, e.g. Dynamo's ``migrations_ongoing``, over those only).
* **Who is who.** Prometheus names each target by its ``instance`` label, ``host:port`` of the address it
  scrapes. A series belongs to the cluster file's endpoint (``endpoints.metrics``, ``workers[].metrics``)
  whose URL has that ``host:port``; a Prometheus that scrapes other clusters too is asked only for these
  instances. A relabelled ``instance`` (a pod name, say) does not match, and the endpoint is reported as
  not scraped, never guessed.
* **Lag.** Prometheus has only what it scraped, up to one scrape interval ago. A read that must reflect
  the state at its own moment (a counter after a kill, a window that ends now) first waits until every
  endpoint's last scrape (``timestamp(up)``) is at or after that moment, at most ``max_lag_s``, and says so
  when Prometheus falls behind. A window is read as the raw samples Prometheus stored (a range selector),
  each with the time of its scrape, not resampled on a grid.

Errors are :class:`harness.errors.ProbeError` naming the Prometheus URL, the query and Prometheus' own
error text. Prometheus' API is reached without the cluster's API key (that key is for the engine).
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import urlparse

import httpx

from harness.errors import ProbeError
from harness.probes.metrics.metrics_base import MetricsSource, Reading, Series
from harness.urls import http_url
from harness.waiting import wait_until

_METRIC_NAME = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]*$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
FIX_URL = "set endpoints.prometheus to the Prometheus server's base URL, e.g. http://10.0.0.9:9090"


@dataclass(frozen=True)
class PromSeries:
    """One series of a PromQL answer: its labels and its (unix seconds, value) points, oldest first."""

    labels: dict[str, str]
    points: list[tuple[float, float]]


class PromQL:
    """A small client of Prometheus' HTTP query API (instant and range queries)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        self.url = http_url(url, "Prometheus URL", "http://127.0.0.1:9090")
        self._http = httpx.Client(timeout=timeout_s)

    def _get(self, path: str, query: str, params: dict[str, Any]) -> Any:
        where = f"Prometheus {self.url}"
        try:
            resp = self._http.get(f"{self.url}{path}", params={"query": query, **params})
        except httpx.HTTPError as exc:
            raise ProbeError(f"{where}: query {query!r} not answered ({type(exc).__name__}: {exc})",
                             fix=f"check that the server is up and reachable; {FIX_URL}") from exc
        try:
            body = resp.json()
        except ValueError:
            raise ProbeError(f"{where}{path} answered HTTP {resp.status_code} without JSON to query {query!r}: "
                             f"{resp.text[:200]!r}", fix=f"is it a Prometheus? {FIX_URL}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            err = body.get("error") if isinstance(body, dict) else None
            kind = body.get("errorType") if isinstance(body, dict) else None
            raise ProbeError(f"{where}: query {query!r} failed (HTTP {resp.status_code}): "
                             f"{kind or 'error'}: {err or str(body)[:200]}",
                             fix="check the query's metric names against the engine profile and the server's "
                                 "version; " + FIX_URL)
        return body["data"]

    def instant(self, query: str, at_s: float | None = None) -> list[PromSeries]:
        """``/api/v1/query`` at ``at_s`` (default: the server's now). A range selector (``x[30s]``) gives
        each series' raw samples; a plain expression one point per series."""
        data = self._get("/api/v1/query", query, {} if at_s is None else {"time": f"{at_s:.3f}"})
        return _series(data, query, self.url)

    def range(self, query: str, start_s: float, end_s: float, step_s: float) -> list[PromSeries]:
        """``/api/v1/query_range``: the expression evaluated every ``step_s`` from ``start_s`` to ``end_s``."""
        if step_s <= 0 or end_s < start_s:
            raise ProbeError(f"range query {query!r} from {start_s} to {end_s} every {step_s} s is empty",
                             fix="pass start <= end and a step > 0")
        data = self._get("/api/v1/query_range", query,
                         {"start": f"{start_s:.3f}", "end": f"{end_s:.3f}", "step": f"{step_s:g}"})
        return _series(data, query, self.url)

    def close(self) -> None:
        self._http.close()


def _series(data: Any, query: str, url: str) -> list[PromSeries]:
    try:
        kind, result = data["resultType"], data["result"]
        if kind == "scalar":
            return [PromSeries({}, [(float(result[0]), float(result[1]))])]
        if kind == "vector":
            return [PromSeries(dict(r["metric"]), [(float(r["value"][0]), float(r["value"][1]))]) for r in result]
        if kind == "matrix":
            return [PromSeries(dict(r["metric"]), [(float(t), float(v)) for t, v in r["values"]]) for r in result]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProbeError(f"Prometheus {url}: the answer to {query!r} is not a query result ({exc!r})",
                         fix=FIX_URL) from exc
    raise ProbeError(f"Prometheus {url}: query {query!r} gave a {kind!r} result, not series", fix=FIX_URL)


def instance_of(url: str) -> str:
    """``host:port`` of a metrics URL, as Prometheus' ``instance`` label names the target it scrapes."""
    parsed = urlparse(url)
    if not parsed.hostname:
        raise ProbeError(f"metrics URL {url!r} has no host", fix="write e.g. http://10.0.0.5:8101/metrics")
    host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
    return f"{host}:{parsed.port or _DEFAULT_PORTS.get(parsed.scheme, 80)}"


def _regex(values: Sequence[str]) -> str:
    """An RE2 alternation matching exactly ``values``, as a PromQL raw (backtick) string."""
    return "`" + "|".join(re.escape(v) for v in values) + "`"


class PrometheusSource(MetricsSource):
    """Reads the engine's quantities for the cluster file's metrics URLs from a Prometheus (module doc)."""

    def __init__(self, url: str, profile: str, *, timeout_s: float = 10.0, max_lag_s: float = 30.0,
                 poll_s: float = 0.25) -> None:
        super().__init__(profile)
        if max_lag_s <= 0:
            raise ProbeError(f"max_lag_s must be > 0, got {max_lag_s!r}", fix="pass e.g. 3 scrape intervals")
        self.client = PromQL(url, timeout_s=timeout_s)
        self.url = self.client.url
        self.label = f"prometheus {self.url}"
        self.max_lag_s, self.poll_s = max_lag_s, poll_s

    # -- who is who --------------------------------------------------------------------------------

    def _instances(self, urls: Sequence[str]) -> dict[str, str]:
        """instance label -> metrics URL; an error when two URLs share a host:port (Prometheus cannot tell
        their series apart by instance)."""
        out: dict[str, str] = {}
        for url in dict.fromkeys(urls):
            inst = instance_of(url)
            if inst in out:
                raise ProbeError(f"metrics URLs {out[inst]} and {url} are one Prometheus target ({inst}): their "
                                 "series cannot be told apart by the instance label",
                                 fix="list each metrics endpoint once, or read this cluster by scraping "
                                     "(remove endpoints.prometheus)")
            out[inst] = url
        return out

    def _selector(self, families: Sequence[str], instances: Sequence[str],
                  labels: dict[str, str] | None = None) -> str:
        for f in families:
            if not _METRIC_NAME.match(f):
                raise ProbeError(f"{f!r} is not a Prometheus metric name", fix="fix the engine profile")
        names = sorted({n for f in families for n in (f, f + "_total")})
        extra = "".join(f", {k}=~{_regex([v])}" for k, v in sorted((labels or {}).items()))
        return f"{{__name__=~{_regex(names)}, instance=~{_regex(instances)}{extra}}}"

    # -- lag ---------------------------------------------------------------------------------------

    def last_scrapes(self, urls: Sequence[str]) -> dict[str, float]:
        """Metrics URL -> unix time of Prometheus' last scrape of it (a URL it does not scrape is absent)."""
        by_inst = self._instances(urls)
        answer = self.client.instant(f"timestamp(up{{instance=~{_regex(list(by_inst))}}})")
        return {by_inst[s.labels["instance"]]: s.points[0][1] for s in answer if s.labels.get("instance") in by_inst}

    def wait_scraped(self, urls: Sequence[str], t_wall_ns: int) -> dict[str, float]:
        """Wait until every URL Prometheus scrapes was scraped at or after ``t_wall_ns`` (at most
        ``max_lag_s``); a ProbeError naming the lagging ones otherwise. Returns the last scrapes."""
        t_s = t_wall_ns / 1e9
        last = wait_until(lambda: self.last_scrapes(urls), self.max_lag_s, self.poll_s,
                          what=f"Prometheus {self.url} scraping {', '.join(urls)} after {t_s:.3f}",
                          accept=lambda seen: bool(seen) and all(ts >= t_s for ts in seen.values()),
                          on_timeout="return")
        behind = {u: ts for u, ts in last.items() if ts < t_s}
        if not last:
            raise ProbeError(f"Prometheus {self.url} scrapes none of {', '.join(urls)} (no `up` series with their "
                             f"host:port as instance after {self.max_lag_s:g} s)",
                             fix="add them to a scrape job of that Prometheus, or read this cluster by scraping "
                                 "(remove endpoints.prometheus)")
        if behind:
            raise ProbeError(f"Prometheus {self.url} has not scraped "
                             + ", ".join(f"{u} (last {t_s - ts:.1f} s before the moment read)" for u, ts in behind.items())
                             + f" within {self.max_lag_s:g} s",
                             fix="check those targets' scrape interval and health on the Prometheus server "
                                 "(/targets), or read this cluster by scraping (remove endpoints.prometheus)")
        return last

    # -- reads -------------------------------------------------------------------------------------

    def _quantity_of(self, quantities: Sequence[str]) -> dict[str, str]:
        """sample name -> quantity (a family and its ``_total``)."""
        out: dict[str, str] = {}
        for q in quantities:
            family = self.family(q)
            out[family], out[family + "_total"] = q, q
        return out

    def read(self, urls: Sequence[str], quantities: Sequence[str], *, settled: bool = False) -> Reading:
        t_ns = time.time_ns()
        by_inst = self._instances(urls)
        if settled:
            self.wait_scraped(urls, t_ns)
        reading = Reading(t_ns, errors=self._health(by_inst))
        groups: dict[tuple[tuple[str, str], ...], list[str]] = {}   # one query per label restriction
        for q in quantities:
            groups.setdefault(tuple(sorted(self.labels(q).items())), []).append(q)
        for labels, qs in groups.items():
            of = self._quantity_of(qs)
            selector = self._selector([self.family(q) for q in qs], list(by_inst), dict(labels))
            for s in self.client.instant(f"sum by (instance, __name__) ({selector})"):
                url, quantity = by_inst.get(s.labels.get("instance", "")), of.get(s.labels.get("__name__", ""))
                if url is None or quantity is None or url in reading.errors or math.isnan(s.points[0][1]):
                    continue
                values = reading.values.setdefault(url, {})
                values[quantity] = values.get(quantity, 0.0) + s.points[0][1]
        for url in by_inst.values():
            if url not in reading.errors:
                reading.values.setdefault(url, {})
        return reading

    def _health(self, by_inst: dict[str, str]) -> dict[str, str]:
        """Why an endpoint has no current values: Prometheus does not scrape it, or its last scrape failed."""
        up = {s.labels.get("instance"): s.points[0][1]
              for s in self.client.instant(f"up{{instance=~{_regex(list(by_inst))}}}")}
        errors = {}
        for inst, url in by_inst.items():
            if inst not in up:
                errors[url] = (f"Prometheus {self.url} does not scrape {url} (no `up` series with instance=\"{inst}\")"
                               " (fix: add it to a scrape job; its instance label must be its host:port)")
            elif up[inst] != 1:
                errors[url] = f"Prometheus {self.url}: its last scrape of {url} failed (up == {up[inst]:g})"
        return errors

    def series(self, urls: Sequence[str], quantity: str, start_wall_ns: int, end_wall_ns: int) -> Series:
        if end_wall_ns < start_wall_ns:
            raise ProbeError("a window ends before it starts", fix="pass start <= end")
        by_inst = self._instances(urls)
        self.wait_scraped(urls, end_wall_ns)
        start_s, end_s = start_wall_ns / 1e9, end_wall_ns / 1e9
        span = max(1, math.ceil(end_s - start_s) + 1)
        summed: dict[str, dict[float, float]] = defaultdict(dict)
        for s in self.client.instant(f"{self._selector([self.family(quantity)], list(by_inst), self.labels(quantity))}"
                                     f"[{span}s]", at_s=end_s):
            url = by_inst.get(s.labels.get("instance", ""))
            if url is None:
                continue
            for t, v in s.points:
                if start_s <= t <= end_s:
                    summed[url][t] = summed[url].get(t, 0.0) + v   # one scrape: one timestamp for all its series
        return {url: [(round(t * 1e9), v) for t, v in sorted(summed.get(url, {}).items())] for url in by_inst.values()}

    def close(self) -> None:
        self.client.close()


__all__ = ["PromQL", "PromSeries", "PrometheusSource", "instance_of"]
