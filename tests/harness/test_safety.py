"""The fault runner the `faults` fixture hands out refuses, before touching anything, every fault
the cluster's safety settings forbid; an allowed fault really runs. Target: a real child process."""

import pathlib
import subprocess

import pytest

from harness.cluster import ClusterHandle
from harness.clusterfile import load_cluster
from harness.errors import FaultError
from harness.faults import ProcessKill
from harness.fixtures import make_fault_runner

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # starts (and reaps) a real target process


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield {"id": "decode-9", "role": "decode", "pid": proc.pid}
    proc.kill()
    proc.wait()


def handle(name):
    spec = load_cluster(name)
    return ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", None, None)


def test_production_cluster_refuses_before_touching_the_target(tmp_path, sleeper):
    runner = make_fault_runner(handle("example-prod"), state_dir=tmp_path)
    with runner:
        with pytest.raises(FaultError, match="production.*safety.allowed_faults"):
            runner.inject(ProcessKill.from_worker(sleeper))
    assert runner.records == []  # nothing was attempted
    assert subprocess.run(["kill", "-0", str(sleeper["pid"])]).returncode == 0  # still alive


def test_allowed_fault_is_injected_and_recorded(tmp_path, sleeper):
    runner = make_fault_runner(handle("local"), state_dir=tmp_path)
    with runner:
        runner.inject(ProcessKill.from_worker(sleeper))
    actions = [(r.action.value, r.status.value) for r in runner.records]
    assert actions[:2] == [("inject", "succeeded"), ("verify", "succeeded")]
    assert ("revert", "succeeded") in actions


def test_dry_run_plans_without_signalling(tmp_path, sleeper, capsys):
    runner = make_fault_runner(handle("local"), dry_run=True, state_dir=tmp_path)
    with runner:
        runner.inject(ProcessKill.from_worker(sleeper))
    assert "[dry-run] process_kill" in capsys.readouterr().out
    assert subprocess.run(["kill", "-0", str(sleeper["pid"])]).returncode == 0


def test_a_host_named_box_at_127_0_0_1_without_ssh_runs_its_faults_locally(tmp_path, sleeper):
    """Issue 37: a cluster file written from docs/clusters.md names its host `box` (address
    127.0.0.1, no `ssh:`); the kill of a worker on it is sent on this machine (the target really
    dies), not refused with "no SSH settings for host 'box'". Planted defect: make_fault_runner's
    executors deciding "this machine" by the host's name (the old rule): exit 3 with that error."""
    text = (ROOT / "clusters" / "up-foreign.yaml").read_text().replace("host: localhost", "host: box")
    text = text.replace("hosts: [{name: localhost,", "hosts: [{name: box,")
    path = tmp_path / "box.yaml"
    path.write_text(text)
    spec = load_cluster(str(path))
    cluster = ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", None, None)
    assert cluster.this_machine("box") and cluster.this_machine("127.0.0.1") and not cluster.this_machine("gpu-7")
    runner = make_fault_runner(cluster, state_dir=tmp_path)
    with runner:
        runner.inject(ProcessKill.from_worker({**sleeper, "host": "box"}))
    actions = [(r.action.value, r.status.value) for r in runner.records]
    assert actions[:2] == [("inject", "succeeded"), ("verify", "succeeded")], actions
    stat = pathlib.Path(f"/proc/{sleeper['pid']}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"   # really killed, here
