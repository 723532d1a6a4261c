"""Load generator accuracy and coordinated omission, against the bundled tiny server.

1. Client overhead: TTFT p50 as the Locust user records it, against the server's own TTFT
   histogram (Prometheus, scraped over the same run) as the baseline.
2. Generator lateness: how late open-loop sends leave against their schedule (sched_delay).
3. Coordinated omission: the same seeded Poisson schedule with an in-flight cap of 1 user and
   of 16 users; p99 TTFT from the actual send hides the queueing that the cap causes, p99 from
   the scheduled send shows it. Ratios are against the 16-user run of the same process.

    .venv/bin/python bench/bench_load.py --quick
"""

from __future__ import annotations

import argparse
import tempfile

from harness.engine.serving.server import ServerProcess
from harness.probes.client.analysis import summarize
from harness.probes.loadgen.load import LoadRunner
from harness.probes.metrics.prometheus import PrometheusScraper
from harness.probes.loadgen.workload import LoadProfile


def run(url: str, users: int, rate: float, duration_s: float, max_tokens: int) -> tuple[dict, float]:
    profile = LoadProfile(mode="poisson", rate=rate, users=users, duration_s=duration_s, max_tokens=max_tokens,
                          seed=7)
    with PrometheusScraper(url + "/metrics", interval_s=0.5) as scraper:
        start = scraper.samples[-1].t_wall_ns
        records = LoadRunner(url, profile, output_dir=tempfile.mkdtemp(prefix="bench-load-")).run()
        scraper.scrape_once()
        server_ttft_p50_ms = scraper.quantile("ttft_seconds", 0.5, start_wall_ns=start) * 1e3
    return summarize(records), server_ttft_p50_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (about a minute in all)")
    args = parser.parse_args()
    duration = 4.0 if args.quick else 20.0
    rate, max_tokens = 3.0, 16
    with ServerProcess("tiny") as server:
        wide, server_p50 = run(server.url, 16, rate, duration, max_tokens)
        narrow, _ = run(server.url, 1, rate, duration, max_tokens)

    lat = wide["latency_ms"]
    print(f"\nPoisson {rate}/s for {duration:.0f} s, {max_tokens} tokens, tiny preset "
          f"({wide['ok']} ok / {wide['requests']} with 16 users, {narrow['ok']} ok / {narrow['requests']} with 1)")
    print("\n1. client overhead (16 users)")
    print(f"  client TTFT p50 {lat['sent']['ttft_ms']['p50']:.1f} ms, server histogram p50 {server_p50:.1f} ms "
          f"(bucket-interpolated): ratio {lat['sent']['ttft_ms']['p50'] / server_p50:.2f}")
    print("\n2. generator lateness (16 users)")
    d = wide["sched_delay_ms"]
    print(f"  sent - scheduled: p50 {d['p50']:.2f} ms, p99 {d['p99']:.2f} ms, max {d['max']:.2f} ms")
    print("\n3. coordinated omission: TTFT p99, in-flight cap 1 vs 16 users")
    print(f"  {'users':>5}  {'from actual send':>16}  {'from scheduled send':>19}  {'scheduled/actual':>16}")
    for name, s in (("16", wide), ("1", narrow)):
        sent, sched = s["latency_ms"]["sent"]["ttft_ms"]["p99"], s["latency_ms"]["scheduled"]["ttft_ms"]["p99"]
        print(f"  {name:>5}  {sent:>13.1f} ms  {sched:>16.1f} ms  {sched / sent:>16.2f}")
    ref = wide["latency_ms"]["scheduled"]["ttft_ms"]["p99"]
    print(f"  1-user scheduled p99 / 16-user: {narrow['latency_ms']['scheduled']['ttft_ms']['p99'] / ref:.2f}"
          f"; 1-user actual-send p99 / 16-user: {narrow['latency_ms']['sent']['ttft_ms']['p99'] / wide['latency_ms']['sent']['ttft_ms']['p99']:.2f}")


if __name__ == "__main__":
    main()
