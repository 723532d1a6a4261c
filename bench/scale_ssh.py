"""Item 5 of bench/bench_scale.py, the SSH fan-out on its own (``ssh_fanout``): namespace hosts, each
with its own real sshd (``SshdTest``, prefix ``pde-``) and a sleeper; per host count, each host's SSH
connection and a ``true``, then ``process_hang`` on all of them and the parallel revert, every command
over SSH (a fresh fault runner each row), and the smallest count again with a pool of 1 as the
serial baseline. A row whose fan-out fails is returned with its error (a measured outcome)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.scale_cluster import BenchError
from bench.scale_harness import self_cpu
from harness.cluster import ClusterHandle
from harness.clusterfile.load import parse_cluster
from harness.errors import HarnessError
from harness.faults.fanout import MAX_PARALLEL, fan_out, plan_fanout, revert_fanout
from harness.faults.selectors import Selector
from harness.fixtures import make_fault_runner

SSH_PREFIX, SSH_FABRIC, SSH_CONTROL = "pde-", "198.18.61.0/24", "198.18.62.0/24"


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
    cpu0 = self_cpu()
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
        return row | {"error": str(exc), "bench_cpu_s": self_cpu() - cpu0}
    if stopped != n or any(_state(p.pid) == "T" for p in sleepers):
        raise BenchError(f"{n} hosts: {stopped} sleepers were stopped, or some were not resumed")
    return row | {"inject_s": fan.inject_s, "revert_s": fan.revert_s, "bench_cpu_s": self_cpu() - cpu0}


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def _ssh_cluster(hosts, sleepers: list[subprocess.Popen], folder: Path) -> ClusterHandle:
    """A cluster file reaching each host only over SSH; its one worker per host is that host's sleeper."""
    data = hosts.pid_cluster_data(f"bench-ssh-{len(sleepers)}", [p.pid for p in sleepers], folder,
                                  api=f"http://{SSH_CONTROL.rsplit('.', 1)[0]}.254:19400", worker_port=19401)
    spec = parse_cluster(data, source=str(folder / "cluster.yaml"))
    return ClusterHandle(spec, spec.checklist(), spec.endpoints.api, None, None)
