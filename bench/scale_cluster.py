"""What bench/bench_scale.py runs against: the many-worker NVIDIA Dynamo cluster (``launch many``,
mocker processes of ``PER_PROCESS`` workers each), the cluster file written for it
(``cluster_data``), the namespace load hosts of ``--load-hosts`` (``LoadHosts``), and what the
frontend says about itself (requests counted, workers registered). ``BenchError``: a figure that
could not be measured, raised by every part of the bench."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from clusters.dynamo.launch import FRONTEND_PORT, registered, worker_layout
from harness.probes.machine_health.procfs import cmdline, descendants
from harness.probes.metrics.prometheus import PrometheusScraper

ROOT = Path(__file__).resolve().parents[1]
PER_PROCESS = 8
FAULT_SHARE = 0.10
LOAD_PREFIX, LOAD_FABRIC, LOAD_CONTROL = "pdg-", "198.18.71.0/24", "198.18.72.0/24"  # --load-hosts
LOAD_MASTER_PORT = 19500  # the Locust master of a distributed run (its workers dial it on the gateway)
READY_TIMEOUT_S = 600.0


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


def frontend_requests(api: str) -> float:
    """Requests the Dynamo frontend counted (``dynamo_frontend_requests_total``, every series)."""
    scraper = PrometheusScraper(f"{api}/metrics")
    try:
        return sum(s.value for s in scraper.scrape_once() if s.name == "dynamo_frontend_requests_total")
    finally:
        scraper.stop()


def registered_after(api: str, workers: int, timeout_s: float = 60.0) -> int:
    """Workers the frontend lists, waiting up to ``timeout_s`` for all of them: a killed process's
    registration expires in about 10 s, and a hang longer than that lease may leave a worker never
    registered again (docs/dynamo.md): a finding to print, not a reason to stop the bench."""
    deadline = time.monotonic() + timeout_s
    while (have := sum(registered(api).values())) != workers and time.monotonic() < deadline:
        time.sleep(1.0)  # discovery's own pace
    return have
