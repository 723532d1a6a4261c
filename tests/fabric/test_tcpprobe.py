"""The TCP-class probe through a PFC storm on a real fabric: isolated when the classes are right,
stalled when TCP traffic is put into the lossless class (the sabotage item 5 must catch)."""

from __future__ import annotations

import pytest

from harness.checklists import Checklist
from harness.checks.verdict import Status
from harness.errors import ConfigError
from harness.fabric.bandwidth import LosslessFlood, Station
from harness.fabric.tcpprobe import sample_tcp_class
from harness.checks.fabric import ITEM_PFC_ISOLATION, pfc_isolation_verdict
from harness.faults import FaultRunner, Ledger, PfcStorm

pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_probe_refuses_lossless_ports():
    a = Station(("true",), "198.18.1.1", "a")
    with pytest.raises(ConfigError, match="lossless-class ports"):
        sample_tcp_class(a, a, label="x", port=7471, lossless_ports=(7471, 7472))


def _storm_run(fabric, tmp_path):
    client, server = Station.of(fabric.hosts[0]), Station.of(fabric.hosts[1])
    ports = fabric.config.shaping.lossless_ports
    # as the suite samples: ~600 round trips (a p99 bounded at 97.5 %) and 8 bulk flows (a bootstrap of their median)
    kw = {"rr_seconds": 3.0, "bulk_seconds": 0.5, "bulk_repeats": 8, "lossless_ports": ports}
    # a UDP flood keeps the lossless queue full in both windows, as the suite's does: a paused class
    # still passes one MTU per 10 ms (htb cannot hold it at zero without blocking its resumes), so
    # a TCP round trip in that class waits only when the queue ahead of it is full
    flood = {"port": fabric.config.bench_port, "datagram_bytes": fabric.config.shaping.mtu - 28}
    with LosslessFlood(client, Station.of(fabric.hosts[2]), **flood):
        before = sample_tcp_class(client, server, label="before", **kw)
    with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
        storm = runner.inject(PfcStorm.on_fabric_hosts([fabric.hosts[0]], pause_ms=300, resume_ms=100, bursts=60))
        with LosslessFlood(client, Station.of(fabric.hosts[2]), **flood) as during_flood:
            during = sample_tcp_class(client, server, label="during", **kw)
        runner.revert(storm)
    assert during_flood.result["bytes"] > 0, during_flood.result   # the flood ran, held by the pauses
    after = sample_tcp_class(client, server, label="after", **kw)
    # Margin for a loaded 2-core machine: the flood in the lossless class competes with the probe for
    # CPU, which adds a millisecond or two of jitter to sub-millisecond round trips. The shipped 1.5x
    # stays in checklists/section6.yaml for the suite; here a broken isolation (TCP in the paused
    # class) still fails by two orders of magnitude (round trips wait out 300 ms pauses).
    checklist = Checklist.load().with_overrides({ITEM_PFC_ISOLATION: {"tcp_p99_latency_ratio": 5.0}},
                                                origin="tests/fabric/test_tcpprobe.py (CPU-noise margin)")
    return pfc_isolation_verdict(checklist, before, during, after, {"target": storm.target})


def test_tcp_class_keeps_latency_and_throughput_through_a_storm(make_fabric, tmp_path):
    verdict = _storm_run(make_fabric(hosts=3, line_rate_bps=5e8), tmp_path)
    assert verdict.status == Status.PASS, verdict.reason


def test_tcp_traffic_in_the_lossless_class_fails_isolation(make_fabric, tmp_path):
    verdict = _storm_run(make_fabric(hosts=3, line_rate_bps=5e8, tcp_in_lossless=True), tmp_path)
    assert verdict.status == Status.FAIL, verdict.reason
    during = verdict.evidence["samples"][1]
    assert during["rtt_p99_ms"] >= 100  # round trips waited out pauses of 300 ms
