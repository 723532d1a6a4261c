"""The fault runner the `faults` fixture hands out refuses, before touching anything, every fault
the cluster's safety settings forbid; an allowed fault really runs. Target: a real child process."""

import subprocess

import pytest

from harness.cluster import ClusterHandle
from harness.clusterfile import load_cluster
from harness.errors import FaultError
from harness.faults import ProcessKill
from harness.fixtures import make_fault_runner

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
