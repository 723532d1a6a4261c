"""Acceptance of issue 28 item 3: 6.1.3's KV-use reads and 6.1.2's migration counter go through a real
Prometheus (Debian's ``prometheus``, started here with a 1 s scrape interval, never as a service) and
agree with scraping the same endpoints directly.

The reference engine stands in for the cluster: two single-process engines (``python -m harness serve``,
an 8 MiB KV pool so a few streams move KV use) are the workers whose ``/metrics`` carry KV use, and a
bundled PD topology (router + 1 prefill + 2 decode) is the router whose ``/metrics`` count the streams it
moved off a killed decode worker (``pdengine_router_reschedules``: the bundled engine's migration
counter; its own KV pool stays unused). Prometheus scrapes the router and both engines.

* 6.1.3: the KV drive of the suite (KvDrive) runs on a KvMeter whose source is the Prometheus, while a
  second KvMeter scrapes the same URLs directly every 0.1 s. Both keep the same endpoints; every sample
  Prometheus stored lies within the direct reads of the same moment (+-1 s, the scrape interval) up to
  KV_TOLERANCE; Prometheus' maximum over the drive's window is at most the direct maximum and at least what
  the direct reads held for the scrape interval around their peak (a 1 s sampler can miss a shorter peak),
  both up to KV_TOLERANCE; the idle engine and the router read 0 both ways; a counter read settled through
  Prometheus equals the direct read once the load is over.
* 6.1.2: a decode worker is killed under streams; the reschedule counter read through Prometheus
  (settled: after its next scrape) equals the direct read, before and after, and rose.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.probes.loadgen.kv_drive import DrivePlan, KvDrive, KvMeter, KvSample
from harness.probes.metrics.promql import PrometheusSource
from harness.probes.client.streaming import AsyncStreamingClient
from harness.scenarios.migration_on_loss import migration_count
from harness.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROM_PORT = 19100
ROUTER_PORT = 19110
ENGINE_PORTS = (19111, 19112)
KV_TOLERANCE = 0.05      # KV use (0..1): one block of the 8 MiB pool is 1/128
# direct reads this close to a Prometheus sample count as the same moment: a scrape interval either side and
# as much again for the scrape's own delay on a loaded 2-core machine (at 1 s, CI 2026-12-06 had 2 of 18
# samples of a ramp rising 0.16 a second read a second "late": 0.164 against direct 0.32-0.56). CI 2026-12-07
# had 2 of 18 outside it again: the direct reads were stamped when a read of all three endpoints began, and the
# engine's answer came after the router's; each endpoint is now timed at its own answer (ScrapeSource). Beside
# six CPU burners after that: 19/19, 19/19, 21/21 (one earlier run 19/20) inside.
WINDOW_S = 2.0
MIN_AGREEING = 0.9       # share of Prometheus samples inside the direct reads' envelope


def _prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (.ci/run installs Debian's prometheus package)")
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    return found


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def prometheus(targets: list[str], workdir: Path) -> Iterator[str]:
    """A real Prometheus scraping ``targets`` (host:port, /metrics) every second; yields its base URL."""
    binary = _prometheus_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
                      "scrape_configs:\n  - job_name: cluster\n    static_configs:\n"
                      f"      - targets: [{', '.join(repr(t) for t in targets)}]\n")
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{PROM_PORT}"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PROM_PORT}"
    try:
        wait_until(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 60, 0.2,
                   what="prometheus ready", retry_on=(httpx.HTTPError,))
        yield url
    finally:
        _stop(proc)
        log.close()


@contextlib.contextmanager
def engine(port: int, workdir: Path) -> Iterator[str]:
    """The single-process reference engine, preset ``long`` (the KV drive's 2000-character calibration prompt
    and its KV fit), with an 8 MiB KV pool: 2048 tokens, so a few streams of 450 move KV use past 0.6."""
    log = open(workdir / f"engine-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "serve", "--port", str(port), "--preset", "long",
                             "--kv-budget-mb", "8"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 120, 0.2,
                   what=f"engine on {port} healthy", retry_on=(httpx.HTTPError,))
        yield url
    finally:
        _stop(proc)
        log.close()


def _envelope_agreement(prom: list[tuple[int, float]], direct: list[tuple[int, float]]) -> tuple[int, int, list]:
    """(agreeing, compared, misses): a Prometheus sample agrees when it lies within KV_TOLERANCE of the range
    of the direct reads within WINDOW_S of its scrape time."""
    agreeing, compared, misses = 0, 0, []
    for t, v in prom:
        near = [d for td, d in direct if abs(td - t) <= WINDOW_S * 1e9]
        if not near:
            continue
        compared += 1
        if min(near) - KV_TOLERANCE <= v <= max(near) + KV_TOLERANCE:
            agreeing += 1
        else:   # the miss, the envelope, and the direct reads' offsets from its scrape time (s) with their values
            misses.append((round(t / 1e9, 3), v, min(near), max(near),
                           [(round((td - t) / 1e9, 2), round(d, 3)) for td, d in direct if abs(td - t) <= WINDOW_S * 2e9]))
    return agreeing, compared, misses


def test_kv_use_and_the_migration_counter_read_through_prometheus_agree_with_direct_scraping(tmp_path):
    from harness.engine.pd.topology import Topology

    with contextlib.ExitStack() as stack:
        topo = stack.enter_context(Topology(prefill=1, decode=2, preset="tiny", port=ROUTER_PORT,
                                            log_dir=tmp_path / "pd"))
        e1, e2 = (stack.enter_context(engine(p, tmp_path)) for p in ENGINE_PORTS)
        router = f"http://127.0.0.1:{ROUTER_PORT}"
        prom_url = stack.enter_context(prometheus([f"127.0.0.1:{p}" for p in (ROUTER_PORT, *ENGINE_PORTS)],
                                                  tmp_path / "prom"))
        urls = [f"{router}/metrics", f"{e1}/metrics", f"{e2}/metrics"]
        source = stack.enter_context(PrometheusSource(prom_url, "pdengine", max_lag_s=20))
        wait_until(lambda: len(source.last_scrapes(urls)) == len(urls), 30, 0.2, what="every target scraped once")

        # -- 6.1.3: the KV drive on a Prometheus-backed meter, a direct meter beside it -----------------
        via_prom, direct = KvMeter(urls, "pdengine", source=source), KvMeter(urls, "pdengine")
        stack.callback(direct.close)
        via_prom.check()
        direct.check()
        assert via_prom.urls == direct.urls == urls and via_prom.dropped == direct.dropped == {}

        direct_samples: list[KvSample] = []
        stop = threading.Event()

        def sample_directly() -> None:
            while not stop.wait(0.1):
                direct_samples.append(direct.read())

        sampler = threading.Thread(target=sample_directly, name="direct-kv-sampler")
        sampler.start()
        plan = DrivePlan(thresholds=(0.3, 0.6), prompt_tokens=300, output_tokens=150, max_concurrency=8,
                         ramp_budget_s=40, hold_s=8, step_down_timeout_s=30, sample_s=0.5)

        async def drive():
            async with AsyncStreamingClient(e1, model="long", timeout_s=120, read_timeout_s=60) as client:
                return await KvDrive(client, via_prom, plan).run()

        try:
            result = asyncio.run(drive())
        finally:
            stop.set()
            sampler.join()
        assert set(result.crossed_wall_ns) == {0, 1}, f"KV use did not move: {result.ramp_ended}"
        assert result.step_down_s is not None
        assert all(r.ok for r in result.records), [r.error_message for r in result.records if not r.ok][:3]
        start, end = result.samples[0].t_wall_ns, result.samples[-1].t_wall_ns
        prom_series = source.series(urls, "kv_usage", start, end)
        direct_series = direct.source.series(urls, "kv_usage", start, end)
        window_s = (end - start) / 1e9
        # a sample per second (the scrape interval) from Prometheus, its own scrape times
        assert len(prom_series[e1 + "/metrics"]) >= 0.7 * window_s, (len(prom_series[e1 + "/metrics"]), window_s)
        agreeing, compared, misses = _envelope_agreement(prom_series[e1 + "/metrics"], direct_series[e1 + "/metrics"])
        print(f"KV use: {agreeing}/{compared} Prometheus samples inside the direct reads (+-{WINDOW_S} s, "
              f"+-{KV_TOLERANCE}); window {window_s:.1f} s; misses {misses[:5]}")
        assert compared >= 0.7 * window_s and agreeing >= MIN_AGREEING * compared, misses[:10]
        prom_max = max(v for _, v in prom_series[e1 + "/metrics"])
        direct_max = max(v for _, v in direct_series[e1 + "/metrics"])
        print(f"KV use max over the window: Prometheus {prom_max:.4f}, direct {direct_max:.4f}")
        # a 1 s sampler can miss a peak shorter than its interval: Prometheus' max must reach at least what the
        # direct reads held throughout the scrape interval around their peak, and never exceed their max
        t_peak = max(direct_series[e1 + "/metrics"], key=lambda p: p[1])[0]
        held = min(v for t, v in direct_series[e1 + "/metrics"] if abs(t - t_peak) <= WINDOW_S * 1e9)
        assert held - KV_TOLERANCE <= prom_max <= direct_max + KV_TOLERANCE, (prom_max, held, direct_max)
        assert prom_max >= plan.thresholds[1]
        # the idle engine and the router (its own pool, unused: the load went to the engine): zero both ways
        for idle in (urls[0], e2 + "/metrics"):
            assert {v for _, v in prom_series[idle]} == {v for _, v in direct_series[idle]} == {0.0}, idle
        summary = via_prom.per_worker(start, end)  # what the suite puts in its evidence
        assert summary[e1 + "/metrics"]["max"] == prom_max and summary[e2 + "/metrics"]["max"] == 0.0
        # a counter after the load: settled through Prometheus it is the direct value exactly
        settled = source.read(urls[1:], ["requests_finished"], settled=True)
        now = direct.source.read(urls[1:], ["requests_finished"])
        assert settled.values[e1 + "/metrics"]["requests_finished"] == now.values[e1 + "/metrics"]["requests_finished"] \
            == len(result.records) + 1  # + the drive's calibration request

        # -- 6.1.2: the migration counter across a decode worker's kill ------------------------------------
        before_direct = migration_count(urls[0], "pdengine", quantity="reschedules")
        before_prom = migration_count(urls[0], "pdengine", source=source, settled=True, quantity="reschedules")
        assert before_direct == before_prom == 0.0
        done: list[int] = []

        def stream(i: int) -> None:
            body = {"model": "tiny", "prompt": f"stream {i} across a kill", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=120) as resp:
                done.append(sum(1 for line in resp.iter_lines() if line.startswith("data: {")))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        wait_until(lambda: sum(w.active_requests for w in topo.workers() if w.role == "decode") >= 4, 60, 0.05,
                   what="streams decoding")
        topo.kill("decode-0")
        for t in threads:
            t.join()
        after_direct = migration_count(urls[0], "pdengine", quantity="reschedules")
        after_prom = migration_count(urls[0], "pdengine", source=source, settled=True, quantity="reschedules")
        print(f"reschedules across the kill: direct {before_direct:g} -> {after_direct:g}, "
              f"Prometheus {before_prom:g} -> {after_prom:g}")
        assert len(done) == 6 and after_direct >= 1
        assert after_prom == after_direct
