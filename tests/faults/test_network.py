"""NIC flapping and PFC storms on a real emulated fabric, through the FaultRunner."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.errors import ConfigError, FaultError
from harness.fabric.builder import link_sizes, link_state
from harness.fabric.shaping import LOSSLESS_CLASS, PAUSE_RATE_BPS, read_classes
from harness.faults import Fault, FaultRunner, Ledger, NicFlap, PfcStorm
from harness.hosts import LocalExecutor

from tests.fabric.conftest import make_fabric  # noqa: F401  (fixture)

pytestmark = [pytest.mark.root]


def test_bad_parameters_are_refused():
    with pytest.raises(ConfigError, match="duty"):
        NicFlap(device="fab0", duty=1.0)
    with pytest.raises(ConfigError, match="count"):
        NicFlap(device="fab0", count=0)
    with pytest.raises(ConfigError, match="needs"):
        PfcStorm(nics=[])
    with pytest.raises(ConfigError, match="gap_ms"):
        PfcStorm(nics=[[None, "fab0"]], group=4, gap_ms=10, resume_ms=100)   # a gap shorter than a resume
    with pytest.raises(ConfigError, match="group"):
        PfcStorm(nics=[[None, "fab0"]], group=-1)


def test_plans_name_the_exact_commands():
    flap = NicFlap(device="fab0", netns="pdh-h1", period_s=1, count=2)
    plan = "\n".join(flap.plan())
    assert "ip -n pdh-h1 link set dev fab0 down" in plan and "ip -n pdh-h1 link set dev fab0 up" in plan
    assert "remote hosts only" in plan  # the on-host safety timer
    rebuilt = Fault.from_ledger(flap.to_ledger())
    assert isinstance(rebuilt, NicFlap) and rebuilt.plan() == flap.plan()


@pytest.mark.slow
def test_nic_flap_goes_down_and_up_count_times_and_reverts(make_fabric, tmp_path):
    fabric = make_fabric(hosts=2)
    host = fabric.hosts[1]
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        flap = runner.inject(NicFlap.on_fabric_host(host, period_s=0.4, duty=0.5, count=3))
        transitions = flap.wait_done(LocalExecutor())
        assert [w for w, _ in transitions] == ["on", "off"] * 3
        runner.revert(flap)
    verify = next(r for r in runner.records if r.action.value == "verify")
    assert "operstate" in verify.output and "UP" not in verify.output.split("operstate")[1].split()[0]
    assert link_state(LocalExecutor(), host.fabric_dev, host.netns) == "UP"


CRASHING_HARNESS = """
import sys, time
from harness.faults import FaultRunner, Ledger, NicFlap
runner = FaultRunner(Ledger.for_cluster("fabric-test", sys.argv[1]), handle_signals=False)
runner.inject(NicFlap(device="fab0", netns=sys.argv[2], period_s=1.0, duty=0.9, count=100))
print("injected", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_flap_left_by_a_sigkilled_run_is_reverted_from_the_ledger(make_fabric, tmp_path):
    fabric = make_fabric(hosts=2)
    host = fabric.hosts[1]
    harness = subprocess.Popen([sys.executable, "-c", CRASHING_HARNESS, str(tmp_path), host.netns],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout.readline() == "injected\n"
    finally:
        harness.kill()  # SIGKILL: no revert runs in the harness; its flap loop keeps going on the host
        harness.wait()
        harness.stdout.close()
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as fresh:
        pass  # entering recovers what the dead run left
    assert [r.action.value for r in fresh.records] == ["revert", "verify_reverted"]
    assert all(r.status.value == "succeeded" for r in fresh.records)
    assert link_state(LocalExecutor(), host.fabric_dev, host.netns) == "UP"


@pytest.mark.slow
def test_pfc_storm_pauses_the_lossless_class_and_restores_it(make_fabric, tmp_path):
    fabric = make_fabric(hosts=2, line_rate_bps=8e8)
    hosts = fabric.hosts
    ex = LocalExecutor()
    before = {h.netns: read_classes(ex, h.fabric_dev, h.netns)[LOSSLESS_CLASS] for h in hosts}
    gso_before = {h.netns: link_sizes(ex, h.fabric_dev, h.netns)[1] for h in hosts}
    assert set(gso_before.values()) != {9000}   # the fabric's own setting (the kernel default, 64 KB)
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        storm = runner.inject(PfcStorm.on_fabric_hosts(hosts, pause_ms=200, resume_ms=50, bursts=4))
        assert storm.running()  # a sample taken now is "during" the storm (6.1.5 checks this after each)
        # one MTU per queued packet while the storm lasts (a 64 KB offload packet at the pause rate
        # would block the class for seconds after each resume); the revert below puts it back
        assert {link_sizes(ex, h.fabric_dev, h.netns)[1] for h in hosts} == {9000}
        assert all(saved[0] == 4e8 for saved in storm.saved.values())
        paused = [w for w, _ in storm.wait_done(LocalExecutor())]
        assert paused == ["on", "off"] * 4
        assert not storm.running()  # every burst done: the lossless class runs at its rate again
    for h in hosts:
        assert link_sizes(ex, h.fabric_dev, h.netns)[1] == gso_before[h.netns]
        now = read_classes(ex, h.fabric_dev, h.netns)[LOSSLESS_CLASS]
        assert (now.rate_bps, now.ceil_bps) == (before[h.netns].rate_bps, before[h.netns].ceil_bps)
    verify = next(r for r in runner.records if r.action.value == "verify")
    assert "seen paused on 2 NIC(s)" in verify.output
    assert PAUSE_RATE_BPS < 4e8


@pytest.mark.slow
def test_a_grouped_storm_pauses_in_groups_with_calm_gaps_between(make_fabric, tmp_path):
    fabric = make_fabric(hosts=2, line_rate_bps=8e8)
    ex = LocalExecutor()
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        storm = runner.inject(PfcStorm.on_fabric_hosts(fabric.hosts[:1], pause_ms=100, resume_ms=50, bursts=6,
                                                       group=3, gap_ms=800))
        deadline = time.monotonic() + 2
        while not (under_way := storm.spans(ex)) and time.monotonic() < deadline:
            time.sleep(0.02)   # the loop logs its first pause just after making it
        assert under_way[-1][1] == float("inf")   # the first group is under way: no end yet
        changes = storm.wait_done(ex)
        assert [w for w, _ in changes] == ["on", "off"] * 6
        spans = storm.spans(ex)
    assert len(spans) == 2 and all(end - start >= 0.25 for start, end in spans)   # 3 x 100 ms paused at least
    gap = spans[1][0] - spans[0][1]
    assert 0.75 <= gap < 2.0, spans   # the calm gap, not the 50 ms resume
    inside = [t for w, t in changes if spans[0][0] <= t <= spans[0][1]]
    assert len(inside) == 6   # the first group holds its 3 pauses and 3 resumes


@pytest.mark.slow
def test_pfc_storm_on_an_unshaped_nic_fails_before_touching_it(make_fabric, tmp_path):
    fabric = make_fabric(hosts=1)
    host = fabric.hosts[0]
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        with pytest.raises(FaultError, match="has no class 1:10"):
            runner.inject(PfcStorm(nics=[[host.netns, host.control_dev]]))


def test_without_root_the_faults_say_they_need_root_and_iproute2(tmp_path, monkeypatch):
    import harness.faults.network as network

    # this machine may well be root: stand in for one that is not, at the one place the check reads it
    monkeypatch.setattr(network, "fabric_unavailable_reason",
                        lambda: "skipped: needs root and iproute2 (not running as root)")
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        for fault in (NicFlap(device="fab0", netns="pdt-none"), PfcStorm(nics=[["pdt-none", "fab0"]])):
            with pytest.raises(FaultError, match="skipped: needs root and iproute2"):
                runner.inject(fault)
    assert not runner.records  # refused in prepare: nothing was recorded as injected


@pytest.mark.slow
def test_reverting_after_the_fabric_was_torn_down_is_not_a_failed_revert(make_fabric, tmp_path):
    fabric = make_fabric(hosts=1)
    host = fabric.hosts[0]
    ledger = Ledger.for_cluster("fabric-test", tmp_path)
    runner = FaultRunner(ledger, handle_signals=False, recover_on_enter=False)
    storm = runner.inject(PfcStorm.on_fabric_hosts([host], pause_ms=100, resume_ms=100, bursts=3))
    flap = runner.inject(NicFlap.on_fabric_host(host, period_s=0.2, duty=0.5, count=2))
    flap.wait_done(LocalExecutor())
    storm.wait_done(LocalExecutor())
    fabric.teardown()  # e.g. the cluster went down before `harness revert` ran
    runner.revert_all()  # no RevertError: nothing is left to restore
    outputs = [r.output for r in runner.records if r.action.value in ("revert", "verify_reverted")]
    assert any("gone" in o for o in outputs) and len(outputs) == 4
