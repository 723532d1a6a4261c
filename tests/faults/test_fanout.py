"""Faults fanned out on this machine's real processes (a cluster file whose workers are sleeping
processes found by pid file): a selector's targets are hung in parallel, each verified stopped with
its own ledger entry, all resumed; a target that fails makes the runner revert the others and name
it; a blast-radius refusal and a dry run touch nothing; ``python -m harness fault`` does the same."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from harness.cluster import ClusterHandle
from harness.clusterfile.load import parse_cluster
from harness.errors import FaultError
from harness.faults.fanout import fanned_out, inventory_fault, plan_fanout
from harness.faults.ledger import Ledger
from harness.faults.procstat import read_local
from harness.faults.selectors import Selector
from harness.fixtures import make_fault_runner

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 6


@pytest.fixture
def local_cluster(tmp_path):
    """A cluster file of 6 decode workers, each a real sleeping process named by its pid file."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) for _ in range(WORKERS)]
    workers = []
    for i, p in enumerate(procs):
        (tmp_path / f"w-{i}.pid").write_text(f"{p.pid}\n")
        workers.append({"name": f"w-{i}", "role": "decode", "host": "localhost", "api": "http://127.0.0.1:19209",
                        "process": {"pid_file": str(tmp_path / f"w-{i}.pid")}})
    data = {"version": 2, "name": "fanout-local", "kind": "external", "endpoints": {"api": "http://127.0.0.1:19209"},
            "hosts": [{"name": "localhost", "address": "127.0.0.1", "roles": ["decode"]}], "workers": workers,
            "safety": {"production": False, "allowed_faults": ["process_hang"],
                       "blast_radius": {"max_role_share_down": 0.5}}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(data))
    spec = parse_cluster(data, source=str(tmp_path / "cluster.yaml"))
    try:
        yield ClusterHandle(spec, spec.checklist(), spec.endpoints.api, None, None), procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _state(p: subprocess.Popen) -> str:
    return read_local(p.pid).state


def _audit(tmp_path: Path) -> list[dict]:
    path = tmp_path / "state" / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_percentage_is_hung_in_parallel_each_with_its_own_ledger_entry_and_all_resumed(local_cluster, tmp_path):
    cluster, procs = local_cluster
    plan = plan_fanout(cluster, "process_hang", Selector.parse("percent:50", roles=["decode"]), seed=3)
    chosen = {int(c.name.split("-")[1]) for c in plan.targets}
    assert len(chosen) == 3
    # every builder waits for the others: the fan-out only gets past this if all 3 run at once
    barrier, default = threading.Barrier(3, timeout=60), inventory_fault("process_hang")

    def build(c, ex):
        barrier.wait()
        return default(c, ex)

    runner = make_fault_runner(cluster, state_dir=tmp_path / "state")
    with runner:
        with fanned_out(runner, cluster, plan, max_parallel=3, build=build) as fan:
            assert [_state(p) for i, p in enumerate(procs) if i in chosen] == ["T"] * 3
            assert all(_state(p) != "T" for i, p in enumerate(procs) if i not in chosen)
            assert len(fan.faults) == 3 and {f.worker_id for f in fan.faults} == {f"w-{i}" for i in chosen}
        assert fan.revert_s is not None and not runner.active_faults
    assert all(_state(p) != "T" for p in procs)
    entries = Ledger.for_cluster("fanout-local", tmp_path / "state").entries()
    assert sorted(e["fault"]["worker_id"] for e in entries) == sorted(f"w-{i}" for i in chosen)
    assert {e["status"] for e in entries} == {"reverted"}
    stops = [e["argv"] for e in _audit(tmp_path) if e.get("argv") and e["argv"][:3] == ["kill", "-s", "STOP"]]
    assert sorted(int(a[3]) for a in stops) == sorted(procs[i].pid for i in chosen)


def test_a_target_that_fails_gets_the_others_reverted_and_is_named(local_cluster, tmp_path):
    cluster, procs = local_cluster
    procs[4].kill()
    procs[4].wait()  # w-4's pid file now names a process that is gone: its injection fails
    plan = plan_fanout(cluster, "process_hang", Selector.parse("fixed:3", names=["w-1", "w-3", "w-4"]))
    barrier, default = threading.Barrier(3, timeout=60), inventory_fault("process_hang")

    def build(c, ex):
        barrier.wait()  # all three start before any fails: the others are injected, then reverted
        return default(c, ex)

    runner = make_fault_runner(cluster, state_dir=tmp_path / "state")
    with runner:
        with pytest.raises(FaultError, match="1 of 3 target.s. failed: w-4 on host localhost") as info:
            with fanned_out(runner, cluster, plan, build=build):
                pytest.fail("the block must not run when a target failed")
        assert "the 2 injected were reverted" in str(info.value)
        assert not runner.active_faults
    assert _state(procs[1]) != "T" and _state(procs[3]) != "T"
    entries = Ledger.for_cluster("fanout-local", tmp_path / "state").entries()
    assert sorted((e["fault"]["worker_id"], e["status"]) for e in entries) == [("w-1", "reverted"),
                                                                              ("w-3", "reverted")]
    conts = {int(e["argv"][3]) for e in _audit(tmp_path) if e.get("argv") and e["argv"][:3] == ["kill", "-s", "CONT"]}
    assert conts == {procs[1].pid, procs[3].pid}


def test_a_blast_radius_or_safety_refusal_touches_nothing(local_cluster, tmp_path):
    cluster, procs = local_cluster
    with pytest.raises(FaultError, match="4 of 6 decode worker.s. down at once .0 already faulted., limit 3"):
        plan_fanout(cluster, "process_hang", Selector.parse("fixed:4"))
    with pytest.raises(FaultError, match="not allowed on cluster 'fanout-local'"):
        plan_fanout(cluster, "process_kill", Selector.parse("one"))
    runner = make_fault_runner(cluster, state_dir=tmp_path / "state")
    with runner:
        with fanned_out(runner, cluster, plan_fanout(cluster, "process_hang", Selector.parse("fixed:2"), seed=1)):
            held = list(runner.active_faults)
            free = sorted({f"w-{i}" for i in range(WORKERS)} - {f.worker_id for f in held})
            # two held: one more fits the 0.5 limit (3 of 6), two more do not
            plan_fanout(cluster, "process_hang", Selector.parse("fixed:1", names=free[:1]), active_faults=held)
            with pytest.raises(FaultError, match="4 of 6 decode worker.s. down at once .2 already faulted."):
                plan_fanout(cluster, "process_hang", Selector.parse("fixed:2", names=free[:2]), active_faults=held)
            with pytest.raises(FaultError, match="already faulted"):
                plan_fanout(cluster, "process_hang", Selector.parse("all"), active_faults=held)
    assert all(_state(p) != "T" for p in procs)
    assert {e["argv"][2] for e in _audit(tmp_path) if e.get("argv") and e["argv"][0] == "kill"} == {"STOP", "CONT"}


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "fault", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_the_cli_dry_run_prints_the_targets_and_contacts_nothing_then_a_real_run_reverts_all(local_cluster, tmp_path):
    _, procs = local_cluster
    cluster_file = tmp_path / "cluster.yaml"
    dry = _cli("--cluster", str(cluster_file), "--kind", "process_hang", "--select", "percent:50", "--role", "decode",
               "--dry-run", "--state-dir", str(tmp_path / "state"), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "[dry-run] selector fixed-percent:50 role=decode (seed 0): 3 of 6 matching target(s)" in dry.stdout
    assert dry.stdout.count("[dry-run]   target w-") == 3 and "limit 3" in dry.stdout
    assert not (tmp_path / "state").exists() and all(_state(p) != "T" for p in procs)
    refused = _cli("--cluster", str(cluster_file), "--kind", "process_hang", "--select", "all", "--dry-run",
                   cwd=tmp_path)
    assert refused.returncode == 3 and "blast radius: REFUSED" in refused.stdout
    real = _cli("--cluster", str(cluster_file), "--kind", "process_hang", "--select", "fixed:2", "--hold", "0",
                "--state-dir", str(tmp_path / "state"), cwd=tmp_path)
    assert real.returncode == 0, real.stdout + real.stderr
    assert "injected and verified process_hang on 2 target(s)" in real.stdout
    assert "reverted and verified 2 target(s)" in real.stdout
    assert all(_state(p) != "T" for p in procs)
    entries = Ledger.for_cluster("fanout-local", tmp_path / "state").entries()
    assert len(entries) == 2 and {e["status"] for e in entries} == {"reverted"}
