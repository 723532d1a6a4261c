"""Acceptance of issue 28 item 2 on the 128-worker Dynamo cluster (clusters/dynamo-many.yaml: 16
mocker processes of 8 workers, supervised by the launcher): ``percent:25`` of the 16 processes is
exactly 4, all 4 are SIGKILLed in parallel (each builder waits for the other three at a barrier, so
they cannot have run one after another), each verified dead, each with its own ledger entry; the
revert waits until each is a new process answering its /health, and the frontend lists 128 workers
again. The other 12 processes are never touched, the ledger is clean.

Its own cluster (tests/realengine/pool.py): the only module on the 128-worker cluster."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from clusters.dynamo.launch import registered
from harness.cluster import ClusterHandle
from harness.clusterfile import load_cluster
from harness.errors import FaultError
from harness.faults.fanout import fan_out, inventory_fault, plan_fanout, revert_fanout
from harness.faults.ledger import Ledger
from harness.faults.procstat import read_local
from harness.faults.selectors import Selector
from harness.fixtures import make_fault_runner
from harness.waiting import wait_until
from tests.realengine.conftest import healthy

DYNAMO_MODE = "many"
pytestmark = pytest.mark.slow


def _pids(spec) -> dict[str, int]:
    return {w.name: int(Path(w.process.pid_file).read_text()) for w in spec.workers}


def test_a_percentage_of_the_128_worker_cluster_is_killed_in_parallel_and_all_come_back(dynamo_cluster, tmp_path):
    spec = load_cluster("dynamo-many")
    api = dynamo_cluster.api
    assert sum(registered(api).values()) == 128
    cluster = ClusterHandle(spec, spec.checklist(), api, None, None)
    before = _pids(spec)
    plan = plan_fanout(cluster, "process_kill", Selector.parse("percent:25", roles=["aggregated"]), seed=11)
    assert len(plan.targets) == 4  # 25 % of 16 processes: 32 of the 128 workers
    with pytest.raises(FaultError, match="5 of 16 aggregated"):  # the file's blast radius: 0.25
        plan_fanout(cluster, "process_kill", Selector.parse("fixed:5"))
    barrier, default = threading.Barrier(4, timeout=60), inventory_fault("process_kill")

    def build(c, ex):
        barrier.wait()
        return default(c, ex)

    state = tmp_path / "state"
    runner = make_fault_runner(cluster, state_dir=state)
    with runner:
        fan = fan_out(runner, cluster, plan, max_parallel=4, build=build)
        killed = {f.worker_id: f.pid for f in fan.faults}
        assert killed == {c.name: before[c.name] for c in plan.targets}
        # verified dead: gone, or a zombie its supervisor has not reaped yet
        assert not [pid for pid in killed.values() if (st := read_local(pid)) is not None and st.alive]
        kills = [r for r in runner.records if r.action.value == "inject"]
        assert len(kills) == 4 and all(r.status.value == "succeeded" for r in kills)
        revert_fanout(runner, fan)
    after = _pids(spec)
    assert all(after[n] != before[n] for n in killed), (before, after)  # each back as a new process
    assert all(after[n] == before[n] for n in before if n not in killed)  # the other 12 untouched
    assert all(healthy(w.health) for w in spec.workers)
    entries = Ledger.for_cluster(spec.name, state).entries()
    assert sorted(e["fault"]["worker_id"] for e in entries) == sorted(killed)
    assert {e["status"] for e in entries} == {"reverted"}
    # the dead instances' registrations expire (about 10 s); the restarted ones register: 128 again
    assert wait_until(lambda: sum(registered(api).values()) == 128, 90, 1.0, what="128 registered workers",
                      on_timeout="return"), registered(api)
    print(f"fan-out: 4 processes (32 workers) killed and verified in {fan.inject_s:.2f} s, "
          f"reverted (new process healthy) in {fan.revert_s:.2f} s")
