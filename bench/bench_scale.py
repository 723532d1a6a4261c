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

    .venv/bin/python bench/bench_scale.py            # 16, 64, 128 workers; 4, 16, 32 SSH hosts (root)
    .venv/bin/python bench/bench_scale.py --quick    # 16, 32 workers; 2, 4 SSH hosts (about 2 minutes)
    .venv/bin/python bench/bench_scale.py --workers 16,128 --ssh-hosts 0 --load-hosts 3   # + load from 3 hosts
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `clusters` (the launcher) is a folder of the checkout, not of the package

from clusters.dynamo.launch import FRONTEND_PORT, registered, worker_layout  # noqa: E402
from harness.cluster import ClusterHandle  # noqa: E402
from harness.clusterfile import load_cluster  # noqa: E402
from harness.clusterfile.load import parse_cluster  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.faults.fanout import MAX_PARALLEL, fan_out, plan_fanout, revert_fanout  # noqa: E402
from harness.faults.ledger import STATE_DIR_ENV  # noqa: E402
from harness.faults.selectors import Selector  # noqa: E402
from harness.fixtures import make_fault_runner  # noqa: E402
from harness.probes.client.analysis import summarize  # noqa: E402
from harness.probes.loadgen.load_distributed import runner_for  # noqa: E402
from harness.probes.metrics.prometheus import PrometheusScraper  # noqa: E402
from harness.probes.machine_health.procfs import cmdline, cpu_and_start_seconds, descendants  # noqa: E402
from harness.probes.client.records import iter_records  # noqa: E402
from harness.report.html import render_html  # noqa: E402
from harness.probes.loadgen.workload import LoadProfile  # noqa: E402
from harness.report.jsonout import read_json  # noqa: E402
from harness.scenarios.migration_on_loss import migration_count  # noqa: E402
from harness.scenarios.reschedule import wait_serving  # noqa: E402

PER_PROCESS = 8
FAULT_SHARE = 0.10
SSH_PREFIX, SSH_FABRIC, SSH_CONTROL = "pde-", "198.18.61.0/24", "198.18.62.0/24"
LOAD_PREFIX, LOAD_FABRIC, LOAD_CONTROL = "pdg-", "198.18.71.0/24", "198.18.72.0/24"  # --load-hosts
LOAD_MASTER_PORT = 19500  # the Locust master of a distributed run (its workers dial it on the gateway)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
SAMPLE_S = 0.2          # /proc sampling interval of the harness run's process tree
INGEST_MIN_S = 1.0      # read the records again and again for at least this long
SUMMARIZE_RECORDS = 20_000  # the run's records repeated to at least this many for analysis.summarize
READY_TIMEOUT_S = 600.0
FANOUT_USERS = 8        # closed-loop streams while 10 % of the workers are killed
FANOUT_LOAD_S = 12.0    # the load's length (--quick: 4 s): the kill comes FANOUT_SETTLE_S after its first answer
FANOUT_SETTLE_S = 2.0
QUICK_USERS = 16        # --quick: 6.2 gets the requests it needs to decide in a few seconds of load
# --quick: the cluster file caps 6.2's load at this many seconds (the checklist's max_load_s is 90). The
# quick run measures the harness's cost per request, not the cluster: a 32-worker run left undecided
# extended to 95 s (CI 2026-12-06) and cost CI a minute and a half for no figure it checks.
QUICK_MAX_LOAD_S = 20.0


class BenchError(Exception):
    """A figure could not be measured; the message says which and why."""


# -- the cluster -----------------------------------------------------------------------------------------


def cluster_data(workers: int, run_dir: Path, per_process: int = PER_PROCESS, frontend_host: str = "127.0.0.1",
                 load_hosts: list[dict] | None = None, max_load_s: float | None = None) -> dict:
    """The cluster file of ``launch many --workers N --per-process P --run-dir RUN_DIR`` (the layout of
    clusters/dynamo-many.yaml: one inventory entry per mocker process, its pid file in the run dir).
    The blast radius allows one of two processes: the 16-worker cluster has only two. ``frontend_host``:
    the launcher's ``--frontend-host``; ``load_hosts``: the file's ``load_hosts:`` entries, the Locust
    master then listening on the frontend's address (the namespace hosts' gateway); ``max_load_s``: a
    threshold override capping 6.2's load (``--quick``)."""
    port = FRONTEND_PORT["many"]
    api = f"http://{frontend_host}:{port}"
    entries = [{"name": name, "role": role, "host": "localhost", "api": api,
                "health": f"http://127.0.0.1:{sys_port}/health", "metrics": f"http://127.0.0.1:{sys_port}/metrics",
                "process": {"pid_file": str(run_dir / f"{name}.pid")}, "supervised": True}
               for name, role, sys_port, _ in worker_layout("many", workers, per_process)]
    return {"version": 2, "name": f"bench-scale-{workers}", "kind": "external", "engine": "dynamo",
            "model": "tiny-llama", "endpoints": {"api": api, "metrics": f"{api}/metrics", "admin": None},
            "workload": {"prompt_tokens": 200, "output_tokens": 64}, "migration": {"on_worker_loss": True},
            "workers": entries, "hosts": [{"name": "localhost", "address": "127.0.0.1",
                                           "roles": ["router", "prefill", "decode"]}],
            "safety": {"production": False, "allowed_faults": "all", "blast_radius": {"max_role_share_down": 0.5}},
            **({"load_hosts": load_hosts, "load_master": {"bind": frontend_host, "port": LOAD_MASTER_PORT}}
               if load_hosts else {}),
            **({"thresholds": {"6.2.ttft": {"max_load_s": max_load_s}}} if max_load_s is not None else {})}


def fault_processes(workers: int, per_process: int = PER_PROCESS) -> int:
    """Mocker processes to kill at once for 10 % of ``workers`` (whole processes, at least one)."""
    return max(1, round(FAULT_SHARE * workers / per_process))


@dataclass
class DynamoMany:
    """``launch many`` in the background for the duration of a ``with`` block; stopped and reaped."""

    workers: int
    scratch: Path
    frontend_host: str = "127.0.0.1"
    venv: Path = field(default_factory=lambda: Path(os.environ.get("HARNESS_DYNAMO_VENV", ROOT / ".venv-dynamo")))
    proc: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)
    left: list[int] = field(default_factory=list)  # processes of the cluster still there after the stop

    @property
    def run_dir(self) -> Path:
        return self.scratch / f"dynamo-{self.workers}"

    def __enter__(self) -> DynamoMany:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ready_file, log_path = self.scratch / f"ready-{self.workers}.json", self.scratch / f"launch-{self.workers}.log"
        ready_file.unlink(missing_ok=True)
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "clusters.dynamo.launch", "many", "--workers", str(self.workers),
                 "--per-process", str(PER_PROCESS), "--venv", str(self.venv), "--run-dir", str(self.run_dir),
                 "--ready-file", str(ready_file), "--frontend-host", self.frontend_host], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise BenchError(f"the {self.workers}-worker Dynamo cluster did not start (exit "
                                 f"{self.proc.returncode}): {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        self.ready = json.loads(ready_file.read_text())
        return self

    def __exit__(self, *exc: object) -> None:
        # the launcher removes its pid files when it stops: read who runs now, to check they are gone after
        running = [int(f.read_text()) for f in self.run_dir.glob("*.pid") if f.read_text().strip().isdigit()]
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
        self.left = [pid for pid in running if Path(f"/proc/{pid}").exists()]


@dataclass
class LoadHosts:
    """``count`` namespace load hosts, each with its own real sshd (``SshdTest``, prefix ``pdg-``), for
    the duration of a ``with`` block; gone afterwards (checked). The frontend listens on their
    gateway (``--frontend-host``) and so does the Locust master their workers dial."""

    count: int
    scratch: Path
    sshd: object | None = None  # the SshdTest

    def __enter__(self) -> LoadHosts:
        from harness.fabric.builder import leftovers
        from harness.fabric.sshdtest import SshdTest, unavailable_reason

        if reason := unavailable_reason():
            raise BenchError(f"load hosts: {reason}")
        if left := leftovers(prefix=LOAD_PREFIX):
            raise BenchError(f"hosts with prefix {LOAD_PREFIX} are already up: {left} (python -m harness fabric down)")
        sshd = SshdTest(self.scratch / "load-sshd", hosts=self.count, prefix=LOAD_PREFIX, fabric_subnet=LOAD_FABRIC,
                        control_subnet=LOAD_CONTROL)
        self.sshd = sshd.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from harness.fabric.builder import leftovers

        workers = self.locust_pids() if self.sshd is not None else []  # each run ends its own: none expected
        if self.sshd is not None:
            self.sshd.__exit__(*exc)
        if left := leftovers(prefix=LOAD_PREFIX):
            raise BenchError(f"load hosts left behind: {left}")
        if workers:
            raise BenchError(f"Locust workers {workers} were still running on the load hosts after the last run")

    @property
    def gateway(self) -> str:
        return self.sshd.fabric.control_gateway_ip

    def entries(self) -> list[dict]:
        """The cluster file's ``load_hosts:``: each host by its own address and strict-host-key SSH."""
        ssh = {"user": "root", "key_file": str(self.sshd.key), "known_hosts": str(self.sshd.known_hosts),
               "connect_timeout_s": 10}
        return [{"name": name, "address": address, "ssh": ssh, "python": sys.executable,
                 "work_dir": str(self.scratch / "load-work")} for name, address, _ in self.sshd.endpoints()]

    def locust_pids(self) -> list[int]:
        """The Locust workers running on the hosts now (each a descendant of its host's sshd)."""
        return [pid for proc in self.sshd.sshds for pid in descendants(proc.pid)
                if any("locust" in a for a in cmdline(pid))]


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
        cpu0 = _self_cpu()
        with make_fault_runner(cluster, state_dir=state_dir) as runner:
            fan = fan_out(runner, cluster, plan, max_parallel=k)
            revert_fanout(runner, fan)
        cpu = _self_cpu() - cpu0
        records = load.wait()
    if len(fan.faults) != k:
        raise BenchError(f"the fan-out injected {len(fan.faults)} faults, {k} planned")
    migrated1 = migration_count(f"{api}/metrics", "dynamo")
    return {"processes": k, "workers_down": k * PER_PROCESS, "inject_s": fan.inject_s, "revert_s": fan.revert_s,
            "bench_cpu_s": cpu, "requests": len(records), "ok": sum(r.status == "ok" for r in records),
            "migrated": None if migrated0 is None or migrated1 is None else migrated1 - migrated0,
            "by_host": dict(sorted(Counter(r.load_host or "here" for r in records).items())),
            "counted": frontend_requests(api) - counted0}


def frontend_requests(api: str) -> float:
    """Requests the Dynamo frontend counted (``dynamo_frontend_requests_total``, every series)."""
    scraper = PrometheusScraper(f"{api}/metrics")
    try:
        return sum(s.value for s in scraper.scrape_once() if s.name == "dynamo_frontend_requests_total")
    finally:
        scraper.stop()


def verdicts(run_dir: Path) -> str:
    """The run's verdicts, one word each: ``6.2 pass, 6.1.4 fail, ...`` (the main items judged)."""
    return ", ".join(f"{v.item} {v.status.value}" for v in read_json(run_dir / "results.json").verdicts)


def records_by_host(run_dir: Path) -> dict[str, int]:
    """A harness run's request records per load host (``here``: sent from this machine)."""
    return dict(sorted(Counter(r.load_host or "here" for f in sorted(run_dir.glob("artifacts/*/requests*.jsonl"))
                               for r in iter_records(f)).items()))


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def registered_after(api: str, workers: int, timeout_s: float = 60.0) -> int:
    """Workers the frontend lists, waiting up to ``timeout_s`` for all of them: a killed process's
    registration expires in about 10 s, and a hang longer than that lease may leave a worker never
    registered again (docs/dynamo.md): a finding to print, not a reason to stop the bench."""
    deadline = time.monotonic() + timeout_s
    while (have := sum(registered(api).values())) != workers and time.monotonic() < deadline:
        time.sleep(1.0)  # discovery's own pace
    return have


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


# -- 5. SSH fan-out per host count -----------------------------------------------------------------------


def ssh_fanout(counts: list[int], scratch: Path, max_pool: int = MAX_PARALLEL) -> list[dict]:
    """``process_hang`` on all of the first N namespace hosts, each over its own sshd; then N=min serially."""
    from harness.fabric.builder import leftovers
    from harness.fabric.sshdtest import SshdTest, unavailable_reason

    if reason := unavailable_reason():
        raise BenchError(f"SSH fan-out: {reason}")
    if left := leftovers(prefix=SSH_PREFIX):
        raise BenchError(f"hosts with prefix {SSH_PREFIX} are already up: {left} (python -m harness fabric down)")
    rows: list[dict] = []
    sleepers: list[subprocess.Popen] = []
    t0 = time.monotonic()
    with SshdTest(scratch / "sshd", hosts=max(counts), prefix=SSH_PREFIX, fabric_subnet=SSH_FABRIC,
                  control_subnet=SSH_CONTROL) as hosts:
        setup_s = time.monotonic() - t0
        try:
            for name, _, _ in hosts.endpoints():  # `ip netns exec` execs: the pid is the sleeper's
                sleepers.append(subprocess.Popen(["ip", "netns", "exec", name, "sleep", "3600"]))
            for n, pool in [(n, min(n, max_pool)) for n in counts] + [(min(counts), 1)]:
                rows.append(_ssh_row(hosts, sleepers[:n], pool, scratch / f"ssh-{n}-{pool}") | {"setup_s": setup_s})
                if "error" in rows[-1]:  # a revert that failed left its sleeper stopped: the next row starts clean
                    for p in sleepers:
                        os.kill(p.pid, signal.SIGCONT)
        finally:
            for p in sleepers:
                p.kill()
                p.wait()
    if left := leftovers(prefix=SSH_PREFIX):
        raise BenchError(f"namespace hosts left behind: {left}")
    return rows


def _ssh_row(hosts, sleepers: list[subprocess.Popen], pool: int, folder: Path) -> dict:
    """One row: connect + `true` on every host, the hang fan-out, its revert; a fan-out that fails
    (a host's command timed out, say) is a measured outcome with its error, not the bench's end."""
    n = len(sleepers)
    cluster = _ssh_cluster(hosts, sleepers, folder)
    plan = plan_fanout(cluster, "process_hang", Selector.parse("all"))
    row: dict = {"hosts": n, "pool": pool}
    cpu0 = _self_cpu()
    try:
        with make_fault_runner(cluster, state_dir=folder / "state") as runner:
            t1 = time.monotonic()  # each host's SSH connection and one command, on the same pool
            with ThreadPoolExecutor(pool) as ex:
                list(ex.map(lambda h: runner.executor_factory(h.name).run(["true"], timeout=60), cluster.spec.hosts))
            row["connect_s"] = time.monotonic() - t1
            fan = fan_out(runner, cluster, plan, max_parallel=pool)
            stopped = sum(_state(p.pid) == "T" for p in sleepers)
            revert_fanout(runner, fan, max_parallel=pool)
    except HarnessError as exc:
        return row | {"error": str(exc), "bench_cpu_s": _self_cpu() - cpu0}
    if stopped != n or any(_state(p.pid) == "T" for p in sleepers):
        raise BenchError(f"{n} hosts: {stopped} sleepers were stopped, or some were not resumed")
    return row | {"inject_s": fan.inject_s, "revert_s": fan.revert_s, "bench_cpu_s": _self_cpu() - cpu0}


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _ssh_cluster(hosts, sleepers: list[subprocess.Popen], folder: Path) -> ClusterHandle:
    """A cluster file reaching each host only over SSH; its one worker per host is that host's sleeper."""
    data = hosts.pid_cluster_data(f"bench-ssh-{len(sleepers)}", [p.pid for p in sleepers], folder,
                                  api=f"http://{SSH_CONTROL.rsplit('.', 1)[0]}.254:19400", worker_port=19401)
    spec = parse_cluster(data, source=str(folder / "cluster.yaml"))
    return ClusterHandle(spec, spec.checklist(), spec.endpoints.api, None, None)


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
