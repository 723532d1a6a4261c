"""Acceptance of issue 28 item 2 over SSH: three namespace hosts, each with its own real sshd
(SshdTest, prefix ``pdb-``) and a victim process; the cluster file reaches them only over SSH. One
host's sshd is stopped, then ``all`` three are hung in one fan-out: the two reachable hosts are
hung (every command over SSH, audited), the third fails, the error names its worker, host and
address, and the two are resumed and verified, each ledger entry reverted. Nothing is left: no
namespace, no sshd, no victim."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from harness.cluster import ClusterHandle
from harness.clusterfile.load import parse_cluster
from harness.errors import FaultError
from harness.fabric.builder import leftovers
from harness.fabric.sshdtest import SshdTest, unavailable_reason
from harness.faults.fanout import fanned_out, inventory_fault, plan_fanout
from harness.faults.ledger import Ledger
from harness.faults.procstat import read_local
from harness.faults.selectors import Selector
from harness.fixtures import make_fault_runner
from tests.fabric.conftest import missing, require_fabric

pytestmark = [pytest.mark.root, pytest.mark.slow]
PREFIX, FABRIC_SUBNET, CONTROL_SUBNET = "pdb-", "198.18.41.0/24", "198.18.42.0/24"


def _cluster(hosts: SshdTest, tmp, victims: list[subprocess.Popen]) -> ClusterHandle:
    data = hosts.pid_cluster_data("fanout-ssh", [v.pid for v in victims], tmp, api="http://198.18.42.254:19210",
                                  worker_port=19211, connect_timeout_s=5)
    spec = parse_cluster(data, source=str(tmp / "fanout-ssh.yaml"))
    return ClusterHandle(spec, spec.checklist(), spec.endpoints.api, None, None)


def test_a_fan_out_whose_one_host_ssh_fails_reverts_the_rest_and_names_that_host(tmp_path):
    require_fabric()
    if reason := unavailable_reason():
        missing(reason)
    if leftovers(prefix=PREFIX):
        missing(f"hosts with prefix {PREFIX} are already up: {leftovers(prefix=PREFIX)}")
    victims: list[subprocess.Popen] = []
    with SshdTest(tmp_path / "hosts", hosts=3, prefix=PREFIX, fabric_subnet=FABRIC_SUBNET,
                  control_subnet=CONTROL_SUBNET) as hosts:
        try:
            for name, _, _ in hosts.endpoints():  # `ip netns exec` execs: the pid is the sleeper's
                victims.append(subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"]))
            cluster = _cluster(hosts, tmp_path, victims)
            broken = hosts.endpoints()[1][1]
            hosts.sshds[1].terminate()  # host h1's sshd is gone: its SSH is refused
            hosts.sshds[1].wait(timeout=30)
            plan = plan_fanout(cluster, "process_hang", Selector.parse("all"))
            barrier, default = threading.Barrier(3, timeout=60), inventory_fault("process_hang")

            def build(c, ex):
                barrier.wait()  # all three start before h1 fails: h0 and h2 are hung, then resumed
                return default(c, ex)

            runner = make_fault_runner(cluster, state_dir=tmp_path / "state")
            with runner:
                with pytest.raises(FaultError) as info:
                    with fanned_out(runner, cluster, plan, build=build):
                        pytest.fail("the block must not run when a host failed")
                assert not runner.active_faults
            message = str(info.value)
            assert "1 of 3 target(s) failed: w-1 on host h1" in message and f"cannot reach {broken}" in message
            assert "the 2 injected were reverted" in message
            assert [read_local(v.pid).state != "T" for v in victims] == [True, True, True]
            entries = Ledger.for_cluster("fanout-ssh", tmp_path / "state").entries()
            assert sorted((e["fault"]["worker_id"], e["status"], e["executor"]["kind"]) for e in entries) == [
                ("w-0", "reverted", "ssh"), ("w-2", "reverted", "ssh")]
            audit = [json.loads(line) for line in (tmp_path / "state" / "audit.jsonl").read_text().splitlines()]
            signals = {(e["host"], e["argv"][2]) for e in audit if e.get("argv") and e["argv"][0] == "kill"}
            reachable = {hosts.endpoints()[i][1] for i in (0, 2)}
            assert signals == {(h, s) for h in reachable for s in ("STOP", "CONT")}  # over SSH, h1 never signalled
            assert [e for e in audit if e["host"] == broken and e.get("error")]  # its failed command is audited too
        finally:
            for v in victims:
                v.kill()
                v.wait()
    assert leftovers(prefix=PREFIX) == []
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the test hosts remain: {left}"
