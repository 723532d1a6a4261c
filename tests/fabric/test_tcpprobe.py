"""The TCP-class probe through a PFC storm on a real fabric: isolated when the classes are right,
stalled when TCP traffic is put into the lossless class (the sabotage item 5 must catch)."""

from __future__ import annotations

import pytest

from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.errors import ConfigError
from harness.checks.extend import repeat_until_decided
from harness.fabric.bandwidth import Station
from harness.fabric.tcpprobe import check_probe_ports, sample_tcp_class
from harness.checks.fabric import ITEM_PFC_ISOLATION, pfc_isolation_verdict
from harness.faults import FaultRunner, Ledger, PfcStorm
from harness.scenarios.pfc_isolation import GAP_MS, GROUP, PAUSE_MS, RESUME_MS, InterleavedStorm, storm_bursts

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_probe_refuses_lossless_ports():
    a = Station(("true",), "198.18.1.1", "a")
    with pytest.raises(ConfigError, match="lossless-class ports"):
        sample_tcp_class(a, a, label="x", port=7471, lossless_ports=(7471, 7472))


def _storm_run(fabric, tmp_path):
    """6.1.5's measurement (harness/scenarios/pfc_isolation.py): storm groups and calm gaps
    interleaved under one lossless flood, judged on the calm side against the storm side, extended
    while undecided (at most 4 rounds). A baseline taken before the storm is not comparable: this
    machine's p99 drifts over minutes (CI once read 3.8 ms before and 10.1 ms during on a fabric that isolates)."""
    client, server = Station.of(fabric.hosts[0]), Station.of(fabric.hosts[1])
    ports = fabric.config.shaping.lossless_ports
    most = 4
    storm = PfcStorm.on_fabric_hosts([fabric.hosts[0]], pause_ms=PAUSE_MS, resume_ms=RESUME_MS,
                                     bursts=storm_bursts(most), group=GROUP, gap_ms=GAP_MS)
    # Margin for a loaded 2-core machine: the flood in the lossless class competes with the probe for
    # CPU, which adds a millisecond or two of jitter to sub-millisecond round trips. The shipped 1.5x
    # stays in checklists/section6.yaml for the suite; here a broken isolation (TCP in the paused
    # class) still fails by two orders of magnitude (round trips wait out 300 ms pauses).
    checklist = Checklist.load().with_overrides({ITEM_PFC_ISOLATION: {"tcp_p99_latency_ratio": 5.0}},
                                                origin="tests/fabric/test_tcpprobe.py (CPU-noise margin)")
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        runner.inject(storm)
        ex = runner.executor_factory(storm.host)
        run = InterleavedStorm(storm, ex, client, server, client, Station.of(fabric.hosts[2]),
                               fabric.config.bench_port, fabric.config.shaping.mtu - 28)
        check_probe_ports(run.probe_port, ports)

        def judged():
            calm, during = run.sides()
            assert run.rounds and calm.round_trips and during.round_trips, run.evidence()
            return [pfc_isolation_verdict(checklist, calm, during, None, run.evidence())]

        (verdict,) = repeat_until_decided(judged, run.more, lambda: len(run.rounds), first=1, most=most,
                                          noun="rounds")
        runner.revert(storm)
    assert not run.ended_under, run.evidence()   # the storm was sized to outlast every round
    assert all(f["bytes"] > 0 for f in run.floods), run.floods   # the flood ran, held by the pauses
    return verdict


def test_tcp_class_keeps_latency_and_throughput_through_a_storm(make_fabric, tmp_path):
    verdict = _storm_run(make_fabric(hosts=3, line_rate_bps=5e8), tmp_path)
    assert verdict.status == Status.PASS, verdict.reason


def test_tcp_traffic_in_the_lossless_class_fails_isolation(make_fabric, tmp_path):
    verdict = _storm_run(make_fabric(hosts=3, line_rate_bps=5e8, tcp_in_lossless=True), tmp_path)
    assert verdict.status == Status.FAIL, verdict.reason
    during = verdict.evidence["samples"][1]
    assert during["rtt_p99_ms"] >= 100  # round trips waited out pauses of 300 ms
