"""6.2 TTFT/TPOT verdicts from client records (built here in the load generator's shape) and the
server's histogram deltas (real exposition text written by prometheus_client)."""

import math
import threading
from types import SimpleNamespace
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest, make_wsgi_app

from harness.checks.slo import (DISAGREEMENT_MIN_MS, HistogramDelta, ServerHistograms, client_latency,
                                disagreement, histogram_delta, server_quantile, server_summary, slo_verdicts)
from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.probes.metrics.prometheus import parse_metrics
from harness.probes.client.records import RequestRecord

MS = 1_000_000
FAMILY = "pdengine_time_to_first_token_seconds"


def rec(i, ttft_ms, tpot_ms, n=16, status="ok"):
    """A request sent at i seconds: first token after ttft_ms, then one token every tpot_ms."""
    sent = i * 1000 * MS
    first = sent + int(ttft_ms * MS)
    chunks = [first + int(k * tpot_ms * MS) for k in range(n)]
    if status != "ok":
        return RequestRecord(request_id=f"r{i}", sent_ns=sent, end_ns=sent + MS, status=status, http_status=503,
                             error_class="overloaded", error_message="busy")
    return RequestRecord(request_id=f"r{i}", sent_ns=sent, first_token_ns=first, chunk_ns=chunks,
                         chunk_tokens=[1] * n, end_ns=chunks[-1], completion_tokens=n, finish_reason="length")


def exposition(observations, buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)) -> str:
    reg = CollectorRegistry()
    h = Histogram(FAMILY, "ttft", ["model_name"], buckets=buckets, registry=reg)
    for v in observations:
        h.labels("tiny").observe(v)
    return generate_latest(reg).decode()


def test_client_percentiles_use_successful_requests_only():
    records = [rec(i, ttft_ms=10 + i, tpot_ms=2) for i in range(100)] + [rec(200 + i, 0, 0, status="http_error")
                                                                         for i in range(50)]
    c = client_latency(records)
    assert (c.requests, c.ok, c.tpot_requests) == (150, 100, 100)
    assert c.ttft_p50_ms == pytest.approx(59) and c.ttft_p99_ms == pytest.approx(108)   # nearest rank
    assert c.tpot_p50_ms == pytest.approx(2, abs=0.01)


def test_verdicts_pass_and_fail_on_the_whole_interval_of_the_client_values():
    cl = Checklist.load()
    # 600 >= 546: a p99's upper bound exists at its per-look pass level (2.5 % / 6 shares, issue 33)
    fast = [rec(i, ttft_ms=40 + i % 20, tpot_ms=5) for i in range(600)]
    ttft, tpot = slo_verdicts(fast, cl)
    assert ttft.status is Status.PASS and tpot.status is Status.PASS
    assert ttft.item == "6.2.ttft" and ttft.measured == pytest.approx(49)
    assert ttft.interval["method"] == "order statistics" and ttft.interval["n"] == 600
    assert ttft.cause["figure"].endswith("99.9875/99.5833 %]")   # fail-side (lower) / pass-side (upper) levels
    # a slow tail: 3 % of the requests at 700 ms puts the whole p99 interval beyond 500 ms
    slow_tail = fast[:-18] + [rec(700 + i, ttft_ms=700, tpot_ms=5) for i in range(18)]
    ttft, _ = slo_verdicts(slow_tail, cl)
    assert ttft.status is Status.FAIL and ttft.cause["key"] == "ttft_p99_ms" and ttft.measured == pytest.approx(700)
    slow_tokens = [rec(i, ttft_ms=50, tpot_ms=40) for i in range(40)]
    _, tpot = slo_verdicts(slow_tokens, cl)   # p50 of 40 has both bounds, all of them at 40 ms: fails
    assert tpot.status is Status.FAIL and tpot.measured == pytest.approx(40, abs=0.1)


def test_a_tail_near_the_target_straddles_and_says_what_would_decide():
    cl = Checklist.load()
    # 600 requests, the slowest 2 % around the 500 ms target, spread through the run (one in 50,
    # no serial dependence): the p99 interval straddles it
    records = [rec(i, ttft_ms=460 + 10 * (i // 50) if i % 50 == 49 else 50, tpot_ms=5) for i in range(600)]
    ttft, tpot = slo_verdicts(records, cl)
    assert ttft.status is Status.INCONCLUSIVE and tpot.status is Status.PASS
    assert (ttft.cause["code"], ttft.cause["what"], ttft.cause["threshold"]) == ("straddles", "client TTFT p99", "< 500 ms")
    assert ttft.cause["interval"].endswith("(lower 99.9875 %, upper 99.5833 %, order statistics, n=600)")
    assert ttft.evidence["undecided"][0]["key"] == "ttft_p99_ms"


def test_a_slow_tail_in_one_burst_counts_as_fewer_requests_than_the_same_tail_spread_out():
    """Serial dependence (issue 33 item 3): the same 600 TTFTs, the 12 slow ones first spread one in
    50, then all in one burst (one stall, not 12 independent slow requests). The burst's p99
    interval is built from fewer effective requests (evidence ``dependence``: lag-1 correlation of
    the indicator high, tau > 2), too few for an upper bound; spread out, tau stays near 1 and n_eff near n.
    Planted defect: slo_verdicts_of without ``in_order`` (independence assumed): both intervals
    equal, no dependence recorded."""
    cl = Checklist.load()
    spread = [rec(i, ttft_ms=300 + 10 * (i // 50) if i % 50 == 49 else 50, tpot_ms=5) for i in range(600)]
    burst = [rec(i, ttft_ms=50, tpot_ms=5) for i in range(294)] + \
        [rec(294 + i, ttft_ms=300 + 10 * i, tpot_ms=5) for i in range(12)] + [rec(306 + i, 50, 5) for i in range(294)]
    intervals = {}
    for name, records in (("spread", spread), ("burst", burst)):
        ttft, _ = slo_verdicts(records, cl)
        p99 = next(m for m in ttft.evidence["measurements"] if m["key"] == "ttft_p99_ms")
        intervals[name] = p99["interval"]
    assert intervals["spread"]["dependence"]["measured"] and intervals["spread"]["dependence"]["tau"] < 1.5
    assert intervals["burst"]["dependence"]["tau"] > 2 and intervals["burst"]["dependence"]["lag1"] > 0.5
    assert intervals["burst"]["dependence"]["n_eff"] < 300
    # 600 independent requests bound a p99 from above (546 needed); the burst's effective ones do not
    assert intervals["spread"]["hi"] is not None and intervals["burst"]["hi"] is None
    assert intervals["burst"]["needs_n"] > 600


def test_too_few_requests_for_a_p99_or_no_server_metrics_is_said_not_hidden():
    cl = Checklist.load()
    ttft, tpot = slo_verdicts([rec(i, 50, 5) for i in range(60)], cl)   # a p99 of 60 requests is not a p99
    assert ttft.status is Status.INCONCLUSIVE and ttft.cause["code"] == "straddles"
    assert "no upper bound" in ttft.cause["interval"] and "n >= 546" in ttft.cause["interval"]
    assert ttft.cause["more_to_decide"] is not None and ttft.cause["noun"] == "requests"
    ttft, _ = slo_verdicts([rec(i, 50, 5) for i in range(600)], cl, server_note="engine 'openai' exposes no metrics")
    assert ttft.status is Status.PASS          # the client verdict stands without the server
    assert ttft.evidence["server"] is None and "openai" in ttft.evidence["server_note"]
    nothing, _ = slo_verdicts([rec(i, 0, 0, status="http_error") for i in range(5)], cl)
    assert nothing.status is Status.INCONCLUSIVE and nothing.cause["code"] == "not_measured"


def test_histogram_delta_holds_only_the_observations_between_the_scrapes():
    before = parse_metrics(exposition([0.015] * 10))
    after = parse_metrics(exposition([0.015] * 10 + [0.15] * 30 + [0.7] * 10))
    d = histogram_delta(before, after, FAMILY)
    assert d.count == 40 and d.sum == pytest.approx(0.15 * 30 + 0.7 * 10)
    assert dict(d.buckets)[0.02] == 0 and dict(d.buckets)[0.2] == 30 and d.buckets[-1] == (math.inf, 40)
    assert histogram_delta(before, after, "vllm:time_to_first_token_seconds") is None
    restarted = histogram_delta(after, before, FAMILY)   # counts went down: the server restarted in between
    assert restarted.count == 10


def test_server_quantiles_interpolate_and_flag_wide_buckets():
    d = histogram_delta([], parse_metrics(exposition([0.15] * 30 + [0.7] * 10)), FAMILY)
    p50 = server_quantile(d, 0.5)
    assert p50.bucket == (0.1, 0.2) and not p50.bucket_limited
    assert p50.value_s == pytest.approx(0.1 + 0.1 * 20 / 30)
    p99 = server_quantile(d, 0.99)
    assert p99.bucket == (0.5, 1.0) and not p99.bucket_limited      # exactly 2x: still fine
    coarse = histogram_delta([], parse_metrics(exposition([0.3] * 10, buckets=(0.1, 1.0))), FAMILY)
    assert server_quantile(coarse, 0.5).bucket_limited               # (0.1, 1.0]: 10x wide, a guess
    over = histogram_delta([], parse_metrics(exposition([5.0] * 10, buckets=(0.1, 1.0))), FAMILY)
    q = server_quantile(over, 0.5)
    assert q.bucket_limited and q.value_s == 1.0 and math.isinf(q.bucket[1])
    assert server_quantile(HistogramDelta(((math.inf, 0.0),), 0.0, 0.0), 0.5) is None
    s = server_summary(coarse)
    assert s["mean_ms"] == pytest.approx(300) and s["p50_bucket_limited"] is True and s["observations"] == 10


def test_a_large_client_server_disagreement_is_stated_in_the_evidence():
    cl = Checklist.load()
    records = [rec(i, ttft_ms=150, tpot_ms=5) for i in range(600)]
    server = {"ttft": histogram_delta([], parse_metrics(exposition([0.015] * 30)), FAMILY)}
    ttft, tpot = slo_verdicts(records, cl, server=server, server_families={"ttft": FAMILY})
    assert ttft.status is Status.PASS and ttft.evidence["server_metric"] == FAMILY
    assert "client p50 150.0 ms vs server p50 15.0 ms" in ttft.evidence["client_server_disagreement"]
    assert tpot.evidence["server"] is None   # no TPOT histogram given
    close = {"ttft": histogram_delta([], parse_metrics(exposition([0.14] * 30)), FAMILY)}
    ttft, _ = slo_verdicts(records, cl, server=close)
    assert "client_server_disagreement" not in ttft.evidence and ttft.evidence["server"]["observations"] == 30


def test_streams_arriving_in_one_burst_show_as_a_tpot_disagreement():
    # the numbers of the Nagle bug (docs/load-and-metrics.md): client 0.07 ms, server 1.8 ms per token
    server = {"mean_ms": 2.3, "p50_ms": 1.8, "p50_bucket_limited": False}
    assert "client p50 0.1 ms vs server p50 1.8 ms" in disagreement(0.067, server, DISAGREEMENT_MIN_MS["tpot"])
    assert disagreement(2.0, server, DISAGREEMENT_MIN_MS["tpot"]) is None
    coarse = {"mean_ms": 2.3, "p50_ms": 4.0, "p50_bucket_limited": True}   # a guessed p50: compare the mean
    assert "server mean 2.3 ms" in disagreement(0.067, coarse, DISAGREEMENT_MIN_MS["tpot"])


def test_server_histograms_scrape_a_real_endpoint_before_and_after():
    reg = CollectorRegistry()
    ttft = Histogram(FAMILY, "ttft", ["model_name"], buckets=(0.01, 0.02, 0.05, 0.1), registry=reg)
    tpot = Histogram("pdengine_request_time_per_output_token_seconds", "tpot", ["model_name"],
                     buckets=(0.001, 0.002, 0.005), registry=reg)
    ttft.labels("tiny").observe(0.015)   # before the run: must not count

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    httpd = make_server("127.0.0.1", 0, make_wsgi_app(reg), handler_class=Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}/metrics"
        server = ServerHistograms(SimpleNamespace(metrics_url=url))   # no engine: field -> bundled profile
        for _ in range(10):
            ttft.labels("tiny").observe(0.04)
            tpot.labels("tiny").observe(0.0015)
        deltas = server.deltas()
    finally:
        httpd.shutdown()
        thread.join()
        httpd.server_close()
    assert server.note is None and server.families["tpot"] == "pdengine_request_time_per_output_token_seconds"
    assert deltas["ttft"].count == 10 and server_summary(deltas["ttft"])["p50_bucket_ms"] == [20.0, 50.0]
    assert deltas["tpot"].count == 10


def test_server_histograms_say_why_there_are_none():
    openai = ServerHistograms(SimpleNamespace(engine="openai", metrics_url="http://127.0.0.1:1/metrics"))
    assert openai.deltas() == {} and "'openai' exposes no Prometheus metrics" in openai.note
    no_url = ServerHistograms(SimpleNamespace(engine="vllm", metrics_url=None))
    assert no_url.deltas() == {} and "no metrics URL" in no_url.note
    down = ServerHistograms(SimpleNamespace(engine="sglang", metrics_url="http://127.0.0.1:1/metrics"))
    assert down.deltas() == {} and "before the load failed" in down.note
    assert down.families["tpot"] == "sglang:inter_token_latency_seconds"   # SGLang has no TPOT histogram


def test_server_histograms_are_summed_over_the_router_and_every_worker():
    """Behind a router such as vllm-router the engine's histograms live on the workers' own metrics
    URLs: the router's endpoint has none, each worker has its share, the delta is their sum."""
    class Quiet(WSGIRequestHandler):
        def log_message(self, *args):
            pass

    servers, urls, hists = [], [], []
    for with_histograms in (False, True, True):
        reg = CollectorRegistry()
        if with_histograms:
            hists.append((Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"],
                                    buckets=(0.01, 0.05, 0.1), registry=reg),
                          Histogram("vllm:request_time_per_output_token_seconds", "tpot", ["model_name"],
                                    buckets=(0.001, 0.01), registry=reg)))
        httpd = make_server("127.0.0.1", 0, make_wsgi_app(reg), handler_class=Quiet)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        urls.append(f"http://127.0.0.1:{httpd.server_port}/metrics")
    try:
        cluster = SimpleNamespace(engine="vllm", metrics_url=urls[0],
                                  workers=[SimpleNamespace(metrics=urls[1]), SimpleNamespace(metrics=urls[2])])
        server = ServerHistograms(cluster)
        for (ttft, tpot), n in zip(hists, (4, 6)):
            for _ in range(n):
                ttft.labels("m").observe(0.03)
                tpot.labels("m").observe(0.005)
        deltas = server.deltas()
    finally:
        for httpd in servers:
            httpd.shutdown()
            httpd.server_close()
    assert server.urls == urls and server.note is None
    assert deltas["ttft"].count == 10 and deltas["tpot"].count == 10


def _clustered(slow_tpot_ms):
    """1500 requests a second apart, TPOT 4-6 ms, except 60 in a row (700-759 s) at 50-70 ms: a steal
    burst's slow minute."""
    return [rec(i, ttft_ms=40 + i % 7, tpot_ms=(50 + i % 21) if 700 <= i < 760 else slow_tpot_ms + (i % 3))
            for i in range(1500)]


def test_requests_in_a_steal_burst_are_left_out_said_and_a_slow_cluster_still_fails():
    """Without the burst's span, its 60 slow requests in a row hold every p99 exceedance, the
    serial dependence leaves too few effective requests for an upper bound, and 6.2 TPOT stays
    undecided (as on 2026-12-07's A/A runs); given the span they are left out, counted in the evidence
    and the reason, and the rest decides a pass. A cluster slow everywhere (TPOT 100 ms) still fails
    with the same span. Fails if the span is ignored, if requests outside it are dropped too, or if
    leaving requests out could turn a slow cluster's fail into a pass."""
    from harness.checks.slo import outside_bursts

    cl = Checklist.load()
    records = _clustered(4)
    _, tpot = slo_verdicts(records, cl)
    assert tpot.status is Status.INCONCLUSIVE and tpot.cause["code"] == "straddles", tpot.reason
    span = [(699.5, 759.9)]
    kept, left_out = outside_bursts(records, span)
    assert left_out == 60 and len(kept) == 1440
    assert all(not 700 <= r.sent_ns / 1e9 < 760 for r in kept)
    ttft, tpot = slo_verdicts(records, cl, steal_bursts=span)
    assert tpot.status is Status.PASS and ttft.status is Status.PASS, tpot.reason
    assert tpot.evidence["steal_bursts"]["left_out"] == 60 and tpot.evidence["steal_bursts"]["requests"] == 1500
    assert tpot.evidence["client"]["requests"] == 1440
    assert "60 of 1500 requests left out" in tpot.reason
    _, slow = slo_verdicts(_clustered(100), cl, steal_bursts=span)
    assert slow.status is Status.FAIL, slow.reason
    # no span: nothing left out, nothing said
    _, plain = slo_verdicts(_clustered(4)[:600], cl, steal_bursts=())
    assert "steal_bursts" not in plain.evidence and "left out" not in plain.reason


def test_a_burst_over_every_request_leaves_6_2_undecided_and_asks_for_as_many_again():
    """A steal burst over the whole first load (15 s of load, a 10-15 s burst with its 5 s edges: it
    happens) leaves no sample: the verdict must ask the extension loop for more load, not end as
    "could not be measured" after one look (found live: the 6.2 suite with the leave-out limit at
    0.01 % stopped after 15 s of load). Planted defect it fails on: the not-measured percentile not
    listed as undecided (the extension loop sees nothing to extend and stops)."""
    from harness.checks.verdict import undecided

    records = [rec(i, 40, 5) for i in range(1, 601)]   # sent_ns 0 reads as never sent: start at 1 s
    ttft, tpot = slo_verdicts(records, Checklist.load(), steal_bursts=[(0.5, 700.0)])
    for v in (ttft, tpot):
        assert v.status is Status.INCONCLUSIVE and "600 of 600 requests left out" in v.reason
        wanted = undecided(v)
        assert {u["key"] for u in wanted} == {f"{v.item[-4:]}_p50_ms", f"{v.item[-4:]}_p99_ms"}
        assert all(u["more_to_decide"] == 600 for u in wanted)


def test_what_would_decide_counts_the_requests_to_send_at_the_share_a_burst_leaves():
    """With half of 1500 requests left out in a burst, "about N more would decide" counts requests
    kept, so the extension must send about 2N. Planted defect it fails on: the kept count passed on
    as the load to send (the next extension too short to decide, as seen live: 5 s extensions while
    the machine kept stealing)."""
    cl = Checklist.load()
    # TTFT 40-52 ms, one request in 150 at 600 ms: 750 requests leave the p99 < 500 ms undecided
    records = [rec(i, 600 if i % 150 == 0 else 40 + i % 13, 5) for i in range(1, 1501)]
    ttft, _ = slo_verdicts(records[750:], cl)   # the kept half alone
    alone = {u["key"]: u["more_to_decide"] for u in ttft.evidence.get("undecided") or ()}
    ttft_cut, _ = slo_verdicts(records, cl, steal_bursts=[(0.5, 750.5)])
    assert ttft_cut.evidence["steal_bursts"]["left_out"] == 750
    cut = {u["key"]: u["more_to_decide"] for u in ttft_cut.evidence.get("undecided") or ()}
    assert any(alone.values()) and set(cut) == set(alone)
    for key, more in alone.items():
        if more:
            assert cut[key] == 2 * more, (key, cut[key], more)
