"""Checklist items 6.2.ttft and 6.2.tpot (Section 6.2 dashboard, "TTFT P50/P99 (目标: <200ms/<500ms)",
"TPOT P50/P99 (目标: <30ms/<80ms)").

Judged from the CLIENT's records, the latency users see (docs/load-and-metrics.md): TTFT is the
first chunk that carries a non-empty token minus the (scheduled) send, TPOT is (E2E - TTFT) / (n - 1)
over requests with n >= 2 output tokens; only successful requests enter the percentiles, which
are nearest-rank (harness/stats/__init__.py), each with its distribution-free 95 % interval from
order statistics (harness/stats/intervals.py): a p99 needs 368 requests before it has an upper
bound, so fewer leave it inconclusive, naming that count.

Beside them, the server's own view: the engine's TTFT and TPOT histograms (named by its metric
profile), scraped before and after the load; the DELTA of the cumulative buckets holds exactly the
requests of the run. Quantiles are interpolated inside the bucket that holds them, as Prometheus'
``histogram_quantile`` does, and flagged **bucket-limited** when that bucket is wide (upper edge
more than twice the lower one, or open-ended): the value is then a guess inside the bucket, and
the mean from ``_sum / _count`` is the better server number. The server values are evidence only;
a large client/server disagreement is stated in the evidence (time spent outside the engine:
network, proxies, the client itself).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import httpx

from harness.stats.intervals import percentile_interval
from harness.stats import DEFINITION, nearest_rank
from harness.checklists import Checklist
from harness.checks.machine import LIMITS
from harness.checks.verdict import Measurement, Status, Verdict, judge
from harness.probes.client.analysis import requests_frame
from harness.errors import ProbeError
from harness.probes.metrics.prometheus import (ENGINE_PROFILES, PrometheusScraper, Sample, engine_of, histogram_quantile,
                                       profile_for)
from harness.probes.client.records import NOT_SENT, RequestRecord

log = logging.getLogger(__name__)

TTFT_ITEM = "6.2.ttft"
TPOT_ITEM = "6.2.tpot"
BUCKET_LIMIT_RATIO = 2.0     # a bucket wider than this ratio of upper to lower edge makes a quantile a guess
DISAGREEMENT_RATIO = 2.0     # client and server p50 (or mean) further apart than this factor ...
DISAGREEMENT_MIN_MS = {"ttft": 20.0, "tpot": 1.0}   # ... and by more than this many ms: a large disagreement

DEFINITIONS = {
    "ttft": "first output chunk carrying a token (its token ids, else a rise of per-chunk usage, else text: an empty-text chunk with a token counts) minus the scheduled send (= actual send in closed loop)",
    "tpot": "(E2E - TTFT) / (n - 1), n = output tokens (server usage, else counted), requests with n >= 2",
    "percentile": DEFINITION,
    "population": "successful requests only; failed ones are counted apart (nothing-lost verdict)",
    "interval": "distribution-free two-sided 95 % interval of each percentile from order statistics (exact "
                "binomial ranks), requests taken as independent draws; see docs/statistics.md",
}


@dataclass(frozen=True)
class HistogramDelta:
    """Observations a server histogram gained between two scrapes, summed over its label sets."""

    buckets: tuple[tuple[float, float], ...]   # (le, cumulative count), sorted, +Inf last
    sum: float
    count: float


@dataclass(frozen=True)
class ServerQuantile:
    q: float
    value_s: float
    bucket: tuple[float, float]   # (lower, upper) edge of the bucket holding the q-th observation
    bucket_limited: bool


def _per_family(samples: Iterable[Sample], family: str) -> tuple[dict[float, float], float, float, bool]:
    buckets: dict[float, float] = {}
    total = count = 0.0
    seen = False
    for s in samples:
        if s.name == family + "_bucket":
            le = float(dict(s.labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
            seen = True
        elif s.name == family + "_sum":
            total += s.value
        elif s.name == family + "_count":
            count += s.value
    return buckets, total, count, seen


def histogram_delta(before: Iterable[Sample], after: Iterable[Sample], family: str) -> HistogramDelta | None:
    """``after - before`` of histogram ``family``; None when the family is not in ``after``. A
    count that went down means the server restarted in between: its ``after`` counts are the delta."""
    b_buckets, b_sum, b_count, _ = _per_family(before, family)
    a_buckets, a_sum, a_count, seen = _per_family(after, family)
    if not seen:
        return None
    if a_count < b_count or any(a_buckets.get(le, 0.0) < c for le, c in b_buckets.items()):
        b_buckets, b_sum, b_count = {}, 0.0, 0.0
    buckets = tuple((le, a_buckets[le] - b_buckets.get(le, 0.0)) for le in sorted(a_buckets))
    return HistogramDelta(buckets, a_sum - b_sum, a_count - b_count)


def server_quantile(delta: HistogramDelta, q: float) -> ServerQuantile | None:
    """q-quantile of the delta (linear inside its bucket); None with no observations."""
    total = delta.buckets[-1][1] if delta.buckets else 0.0
    if total <= 0:
        return None
    value = histogram_quantile(q, list(delta.buckets))
    rank = q * total
    lower = 0.0
    for le, count in delta.buckets:
        if count >= rank:
            limited = math.isinf(le) or lower <= 0 or le > BUCKET_LIMIT_RATIO * lower
            return ServerQuantile(q, value, (lower, le), limited)
        lower = le
    return ServerQuantile(q, value, (lower, math.inf), True)


def server_summary(delta: HistogramDelta | None) -> dict[str, Any] | None:
    """JSON-able server view of one histogram in ms: p50, p99 (with their buckets and the
    bucket-limited flag), mean from _sum/_count, observations; None when nothing was observed."""
    if delta is None or delta.count <= 0:
        return None
    out: dict[str, Any] = {"observations": int(delta.count), "mean_ms": round(delta.sum / delta.count * 1e3, 3)}
    for q in (0.5, 0.99):
        sq = server_quantile(delta, q)
        if sq is None:
            continue
        key = f"p{q * 100:g}"
        out[f"{key}_ms"] = round(sq.value_s * 1e3, 3)
        out[f"{key}_bucket_ms"] = [round(sq.bucket[0] * 1e3, 3), None if math.isinf(sq.bucket[1])
                                   else round(sq.bucket[1] * 1e3, 3)]
        out[f"{key}_bucket_limited"] = sq.bucket_limited
    return out


@dataclass(frozen=True)
class ClientLatency:
    """Client-side TTFT and TPOT percentiles (ms) over the successful requests of a run."""

    requests: int           # sent requests, every status
    ok: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tpot_requests: int       # ok requests with >= 2 output tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def client_samples(records: Sequence[RequestRecord]) -> tuple[int, list[float], list[float]]:
    """(requests sent, TTFT ms of each ok request, TPOT ms of each ok request with >= 2 tokens)."""
    sent = [r for r in records if r.error_class != NOT_SENT]
    df = requests_frame(sent)
    ok = df.loc[df["ok"].astype(bool)] if len(df) else df
    ttft = [v for v in ok["ttft_sched_ms"].tolist() if not math.isnan(v)] if len(ok) else []
    tpot = [v for v in ok["tpot_ms"].tolist() if not math.isnan(v)] if len(ok) else []
    return len(df), ttft, tpot


def client_latency(records: Sequence[RequestRecord]) -> ClientLatency:
    return _summary(*client_samples(records))


def _summary(requests: int, ttft: list[float], tpot: list[float]) -> ClientLatency:
    def pct(values: list[float], q: float) -> float | None:
        return round(nearest_rank(values, q), 3) if values else None

    return ClientLatency(requests, len(ttft), pct(ttft, 50), pct(ttft, 99), pct(tpot, 50), pct(tpot, 99), len(tpot))


def disagreement(client_p50_ms: float | None, server: dict[str, Any] | None, min_ms: float) -> str | None:
    """A sentence when client and server p50 (the server's mean when its p50 is bucket-limited)
    differ by more than DISAGREEMENT_RATIO and ``min_ms``; else None. (A client TPOT far below the
    server's is the tell of streams that reach the client in one burst: see docs/load-and-metrics.md.)"""
    if client_p50_ms is None or server is None:
        return None
    use_mean = server.get("p50_bucket_limited", True) or "p50_ms" not in server
    what, value = ("mean", server["mean_ms"]) if use_mean else ("p50", server["p50_ms"])
    hi, lo = max(client_p50_ms, value), min(client_p50_ms, value)
    if hi - lo <= min_ms or (lo > 0 and hi / lo <= DISAGREEMENT_RATIO):
        return None
    return (f"client p50 {client_p50_ms:.1f} ms vs server {what} {value:.1f} ms: more than "
            f"{DISAGREEMENT_RATIO:g}x and {min_ms:g} ms apart, so time is spent outside the engine's "
            "own measurement (network, proxy, client) or the histogram does not cover these requests")


def slo_verdicts(records: Sequence[RequestRecord], checklist: Checklist, *,
                 server: dict[str, HistogramDelta | None] | None = None,
                 server_families: dict[str, str] | None = None,
                 server_note: str | None = None,
                 steal_bursts: Sequence[tuple[float, float]] = ()) -> tuple[Verdict, Verdict]:
    """The 6.2.ttft and 6.2.tpot verdicts from the client records; ``server`` maps "ttft" and
    "tpot" to the engine's histogram deltas (evidence only), ``server_families`` to the metric
    each came from, ``server_note`` says why there are none. ``steal_bursts``: wall-clock spans in
    which the hypervisor took the test machine's CPUs (MachineMonitor.steal_spans): the requests in
    flight then are left out of the percentiles, said in each verdict (:func:`outside_bursts`)."""
    kept, left_out = outside_bursts(records, steal_bursts)
    verdicts = slo_verdicts_of(*client_samples(kept), checklist, server=server, server_families=server_families,
                               server_note=server_note)
    if steal_bursts:
        seconds = sum(end - start for start, end in steal_bursts)
        bursts = {"spans": [[round(a, 3), round(b, 3)] for a, b in steal_bursts], "seconds": round(seconds, 1),
                  "left_out": left_out, "requests": len(records), "limit_pct": LIMITS.steal_leave_out_pct,
                  "rule": BURST_RULE}
        for v in verdicts:
            v.evidence["steal_bursts"] = bursts
            if left_out and v.status is Status.INCONCLUSIVE:
                # what more load would decide counts requests kept: sending at this run's share left
                # out takes more; a percentile the cut left without a sample asks for as many again
                # (the extension loop, harness/checks/extend.py, sizes the next load by these)
                share_kept = max(len(records) - left_out, 1) / len(records)
                for u in v.evidence.get("undecided") or ():
                    if u.get("more_to_decide"):
                        u["more_to_decide"] = math.ceil(u["more_to_decide"] / share_kept)
                v.evidence.setdefault("undecided", []).extend(
                    {"key": m["key"], "more_to_decide": len(records), "noun": "requests", "n": 0}
                    for m in v.evidence["measurements"] if m.get("value") is None)
            if left_out:
                v.add("note", text=f"{left_out} of {len(records)} requests left out: in flight during {seconds:.0f} s "
                                   f"of VM steal bursts (over {LIMITS.steal_leave_out_pct:g} % of the test machine's CPUs "
                                   "over 5 s)")
    return verdicts


BURST_RULE = ("a request in flight (send to last byte) while the hypervisor took over steal_leave_out_pct of the test "
              "machine's CPUs over some 5 s is left out of the percentiles: those seconds time the test machine, "
              "not the cluster (docs/load-and-metrics.md, 'Steal in bursts'); nothing-lost still counts it")


def outside_bursts(records: Sequence[RequestRecord],
                   spans: Sequence[tuple[float, float]]) -> tuple[list[RequestRecord], int]:
    """The records of requests whose time in flight (scheduled send to end; to now when unfinished)
    overlaps none of ``spans`` (wall-clock seconds), and how many of the sent ones were left out.
    Records never sent are kept (they are no sample)."""
    if not spans:
        return list(records), 0
    kept, left_out = [], 0
    for r in records:
        if r.error_class == NOT_SENT or not r.sent_ns:
            kept.append(r)
            continue
        begin = r.start_wall_ns() / 1e9
        end = r.anchor.perf_to_wall(r.end_ns) / 1e9 if r.end_ns else math.inf
        if any(begin <= b and a <= end for a, b in spans):
            left_out += 1
        else:
            kept.append(r)
    return kept, left_out


def slo_verdicts_of(requests: int, ttft_ms: Sequence[float], tpot_ms: Sequence[float], checklist: Checklist, *,
                    server: dict[str, HistogramDelta | None] | None = None,
                    server_families: dict[str, str] | None = None,
                    server_note: str | None = None) -> tuple[Verdict, Verdict]:
    """:func:`slo_verdicts` from the client samples already taken (requests sent, TTFT ms of each ok
    request, TPOT ms of each ok request with >= 2 tokens): a soak takes them while it streams."""
    ttft_ms, tpot_ms = list(ttft_ms), list(tpot_ms)
    c = _summary(requests, ttft_ms, tpot_ms)
    verdicts = []
    for item_id, key, values in ((TTFT_ITEM, "ttft", ttft_ms), (TPOT_ITEM, "tpot", tpot_ms)):
        item = checklist.item(item_id)
        t = item.thresholds
        measurements = [Measurement(t[f"{key}_p{q}_ms"], round(nearest_rank(values, q), 3) if values else None,
                                    f"client {key.upper()} p{q}",
                                    percentile_interval(values, q, noun="requests", in_order=True))
                        for q in (50, 99)]
        p50 = measurements[0].value
        srv = server_summary((server or {}).get(key))
        evidence: dict[str, Any] = {"client": c.to_dict(), "definition": DEFINITIONS[key],
                                    "percentile": DEFINITIONS["percentile"], "population": DEFINITIONS["population"],
                                    "interval": DEFINITIONS["interval"],
                                    "server": srv, "server_metric": (server_families or {}).get(key)}
        if srv is None:
            evidence["server_note"] = server_note or "the server's histogram observed no request in the run"
        elif (gap := disagreement(p50, srv, DISAGREEMENT_MIN_MS[key])) is not None:
            evidence["client_server_disagreement"] = gap
        verdicts.append(judge(item, measurements, evidence=evidence))
    return verdicts[0], verdicts[1]


class ServerHistograms:
    """Before/after scrapes of the engine's TTFT and TPOT histograms; a scrape that fails is a
    note in the evidence (the client verdicts stand without it), never an error."""

    def __init__(self, cluster: Any) -> None:
        self.profile_name = profile_for(cluster)
        self.note: str | None = None
        self.families: dict[str, str] = {}
        self._scrapers: dict[str, PrometheusScraper] = {}
        # the cluster's metrics URL and every worker's own (behind a router such as vllm-router the
        # engine's histograms live on the workers); a histogram is summed over all of them
        urls = list(dict.fromkeys(u for u in [cluster.metrics_url, *(
            str(w.metrics) for w in getattr(cluster, "workers", ()) or () if getattr(w, "metrics", None))] if u))
        if self.profile_name is None:
            self.note = f"engine {engine_of(cluster)!r} exposes no Prometheus metrics"
        elif not urls:
            self.note = "the cluster file names no metrics URL (endpoints.metrics, workers[].metrics)"
        else:
            profile = ENGINE_PROFILES[self.profile_name]
            self.families = {"ttft": profile["ttft_seconds"]}
            # TPOT per request when the engine has it, else its inter-token latency (per chunk)
            self.families["tpot"] = profile.get("tpot_seconds") or profile["itl_seconds"]
            key = cluster.api_key() if hasattr(cluster, "api_key") else None
            for url in urls:
                self._scrapers[url] = PrometheusScraper(url, engine=self.profile_name, api_key=key)
        self.urls = urls
        self.before: dict[str, list[Sample]] = self._scrape("before")

    def _scrape(self, when: str) -> dict[str, list[Sample]]:
        out: dict[str, list[Sample]] = {}
        for url, scraper in list(self._scrapers.items()):
            try:
                out[url] = scraper.scrape_once()
            except (httpx.HTTPError, ProbeError) as exc:
                self.note = f"scrape of {url} {when} the load failed: {exc}"
                log.warning("%s", self.note)
                scraper.stop()
                del self._scrapers[url]
        return out

    def deltas(self, *, final: bool = True) -> dict[str, Any]:
        """The histograms' deltas since the first scrape; ``final``: stop scraping after this one."""
        after = self._scrape("after")
        for scraper in self._scrapers.values() if final else ():
            scraper.stop()
        both = [u for u in self.before if u in after]
        if not both:
            return {}
        before_all = [smp for u in both for smp in self.before[u]]
        after_all = [smp for u in both for smp in after[u]]
        out = {key: histogram_delta(before_all, after_all, family) for key, family in self.families.items()}
        missing = [self.families[k] for k, d in out.items() if d is None]
        if missing:
            self.note = f"no metrics endpoint ({', '.join(both)}) exposes {', '.join(missing)}"
        return out
