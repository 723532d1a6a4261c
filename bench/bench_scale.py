"""The figures of a many-worker run (issue 28 item 4), at 16, 64 and 128 Dynamo mocker workers.

For each worker count a real NVIDIA Dynamo cluster is started (``python -m clusters.dynamo.launch
many --workers N --per-process 8``, its own run dir and a cluster file written for it), then:

1. **the harness's own cost**: a real harness run, ``pytest suites/test_62_slo.py
   suites/test_item4_reschedule.py --cluster=FILE --kills=1`` (6.2 under 15 s of load; then one load
   run with a kill and an 8 s hang of a mocker process, each back in traffic before the next; 6.2,
   6.1.4 and nothing-lost judged; ``--quick``: ``test_62_slo.py --load-duration=4 --load-users=16`` only), as a child
   process: its CPU seconds (user + system, its Locust included: ``wait4``), Locust's share (sampled),
   the peak RSS of its process tree (pytest + Locust, sampled from /proc every 0.2 s) and pytest's
   own high-water mark (``VmHWM``). The load is the suites' default at every size (4 users), so the
   ratios show what the worker count itself costs the harness;
2. **records per second ingested**: that run's request records (its ``requests*.jsonl``) read with
   ``harness.probes.client.records.iter_records`` again and again for at least a second, then summarized
   (``harness.probes.client.analysis.summarize``: the percentiles every suite computes) repeated to 20 000
   records; bytes per record;
3. **the report**: ``results.json`` and ``report.html`` sizes, ``render_html`` of the results.json
   read back, and headless Chromium loading the report (``--dump-dom``; its verdict rows checked);
4. **faults on 10 % of the workers at once**: a fan-out ``process_kill`` of round(10 % of N / 8)
   mocker processes (at least 1; each holds 8 workers) in parallel, each verified dead and then back
   as a new healthy process (``harness.faults.fanout``), under 8 closed-loop streams: how many of
   their requests completed, and the frontend's migration counter over it.

Then the **SSH fan-out** on its own: namespace hosts, each with its own real sshd (``SshdTest``,
prefix ``pde-``) and a sleeper; on the first 4, 16 and 32 hosts, with the fan-out's own pool (16 at
once; ``--ssh-pool``), each host's SSH connection and a ``true``, then ``process_hang`` on ``all`` of
them and the parallel revert (every command over SSH, audited; a fresh runner each time), and the 4
hosts again with a pool of 1 (serial) as the baseline of the parallel pool. A fan-out that fails
(a command timed out) is printed as a measured outcome and the bench exits 1.

With ``--load-hosts N`` (root) the load comes from N namespace load hosts as well (issue 28 items 1
and 4): each with its own real sshd (``SshdTest``, prefix ``pdg-``, 198.18.71.0/24 + 198.18.72.0/24),
the Dynamo frontend listening on their gateway (the launcher's ``--frontend-host``), the cluster file
naming them under ``load_hosts:`` with the Locust master on that gateway (port 19500). At each size
the harness run of item 1 runs from here and then again from the load hosts (Locust's master here, a
worker per host over SSH, records streamed back over SFTP), and the fan-out's load of item 4 comes
from the load hosts: records per host, the merged count against the requests the frontend counted
(``dynamo_frontend_requests_total``), the harness's CPU and RSS here and the workers' on the hosts,
and the ratio to the run from here at the same size (table 6). Every namespace, sshd, Locust worker
and Dynamo process is checked gone at the end.

Ratios are against the smallest size of the same run; the absolute figures are this machine's.

The parts: bench/scale_cluster.py (the Dynamo cluster, its cluster file, the load hosts),
bench/scale_harness.py (items 1-4 at one size), bench/scale_ssh.py (item 5); this file parses the
command line, runs them and prints the tables.

    .venv/bin/python bench/bench_scale.py            # 16, 64, 128 workers; 4, 16, 32 SSH hosts (root)
    .venv/bin/python bench/bench_scale.py --quick    # 16, 32 workers; 2, 4 SSH hosts (about 2 minutes)
    .venv/bin/python bench/bench_scale.py --workers 16,128 --ssh-hosts 0 --load-hosts 3   # + load from 3 hosts
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `clusters` (the launcher) and `bench` are folders of the checkout, not of the package

# the parts; LOAD_MASTER_PORT, cluster_data, fault_processes and SSH_PREFIX are read from this module by
# tests/test_bench_scale.py
from bench.scale_cluster import (FAULT_SHARE, LOAD_MASTER_PORT, PER_PROCESS, BenchError,  # noqa: E402,F401
                                 LoadHosts, cluster_data, fault_processes)
from bench.scale_harness import (FANOUT_LOAD_S, FANOUT_USERS, INGEST_MIN_S, QUICK_USERS,  # noqa: E402
                                 SUMMARIZE_RECORDS, chromium, measure_size)
from bench.scale_ssh import SSH_PREFIX, ssh_fanout  # noqa: E402,F401
from harness.faults.fanout import MAX_PARALLEL  # noqa: E402


# -- output ----------------------------------------------------------------------------------------------


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x (b = 0 with one point)."""
    if len(set(xs)) < 2:
        return statistics.fmean(ys), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def print_sizes(sizes: list[dict], quick: bool) -> None:
    base = sizes[0]
    b = base["workers"]
    suite = f"test_62_slo.py --load-duration=4 --load-users={QUICK_USERS}" if quick else "test_62_slo.py test_item4_reschedule.py --kills=1"
    print(f"\n1. the harness run (pytest {suite}; CPU and RSS include its Locust), ratios against {b} workers")
    print(f"{'workers':>7} {'procs':>5} {'up s':>5} {'exit':>4} {'wall s':>6} {'CPU s':>6} {'CPU ms/req':>10} "
          f"{'/' + str(b):>5} {'Locust s':>8} {'ms/req':>6} {'tree RSS MB':>11} {'/' + str(b):>5} {'pytest HWM MB':>13} "
          f"{'requests':>8}")
    per_req = {id(s): s["run"].cpu_s / max(1, s["ingest"]["records"]) * 1e3 for s in sizes}
    for s in sizes:
        r, n = s["run"], s["ingest"]["records"]
        print(f"{s['workers']:>7} {s['processes']:>5} {s['startup_s']:>5.1f} {r.exit_code:>4} {r.wall_s:>6.1f} "
              f"{r.cpu_s:>6.1f} {per_req[id(s)]:>10.2f} {per_req[id(s)] / per_req[id(base)]:>5.2f} "
              f"{r.locust_cpu_s:>8.1f} {r.locust_cpu_s / n * 1e3:>6.1f} {r.tree_rss_peak_mb:>11.0f} "
              f"{r.tree_rss_peak_mb / base['run'].tree_rss_peak_mb:>5.2f} {r.pytest_hwm_mb:>13.0f} {n:>8}")
    print("(CPU s: pytest with its Locust, from wait4; CPU ms/req: that per request sent (6.2 runs until its "
          "verdicts are decided, so the runs' lengths differ: the ratio is per request); Locust s: the Locust "
          "processes' share, sampled; ms/req: Locust CPU per request sent)")
    print(f"\n2. records ingested: iter_records over the run's record files (again and again for >= "
          f"{INGEST_MIN_S:.0f} s), then analysis.summarize over them repeated to {SUMMARIZE_RECORDS}")
    print(f"{'workers':>7} {'records':>7} {'B/record':>8} {'held B':>6} {'records/s':>9} {'/' + str(b):>5} "
          f"{'summarized/s':>12} {'/' + str(b):>5}")
    for s in sizes:
        i = s["ingest"]
        print(f"{s['workers']:>7} {i['records']:>7} {i['bytes_per_record']:>8.0f} {i['held_per_record']:>6.0f} "
              f"{i['records_per_s']:>9.0f} "
              f"{i['records_per_s'] / base['ingest']['records_per_s']:>5.2f} {i['summarize_per_s']:>12.0f} "
              f"{i['summarize_per_s'] / base['ingest']['summarize_per_s']:>5.2f}")
    print("(B/record: in the JSONL file; held B: Python memory per record read back, tracemalloc)")
    print("\n3. the report (render_html of results.json; headless Chromium --dump-dom, best of its tries)")
    print(f"{'workers':>7} {'verdicts':>8} {'results KB':>10} {'html KB':>7} {'/' + str(b):>5} {'render ms':>9} "
          f"{'chromium ms':>11} {'/' + str(b):>5}")
    for s in sizes:
        p = s["report"]
        print(f"{s['workers']:>7} {p['verdicts']:>8} {p['results_kb']:>10.1f} {p['html_kb']:>7.1f} "
              f"{p['html_kb'] / base['report']['html_kb']:>5.2f} {p['render_ms']:>9.0f} {p['chromium_ms']:>11.0f} "
              f"{p['chromium_ms'] / base['report']['chromium_ms']:>5.2f}")
    print(f"\n4. faults on {FAULT_SHARE:.0%} of the workers at once (process_kill fan-out, mocker processes of "
          f"{PER_PROCESS}; verified dead, back as new healthy processes)")
    print(f"{'workers':>7} {'registered':>10} {'killed':>6} {'workers down':>12} {'inject s':>8} {'revert s':>8} "
          f"{'bench CPU s':>11} {'requests':>8} {'ok':>5} {'migrated':>8}")
    for s in sizes:
        f = s["fanout"]
        migrated = "-" if f["migrated"] is None else f"{f['migrated']:.0f}"
        print(f"{s['workers']:>7} {s['registered_after_run']:>10} {f['processes']:>6} {f['workers_down']:>12} "
              f"{f['inject_s']:>8.2f} {f['revert_s']:>8.2f} {f['bench_cpu_s']:>11.2f} {f['requests']:>8} "
              f"{f['ok']:>5} {migrated:>8}")
    print(f"(registered: workers the frontend listed after the harness run, before the fan-out; requests: "
          f"{FANOUT_USERS} closed-loop streams of 64 tokens for {FANOUT_LOAD_S / 3 if quick else FANOUT_LOAD_S:.0f} s "
          "around the fan-out, ok of "
          "them, and the frontend's migrations over it)")


def _hosts(by_host: dict[str, int]) -> str:
    return " ".join(f"{h}={n}" for h, n in by_host.items())


def print_load_hosts(sizes: list[dict], count: int, quick: bool) -> None:
    """Table 6: the harness run from here and from the load hosts at each size, and the fan-out's load."""
    print(f"\n6. distributed load: the same harness run from here and from {count} namespace load hosts (own sshd "
          f"each, a Locust worker per host over SSH, the master here); ratios: load hosts / here at the same size")
    print(f"{'workers':>7} {'load':>5} {'exit':>4} {'wall s':>6} {'CPU s':>6} {'/here':>5} {'tree RSS MB':>11} "
          f"{'/here':>5} {'Locust s':>8} {'hosts CPU s':>11} {'hosts RSS MB':>12} {'records':>7} {'counted':>7}  per host")
    for s in sizes:
        here, d = s["run"], s["dist"]["run"]
        for label, r, counted, by_host in (("here", here, s["counted"], s["by_host"]),
                                           ("hosts", d, s["dist"]["counted"], s["dist"]["by_host"])):
            print(f"{s['workers']:>7} {label:>5} {r.exit_code:>4} {r.wall_s:>6.1f} {r.cpu_s:>6.1f} "
                  f"{r.cpu_s / here.cpu_s:>5.2f} {r.tree_rss_peak_mb:>11.0f} "
                  f"{r.tree_rss_peak_mb / here.tree_rss_peak_mb:>5.2f} {r.locust_cpu_s:>8.1f} {r.hosts_locust_cpu_s:>11.1f} "
                  f"{r.hosts_rss_peak_mb:>12.0f} {sum(by_host.values()):>7} {counted:>7.0f}  {_hosts(by_host)}")
    print("(CPU s, tree RSS: pytest and what it started here, the Locust master included; Locust s: of that CPU, "
          "the Locust process here (the master with load hosts), sampled; hosts: the Locust workers on the load hosts, sampled; records: the run's request records; counted: requests the "
          "frontend counted over the run, the harness's own probes and calibration included)")
    for s in sizes:
        print(f"{s['workers']:>7} verdicts here: {s['verdicts']}; from the load hosts: {s['dist']['verdicts']}")
    print(f"\n   the fan-out of table 4 under {FANOUT_USERS} closed-loop streams from the load hosts")
    print(f"{'workers':>7} {'killed':>6} {'workers down':>12} {'merged':>6} {'counted':>7} {'ok':>5} {'migrated':>8}"
          "  per host")
    for s in sizes:
        f = s["fanout"]
        migrated = "-" if f["migrated"] is None else f"{f['migrated']:.0f}"
        print(f"{s['workers']:>7} {f['processes']:>6} {f['workers_down']:>12} {f['requests']:>6} {f['counted']:>7.0f} "
              f"{f['ok']:>5} {migrated:>8}  {_hosts(f['by_host'])}")
    print("(merged: the records of every host merged; counted: dynamo_frontend_requests_total's rise over the load)")


def print_ssh(rows: list[dict]) -> None:
    serial = rows[-1]  # ssh_fanout's last row: the smallest count with a pool of 1
    parallel = [r for r in rows[:-1] if "error" not in r]
    print(f"\n5. SSH fan-out: each host its own sshd in a namespace (set up {rows[0]['setup_s']:.1f} s for "
          f"{max(r['hosts'] for r in rows)}); a fresh runner each row: connect + `true` on every host, then "
          "process_hang on all (over those connections), then the parallel revert")
    print(f"{'hosts':>5} {'pool':>4} {'connect s':>9} {'inject s':>8} {'revert s':>8} {'ms/host':>7} "
          f"{'inject/' + str(rows[0]['hosts']):>9} {'bench CPU s':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['hosts']:>5} {r['pool']:>4} FAILED: {r['error'][:600]}")
            continue
        ratio = f"{r['inject_s'] / rows[0]['inject_s']:.2f}" if "error" not in rows[0] else "-"
        print(f"{r['hosts']:>5} {r['pool']:>4} {r['connect_s']:>9.2f} {r['inject_s']:>8.2f} {r['revert_s']:>8.2f} "
              f"{r['inject_s'] / r['hosts'] * 1e3:>7.0f} {ratio:>9} {r['bench_cpu_s']:>11.2f}")
    base = rows[0]
    if "error" not in serial and "error" not in base:
        print(f"serial / parallel at {serial['hosts']} hosts: connect {serial['connect_s'] / base['connect_s']:.2f}, "
              f"inject {serial['inject_s'] / base['inject_s']:.2f}, revert {serial['revert_s'] / base['revert_s']:.2f}")
    if len(parallel) > 1:
        xs = [r["hosts"] for r in parallel]
        line = []
        for key in ("connect_s", "inject_s", "revert_s"):
            a, b = fit(xs, [r[key] for r in parallel])
            line.append((key[:-2], a, b))
        print("line fit: " + ", ".join(f"{k} {a:.2f} s + {b * 1e3:.0f} ms/host" for k, a, b in line)
              + "; at 125 hosts: " + ", ".join(f"{k} {a + 125 * b:.1f} s" for k, a, b in line) + " (extrapolated)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="16 and 32 workers, 2 and 4 SSH hosts, a 4 s load run (CI)")
    p.add_argument("--workers", help="comma-separated worker counts (default 16,64,128; --quick 16,32; 0: skip)")
    p.add_argument("--ssh-pool", type=int, default=MAX_PARALLEL,
                   help=f"largest parallel pool of the SSH fan-out (default {MAX_PARALLEL}, the fan-out's own)")
    p.add_argument("--ssh-hosts", help="comma-separated SSH host counts (default 4,16,32; --quick 2,4; 0: skip)")
    p.add_argument("--load-hosts", type=int, default=0,
                   help="load from this many namespace load hosts (own sshd each, prefix pdg-): each size's "
                        "harness run again from them, and the fan-out's load from them (root; default 0: none)")
    p.add_argument("--scratch", type=Path, help="scratch folder (default: a fresh temporary one, removed after)")
    args = p.parse_args(argv)
    try:
        workers = [int(w) for w in (args.workers or ("16,32" if args.quick else "16,64,128")).split(",") if w != "0"]
        hosts = [int(h) for h in (args.ssh_hosts or ("2,4" if args.quick else "4,16,32")).split(",") if h != "0"]
    except ValueError:
        p.error("--workers and --ssh-hosts take comma-separated whole numbers, e.g. --workers 16,64,128")
    for w in workers:
        if w < 2 * PER_PROCESS or w % PER_PROCESS or w // PER_PROCESS > 16:
            p.error(f"--workers {w}: each count must be a multiple of {PER_PROCESS} from {2 * PER_PROCESS} to "
                    f"{16 * PER_PROCESS} (two to sixteen mocker processes: the ports 8601-8616)")
    if not 0 <= args.load_hosts <= 16:
        p.error(f"--load-hosts {args.load_hosts}: must be from 0 (none) to 16")
    if args.ssh_pool < 1:
        p.error(f"--ssh-pool {args.ssh_pool}: must be at least 1")
    if any(h < 1 or h > 64 for h in hosts):
        p.error("--ssh-hosts: each count must be from 1 to 64 (the emulated fabric's largest: FabricConfig.hosts)")
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"this machine: {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} "
          f"GiB; absolute figures are this machine's, ratios against the smallest size of this run", flush=True)
    try:
        chromium(scratch / "chromium-warm-up", "about:blank")  # the first start reads its files from disk
        sizes = []
        with LoadHosts(args.load_hosts, scratch) if args.load_hosts else nullcontext() as load_hosts:
            for w in sorted(workers):
                sizes.append(measure_size(w, scratch, args.quick, load_hosts))
                print(f"measured {w} workers", flush=True)
        if sizes:
            print_sizes(sizes, args.quick)
        if sizes and args.load_hosts:
            print_load_hosts(sizes, args.load_hosts, args.quick)
        if hosts:
            rows = ssh_fanout(sorted(hosts), scratch, args.ssh_pool)
            print_ssh(rows)
            if failed := [r for r in rows if "error" in r]:
                raise BenchError(f"{len(failed)} SSH fan-out row(s) failed (above); what a failed revert left is in "
                                 f"the ledger under {scratch}/ssh-*/state (the bench's sleepers are ended)")
    except BenchError as exc:
        print(f"bench_scale: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
