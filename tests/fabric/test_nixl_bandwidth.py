"""6.1.1 from vLLM's own NIXL transfers (harness/fabric/nixl.py, harness/checks/fabric.py): parsing
decode's NIXL histograms, one transfer per scrape delta, the prefill host's lossless-class counter as
the cross-check, and the judgment beside the raw probe; against metric text and tc counters recorded
on the live vllm-pd-nixl cluster (tests/fabric/data/nixl/, 2026-12-06: 2 CPUs at load ~10, so some
transfers waited seconds for decode to poll their completion). No root, no vLLM."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.checklists import Checklist
from harness.checks.fabric import raw_bandwidth_verdict
from harness.checks.extend import repeat_undecided
from harness.checks.verdict import Status
from harness.errors import ProbeError
from harness.fabric.bandwidth import BandwidthResult
from harness.fabric.linerate import LineRate
from harness.fabric.nixl import (LinkCount, NixlDrive, NixlRun, NixlTransfer, parse_nixl, transfer_between)
from harness.fabric.shaping import parse_classes
from harness.report import fabric_plots

DATA = Path(__file__).parent / "data" / "nixl"
SERIES = DATA / "series"
CHECKLIST = Checklist.load()
LINE = LineRate(1e9, "tc", "fab0", "nx-h0")
RAW = [BandwidthResult(0.99e9 * (1 + 0.001 * k), 371_000_000, 3.0, "iperf3", 7472, "nx-h0", "nx-h1") for k in range(9)]


def _series_totals():
    return [parse_nixl((SERIES / f"{i:02d}.prom").read_text()) for i in range(13)]


def _link(nixl_bytes: float, lossless: int) -> LinkCount:
    return LinkCount("nx-h0", "fab0", "1:10", lossless, 0, nixl_bytes)


def _recorded_run() -> NixlRun:
    totals = _series_totals()
    before, after = (parse_classes((SERIES / f"tc_{w}.txt").read_text()) for w in ("before", "after"))
    run = NixlRun(["http://198.18.32.2:8402/metrics"], requests=12)
    run.transfers = [t for a, b in zip(totals, totals[1:]) if (t := transfer_between(a, b)) is not None]
    run.links = [_link(totals[-1].bytes - totals[0].bytes, after["1:10"].sent_bytes - before["1:10"].sent_bytes)]
    return run


def _run(fractions, nbytes=3_670_016.0, lossless_ratio=1.0103) -> NixlRun:
    run = NixlRun(["http://decode/metrics"], requests=len(fractions))
    run.transfers = [NixlTransfer(nbytes, 8 * nbytes / (f * LINE.bps), 1) for f in fractions]
    run.links = [_link(nbytes * len(fractions), int(lossless_ratio * nbytes * len(fractions)))]
    return run


def test_decode_s_recorded_nixl_histograms_are_read_as_bytes_seconds_and_transfers():
    """Planted defects it catches (each made by hand in parse_nixl and seen failing): the bytes
    histogram's ``_count`` read as its bytes (16 "bytes"), the failure counter looked up without the
    ``_total`` suffix vLLM exports, and an instance whose histograms are present but empty (prefill:
    the pull is counted on decode) taken as no NIXL."""
    after = parse_nixl((DATA / "decode_after.prom").read_text())
    assert after.present and after.transfers == 16 and after.bytes == 41_156_608 and after.seconds == 58.941128
    assert after.post_seconds == pytest.approx(0.001056) and after.failed == 0
    failed = (DATA / "decode_after.prom").read_text().replace(
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 0.0',
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 2.0')
    assert parse_nixl(failed).failed == 2
    prefill = parse_nixl((DATA / "prefill.prom").read_text())
    assert prefill.present and prefill.transfers == 0 and prefill.bytes == 0
    assert not parse_nixl("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n").present
    # one transfer between the two recorded scrapes: a 1902-token prompt's KV, 30 blocks of 128 KiB
    one = transfer_between(parse_nixl((DATA / "decode_before.prom").read_text()), after)
    assert one == NixlTransfer(3_932_160, pytest.approx(4.841626), 1, pytest.approx(0.000069))


def test_each_scrape_delta_is_one_transfer_and_a_restart_is_an_error():
    """12 requests sent one at a time on the live cluster, decode scraped after each: 12 transfers of
    3.5 MiB, each its own bytes and time (planted: the lifetime totals, warm-up included, taken as the
    transfer, as engine_kv_goodput does; or a delta across a restarted instance taken as negative)."""
    run = _recorded_run()
    assert [t.count for t in run.transfers] == [1] * 12
    assert {t.bytes for t in run.transfers} <= {3_604_480, 3_670_016}
    rates = sorted(t.bps / 1e9 for t in run.transfers)
    # what a transfer's rate was here: 4 of 12 over 0.85 of the 1 Gbit/s line (29-34 ms for 3.5 MiB), 2 at
    # 0.54-0.56, the rest waited 0.1-7.4 s for decode's engine to see them done on a CPU-starved machine
    assert sum(r > 0.85 for r in rates) == 4 and rates[0] < 0.01 and rates[-1] == pytest.approx(1.007, abs=0.01)
    a, b = _series_totals()[:2]
    with pytest.raises(ProbeError, match="restarted"):
        transfer_between(b, a)
    assert transfer_between(a, a) is None


def test_the_link_counted_what_nixl_reported_or_the_figure_is_not_judged():
    """The prefill host's lossless class sent 1.0103 x NIXL's bytes over the recorded 12 transfers
    (headers on top). Planted defects: UCX allowed shared memory, so the KV moves between the
    namespaces without touching the link (1.8 KB on fab0 for 6.5 MB of KV, seen here): judged anyway,
    it would be a memory copy's rate; and other traffic in the class while it was counted (1.5 x)."""
    run = _recorded_run()
    assert run.link.ratio == pytest.approx(1.0103, abs=1e-4) and run.link.crossed
    fast = _run([0.95 + 0.002 * k for k in range(25)])
    assert raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=fast).status is Status.PASS
    for ratio in (1800 / 6.5e6, 1.5):
        shm = _run([0.95 + 0.002 * k for k in range(25)], lossless_ratio=ratio)
        v = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=shm)
        assert v.status is Status.INCONCLUSIVE and "did not cross the measured link" in v.reason, v.reason
        assert v.evidence["nixl"]["link"]["crossed"] is False and v.evidence["source"] == "nixl_metrics"


def test_nixl_transfers_are_a_second_figure_judged_on_their_interval():
    """The raw probe passes at 0.99; the engine's own transfers decide on their own interval: a fail
    at 0.5 names NIXL as the source (planted: the NIXL figure dropped, or kept as evidence only, so the
    raw probe's pass hides a slow engine); the recorded starved-machine series straddles 0.8 (its
    median 0.41, 12 transfers from 0.004 to 1.01) and says how many more would decide, no fail."""
    slow = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=_run([0.5 + 0.003 * k for k in range(25)]))
    assert slow.status is Status.FAIL and slow.evidence["source"] == "nixl_metrics", slow.reason
    assert "vLLM's own KV transfers over NIXL" in slow.reason and slow.measured == pytest.approx(0.536)
    assert slow.evidence["sources"] == {"line_rate_fraction": "raw_probe",
                                        "kv_transfer_line_rate_fraction": "nixl_metrics"}
    keys = [m["key"] for m in slow.evidence["measurements"]]
    assert keys == ["line_rate_fraction", "kv_transfer_line_rate_fraction"]
    ok = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=_run([0.95 + 0.002 * k for k in range(25)]))
    assert ok.status is Status.PASS and ok.evidence["source"] == "raw_probe" and "1 more threshold" in ok.reason
    recorded = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=_recorded_run())
    assert recorded.status is Status.INCONCLUSIVE and recorded.evidence["source"] == "nixl_metrics", recorded.reason
    assert "straddles" in recorded.reason and "NIXL transfers" in recorded.reason
    assert [u["key"] for u in recorded.evidence["undecided"]] == ["kv_transfer_line_rate_fraction"]
    # no NIXL run (a cluster without NixlConnector): the raw probe alone, as before
    raw_only = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [])
    assert raw_only.status is Status.PASS and raw_only.evidence["source"] == "raw_probe"
    assert "nixl" not in raw_only.evidence


def test_only_the_figure_still_undecided_is_measured_more():
    """The suite's extension: with the raw probe decided (0.99) and the NIXL transfers straddling (the
    recorded series), only NIXL transfers are added; before the first judgment both. Planted: the
    raw runs alone extended (the NIXL figure left straddling while its budget allows more)."""
    made: dict[str, int] = {"line_rate_fraction": 0, "kv_transfer_line_rate_fraction": 0}
    figures = {key: (lambda k, key=key: made.__setitem__(key, made[key] + k)) for key in made}
    assert repeat_undecided(None, 8, figures) == list(made) and made == dict.fromkeys(made, 8)
    straddling = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=_recorded_run())
    assert repeat_undecided(straddling, 9, figures) == ["kv_transfer_line_rate_fraction"]
    assert made == {"line_rate_fraction": 8, "kv_transfer_line_rate_fraction": 17}


def test_transfers_too_small_to_time_the_link_are_inconclusive_not_a_fail():
    """A 64 KiB transfer takes 0.5 ms at 1 Gbit/s: NIXL's post and decode's completion polling set its
    time, not the link (planted: judged anyway, it fails at 0.3 x line rate). Also no transfer at all
    (the router sent the prompts to decode alone) is inconclusive with that reason."""
    tiny = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=_run([0.3] * 25, nbytes=65_536))
    assert tiny.status is Status.INCONCLUSIVE and "too small to time the link" in tiny.reason, tiny.reason
    assert tiny.evidence["nixl"]["not_judged"]["value"] == pytest.approx(0.3)
    none = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, [], nixl=NixlRun(["http://decode/metrics"], requests=9))
    assert none.status is Status.INCONCLUSIVE and "no NIXL transfer finished in 9 requests" in none.reason


def test_the_6_1_1_chart_on_ssh_hosts_draws_the_nixl_transfers_and_names_its_source():
    """Drawn like the bundled engine's curve (x line rate per transfer size): the raw probe per size and
    each NIXL transfer, the title naming the source of the verdict's headline (planted: on an SSH
    cluster the chart was not drawn at all, its evidence having no ``kv_curve``)."""
    run = _recorded_run()
    raw_curve = [BandwidthResult(g * 1e9, m << 20, 8 * (m << 20) / (g * 1e9), "iperf3", 7472, "nx-h0", "nx-h1")
                 for m, g in ((1, 0.6), (8, 0.9), (32, 0.97), (128, 0.99))]
    v = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, raw_curve, nixl=run)
    svg = str(fabric_plots.kv_bandwidth_chart(v.evidence))
    assert 'data-plot="kv-bandwidth"' in svg
    assert int(re.search(r'data-points="(\d+)"', svg).group(1)) == 4 + 12 + 1   # raw sizes, transfers, median
    assert "verdict from vLLM&#39;s own NIXL transfers" in svg or "verdict from vLLM's own NIXL transfers" in svg
    assert "each NIXL transfer (12)" in svg and "raw iperf3 median 0.99" in svg
    raw_only = raw_bandwidth_verdict(CHECKLIST, LINE, RAW, raw_curve)
    assert "verdict from raw iperf3 probe" in str(fabric_plots.kv_bandwidth_chart(raw_only.evidence))


def test_every_worker_exporting_nixl_histograms_is_read_decode_first_and_summed(monkeypatch):
    """Workers found by scraping (decode first; prefill's zeros kept, an unreachable one skipped) and
    their totals summed, so a transfer to any decode worker counts. Planted: only the first worker
    read (with two decode workers half the transfers are missed and the link, counting all the KV
    that left the prefill host, no longer matches NIXL's bytes: the cross-check fails for nothing)."""
    import httpx
    import harness.fabric.nixl as nixl

    texts = {"http://p/m": DATA / "prefill.prom", "http://d0/m": DATA / "decode_before.prom",
             "http://d1/m": DATA / "decode_after.prom"}

    def fake_scrape(url, headers=None, timeout=10.0):
        if url not in texts:
            raise httpx.ConnectError("refused")
        return texts[url].read_text()
    monkeypatch.setattr(nixl, "scrape", fake_scrape)
    workers = [SimpleNamespace(role=r, metrics=u) for r, u in
               (("prefill", "http://p/m"), ("decode", "http://gone/m"), ("decode", "http://d0/m"),
                ("decode", "http://d1/m"), ("decode", None))]
    cluster = SimpleNamespace(spec=SimpleNamespace(workers=workers), auth_headers=lambda: {})
    urls = nixl.nixl_metrics_urls(cluster)
    assert urls == ["http://d0/m", "http://d1/m", "http://p/m"]
    totals = NixlDrive(cluster, urls, dict, host="h", interface="fab0", lossless_class="1:10")._totals()
    assert totals.present and totals.transfers == 15 + 16 and totals.bytes == 37_224_448 + 41_156_608


# -- the drive, against a stand-in of the router and decode's /metrics ------------------------------------


class _Engine:
    """A router whose every completion makes decode's NIXL histograms count one more transfer of
    ``per_request`` bytes (the recorded text's shape), its /v1/models giving max_model_len 2048."""

    def __init__(self) -> None:
        self.template = (DATA / "decode_before.prom").read_text()
        self.n, self.lock = 0, threading.Lock()
        self.prompt_words: list[int] = []
        self.models: set = set()

    def metrics(self) -> str:
        base = parse_nixl(self.template)
        text = self.template
        for name, value in (("vllm:nixl_xfer_time_seconds_count", base.transfers + self.n),
                            ("vllm:nixl_xfer_time_seconds_sum", base.seconds + 0.03 * self.n),
                            ("vllm:nixl_bytes_transferred_sum", base.bytes + 3_670_016 * self.n)):
            text = re.sub(rf'^{re.escape(name)}(\{{[^}}]*\}}) .*$', rf"{name}\g<1> {value}", text, flags=re.M)
        return text


@pytest.fixture
def engine():
    eng = _Engine()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: bytes, status: int = 200) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if self.path == "/metrics":
                self._send(eng.metrics().encode())
            else:
                self._send(json.dumps({"data": [{"id": "tiny-llama", "max_model_len": 2048}]}).encode())

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            words = len(body["prompt"].split())
            with eng.lock:
                eng.prompt_words.append(words)
                eng.models.add(body["model"])
                eng.n += 1
            self._send(json.dumps({"usage": {"prompt_tokens": 6 * words}}).encode())

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    eng.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield eng
    server.shutdown()
    server.server_close()


def test_the_drive_scrapes_around_each_request_and_reads_the_link_around_each_batch(engine):
    """Three batches (1, 3, 5 requests): 9 transfers of 3.5 MiB at 30 ms each and three link counts,
    the prompt resized after the first answer to fill the model (0.9 x 2046 tokens, unique words so no
    prefix-cache hit shortens the pull), the model the API's first where the cluster file names none.
    Planted: decode scraped once a batch (3 transfers of several, not 9), or the link read once for the
    whole drive (the batches' counts lost)."""
    link = {"lossless": 10_000, "tcp": 500}

    def read_link():
        link["lossless"] += 3_707_000 * (engine.n - read_link.seen)
        read_link.seen = engine.n
        return dict(link)
    read_link.seen = 0
    cluster = SimpleNamespace(api_url=engine.url, model=None, auth_headers=lambda: {})   # the API's first model
    drive = NixlDrive(cluster, [f"{engine.url}/metrics"], read_link, host="nx-h0", interface="fab0",
                      lossless_class="1:10")
    for k in (1, 3, 5):
        drive.more(k)
    run = drive.run
    assert [t.count for t in run.transfers] == [1] * 9 and all(t.bytes == 3_670_016 for t in run.transfers)
    assert all(t.seconds == pytest.approx(0.03) for t in run.transfers)
    assert len(run.links) == 3 and run.link.crossed and run.link.ratio == pytest.approx(1.0101, abs=1e-3)
    assert engine.prompt_words[0] == 100 and engine.prompt_words[1] == int(100 * int(0.9 * 2046) / 600)
    assert run.requests == 9 and not run.errors and run.to_dict()["source"] == "nixl_metrics"
    assert engine.models == {"tiny-llama"}
