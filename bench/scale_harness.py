"""Items 1-4 of bench/bench_scale.py at one worker count (``measure_size``): a real harness run as a
child process measured from outside (``harness_run``: CPU, Locust's share, RSS), its records read back
(``ingest``), its report rendered and loaded in Chromium (``report_figures``), and a fan-out kill of
10 % of the workers under load (``fanout_kill``). The module doc of bench/bench_scale.py says what
each figure is."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from bench.scale_cluster import (PER_PROCESS, ROOT, BenchError, DynamoMany, LoadHosts, cluster_data,
                                 fault_processes, frontend_requests, registered_after)
from harness.cluster import ClusterHandle
from harness.clusterfile import load_cluster
from harness.faults.fanout import fan_out, plan_fanout, revert_fanout
from harness.faults.ledger import STATE_DIR_ENV
from harness.faults.selectors import Selector
from harness.fixtures import make_fault_runner
from harness.probes.client.analysis import summarize
from harness.probes.client.records import iter_records
from harness.probes.loadgen.load_distributed import runner_for
from harness.probes.loadgen.workload import LoadProfile
from harness.probes.machine_health.procfs import cmdline, cpu_and_start_seconds, descendants
from harness.report.html import render_html
from harness.report.jsonout import read_json
from harness.scenarios.migration_on_loss import migration_count
from harness.scenarios.reschedule import wait_serving

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
SAMPLE_S = 0.2          # /proc sampling interval of the harness run's process tree
INGEST_MIN_S = 1.0      # read the records again and again for at least this long
SUMMARIZE_RECORDS = 20_000  # the run's records repeated to at least this many for analysis.summarize
FANOUT_USERS = 8        # closed-loop streams while 10 % of the workers are killed
FANOUT_LOAD_S = 12.0    # the load's length (--quick: 4 s): the kill comes FANOUT_SETTLE_S after its first answer
FANOUT_SETTLE_S = 2.0
QUICK_USERS = 16        # --quick: 6.2 gets the requests it needs to decide in a few seconds of load
# --quick: the cluster file caps 6.2's load at this many seconds (the checklist's max_load_s is 90). The
# quick run measures the harness's cost per request, not the cluster: a 32-worker run left undecided
# extended to 95 s (CI 2026-12-06) and cost CI a minute and a half for no figure it checks.
QUICK_MAX_LOAD_S = 20.0


# -- 1. the harness's own cost ---------------------------------------------------------------------------


@dataclass
class HarnessRun:
    exit_code: int
    wall_s: float
    cpu_s: float              # user + system of pytest and every child it reaped (its Locust)
    locust_cpu_s: float       # of that, the Locust processes' (sampled: up to SAMPLE_S short at their end)
    tree_rss_peak_mb: float   # sum of RSS over pytest and its descendants, largest sample
    pytest_hwm_mb: float      # pytest's own VmHWM, last sample before it exited
    run_dir: Path
    hosts_locust_cpu_s: float = 0.0   # --load-hosts: the Locust workers on the load hosts (sampled)
    hosts_rss_peak_mb: float = 0.0    # their summed RSS, largest sample


def _rss_kb(pid: int, key: str = "VmRSS") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def harness_run(cluster_file: Path, report_dir: Path, state_dir: Path, quick: bool,
                load_hosts: LoadHosts | None = None) -> HarnessRun:
    """One real harness run as a child process, measured from outside (see the module doc); with
    ``load_hosts`` (the cluster file names them) their Locust workers are sampled too."""
    suite = (["suites/test_62_slo.py", "--load-duration=4", f"--load-users={QUICK_USERS}"] if quick
             else ["suites/test_62_slo.py", "suites/test_item4_reschedule.py", "--kills=1"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suite, f"--cluster={cluster_file}",
           f"--report-dir={report_dir}"]
    env = dict(os.environ, **{STATE_DIR_ENV: str(state_dir)})
    peak = {"tree": 0, "hwm": 0, "hosts": 0}
    log_path = report_dir.parent / f"{report_dir.name}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    done = threading.Event()

    locust_cpu: dict[int, float] = {}  # pid -> its last CPU seconds seen (Locust, and its workers if any)
    hosts_cpu: dict[int, float] = {}   # the same for the load hosts' Locust workers

    def sample() -> None:
        while not done.wait(SAMPLE_S):
            kids = descendants(proc.pid)
            peak["tree"] = max(peak["tree"], sum(_rss_kb(p) for p in [proc.pid, *kids]))
            peak["hwm"] = max(peak["hwm"], _rss_kb(proc.pid, "VmHWM"))
            for pid in kids:
                if (cpu := cpu_and_start_seconds(pid)) is not None and any("locust" in a for a in cmdline(pid)):
                    locust_cpu[pid] = cpu[0]
            if load_hosts is not None:
                remote = load_hosts.locust_pids()
                peak["hosts"] = max(peak["hosts"], sum(_rss_kb(p) for p in remote))
                for pid in remote:
                    if (cpu := cpu_and_start_seconds(pid)) is not None:
                        hosts_cpu[pid] = cpu[0]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # the child's rusage, with its reaped children's
    except BaseException:  # Ctrl-C: the harness run reverts its faults on SIGTERM; never leave it unreaped
        proc.terminate()
        proc.wait()
        raise
    finally:
        done.set()
        sampler.join()
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1, 2):  # conformant, not, inconclusive: a measured run either way
        raise BenchError(f"the harness run exited {proc.returncode}: {log_path.read_text(errors='replace')[-3000:]}")
    return HarnessRun(proc.returncode, wall, usage.ru_utime + usage.ru_stime, sum(locust_cpu.values()),
                      peak["tree"] / 1024, peak["hwm"] / 1024, (report_dir / "latest").resolve(),
                      sum(hosts_cpu.values()), peak["hosts"] / 1024)


# -- 2. records ingested ---------------------------------------------------------------------------------


def ingest(run_dir: Path) -> dict:
    """Records per second that ``iter_records`` parses from the run's record files, and their size."""
    files = sorted(run_dir.glob("artifacts/*/requests*.jsonl"))
    count = sum(1 for f in files for _ in iter_records(f))
    if not count:
        raise BenchError(f"the harness run wrote no request records under {run_dir}/artifacts")
    size = sum(f.stat().st_size for f in files)
    passes, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < INGEST_MIN_S or passes < 3:
        for f in files:
            for _ in iter_records(f):
                pass
        passes += 1
    tracemalloc.start()  # what the records cost held in memory, as a suite holds a run's records
    records = [r for f in files for r in iter_records(f)]
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    many = records * -(-SUMMARIZE_RECORDS // len(records))  # the same records, enough of them to time
    best = float("inf")
    for _ in range(2):  # the first call also pays for pandas' own warm-up
        t0 = time.perf_counter()
        summarize(many)
        best = min(best, time.perf_counter() - t0)
    return {"records": count, "bytes_per_record": size / count, "held_per_record": held / count,
            "records_per_s": count * passes / elapsed,
            "summarized": len(many), "summarize_per_s": len(many) / best}


# -- 3. the report ---------------------------------------------------------------------------------------


def report_figures(run_dir: Path, scratch: Path, repeats: int) -> dict:
    """Sizes of results.json and report.html, render_html time, Chromium's load time (best of ``repeats``)."""
    results, html = run_dir / "results.json", run_dir / "report.html"
    result = read_json(results)
    render_s = float("inf")
    for _ in range(3):  # the first call also loads and compiles the template
        t0 = time.perf_counter()
        rendered = render_html(result)
        render_s = min(render_s, time.perf_counter() - t0)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        dom = chromium(scratch / f"chromium-{i}", html.as_uri())
        times.append(time.perf_counter() - t0)
        rows = dom.count('class="verdict"')
        if rows != len(result.verdicts):
            raise BenchError(f"Chromium rendered {rows} verdict rows of {len(result.verdicts)} from {html}")
    return {"results_kb": results.stat().st_size / 1024, "html_kb": html.stat().st_size / 1024,
            "rendered_kb": len(rendered.encode()) / 1024, "render_ms": render_s * 1e3,
            "chromium_ms": min(times) * 1e3, "verdicts": len(result.verdicts)}


def chromium(profile: Path, url: str) -> str:
    """Headless Chromium's DOM of ``url`` once it has loaded (its scripts run)."""
    if CHROMIUM is None:
        raise BenchError("chromium is not installed (apt-get install chromium): the report's render time needs it")
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                           f"--user-data-dir={profile}", "--dump-dom", url], capture_output=True, text=True,
                          timeout=120, check=True).stdout


# -- 4. 10 % of the workers at once ----------------------------------------------------------------------


def fanout_kill(cluster_file: Path, api: str, workers: int, state_dir: Path, load_s: float = FANOUT_LOAD_S) -> dict:
    """Kill round(10 % of the workers) worth of mocker processes in parallel under load (8 closed-loop
    streams), verified, then back; what the load's requests saw and how many the frontend migrated."""
    spec = load_cluster(cluster_file)
    cluster = ClusterHandle(spec, spec.checklist(), api, None, None)
    k = fault_processes(workers)
    plan = plan_fanout(cluster, "process_kill", Selector.parse(f"fixed:{k}"), seed=workers)
    profile = LoadProfile(mode="closed", users=FANOUT_USERS, duration_s=load_s, max_tokens=64,
                          engine="dynamo", model=spec.model, seed=workers)
    migrated0 = migration_count(f"{api}/metrics", "dynamo")
    counted0 = frontend_requests(api)
    # the cluster file's load hosts when it names them (--load-hosts), else one Locust process here
    with runner_for(spec, api, profile, output_dir=state_dir.parent / f"fanout-load-{workers}") as load:
        wait_serving(load, "the fan-out's load")
        time.sleep(FANOUT_SETTLE_S)  # streams in flight on every process, the victims' included
        cpu0 = self_cpu()
        with make_fault_runner(cluster, state_dir=state_dir) as runner:
            fan = fan_out(runner, cluster, plan, max_parallel=k)
            revert_fanout(runner, fan)
        cpu = self_cpu() - cpu0
        records = load.wait()
    if len(fan.faults) != k:
        raise BenchError(f"the fan-out injected {len(fan.faults)} faults, {k} planned")
    migrated1 = migration_count(f"{api}/metrics", "dynamo")
    return {"processes": k, "workers_down": k * PER_PROCESS, "inject_s": fan.inject_s, "revert_s": fan.revert_s,
            "bench_cpu_s": cpu, "requests": len(records), "ok": sum(r.status == "ok" for r in records),
            "migrated": None if migrated0 is None or migrated1 is None else migrated1 - migrated0,
            "by_host": dict(sorted(Counter(r.load_host or "here" for r in records).items())),
            "counted": frontend_requests(api) - counted0}

def verdicts(run_dir: Path) -> str:
    """The run's verdicts, one word each: ``6.2 pass, 6.1.4 fail, ...`` (the main items judged)."""
    return ", ".join(f"{v.item} {v.status.value}" for v in read_json(run_dir / "results.json").verdicts)


def records_by_host(run_dir: Path) -> dict[str, int]:
    """A harness run's request records per load host (``here``: sent from this machine)."""
    return dict(sorted(Counter(r.load_host or "here" for f in sorted(run_dir.glob("artifacts/*/requests*.jsonl"))
                               for r in iter_records(f)).items()))


def self_cpu() -> float:
    """The bench process's own CPU seconds so far (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_size(workers: int, scratch: Path, quick: bool, load_hosts: LoadHosts | None = None) -> dict:
    """Items 1-4 at one size. With ``load_hosts``: the frontend on their gateway, the harness run once
    from here and once more from the load hosts (the cluster file naming them), and the fan-out's load
    from the load hosts."""
    host = load_hosts.gateway if load_hosts else "127.0.0.1"
    with DynamoMany(workers, scratch, frontend_host=host) as dyn:
        api = dyn.ready["api"]
        cluster_file = scratch / f"bench-scale-{workers}.yaml"
        cap = QUICK_MAX_LOAD_S if quick else None
        cluster_file.write_text(yaml.safe_dump(cluster_data(workers, dyn.run_dir, frontend_host=host, max_load_s=cap),
                                               sort_keys=False))
        counted0 = frontend_requests(api)
        run = harness_run(cluster_file, scratch / f"reports-{workers}", scratch / f"state-{workers}", quick)
        figures = {"workers": workers, "processes": len(dyn.ready["workers"]), "startup_s": dyn.ready["startup_s"],
                   "run": run, "counted": frontend_requests(api) - counted0, "by_host": records_by_host(run.run_dir),
                   "ingest": ingest(run.run_dir), "report": report_figures(run.run_dir, scratch, 1 if quick else 2)}
        if load_hosts is not None:
            figures["registered_before_dist"] = registered_after(api, workers)
            cluster_file = scratch / f"bench-scale-{workers}-load-hosts.yaml"
            cluster_file.write_text(yaml.safe_dump(cluster_data(workers, dyn.run_dir, frontend_host=host,
                                                                load_hosts=load_hosts.entries(), max_load_s=cap),
                                                   sort_keys=False))
            counted0 = frontend_requests(api)
            dist = harness_run(cluster_file, scratch / f"reports-{workers}-load-hosts",
                               scratch / f"state-{workers}-load-hosts", quick, load_hosts)
            figures["dist"] = {"run": dist, "counted": frontend_requests(api) - counted0,
                               "by_host": records_by_host(dist.run_dir), "verdicts": verdicts(dist.run_dir)}
        figures["verdicts"] = verdicts(run.run_dir)
        figures["registered_after_run"] = registered_after(api, workers)
        figures["fanout"] = fanout_kill(cluster_file, api, workers, scratch / f"state-{workers}",
                                        FANOUT_LOAD_S / 3 if quick else FANOUT_LOAD_S)
    if dyn.left:
        raise BenchError(f"the {workers}-worker cluster's processes {dyn.left} remain after its launcher stopped")
    return figures
