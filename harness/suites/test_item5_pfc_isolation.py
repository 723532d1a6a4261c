"""Checklist item 6.1.5 (Section 6.1, "PFC Storm 隔离：在 RDMA fabric 上制造拥塞，验证不扩散到 TCP/IP 流量").

On the bundled cluster's emulated fabric, the prefill host's fabric NIC carries both classes.
Sample the TCP/IP class (paced round trips, then a bulk flow, prefill host -> decode host on TCP
ports) before, during and after a PFC storm on that NIC's lossless class: pause bursts (300 ms
paused, 100 ms running) while a bulk flow floods the lossless class so its queue stays full.
The TCP class must keep its p99 latency and throughput (thresholds in checklists/section6.yaml),
judged on 95 % intervals: the ratio of the windows' p99 round trips and the ratio of their median
bulk flows (BULK_REPEATS flows each). A ratio that straddles its limit takes another sample during
the storm, up to the checklist's ``max_repeats``. A cluster whose TCP traffic shares the lossless
class (``fabric.tcp_in_lossless``) fails here.

On an external cluster with ``ssh:`` + ``fabric:`` hosts the same storm runs over SSH only: the
prefill host's ``fabric.lossless_class`` (a tc class) is paused in bursts by the PfcStorm fault
on that host while the probe ends (``python3`` there) flood the lossless port towards a second
decode host and sample the TCP class towards the first.
"""

from __future__ import annotations

import functools
import threading

import pytest

from harness.checks.extend import repeat_until_decided
from harness.checks.fabric import ITEM_PFC_ISOLATION, pfc_isolation_verdict, placement_or_skip, skipped
from harness.fabric.remote import ssh_nodes
from harness.cluster import ClusterHandle
from harness.fabric.bandwidth import Station, measure_bulk
from harness.fabric.tcpprobe import TcpClassSample, sample_tcp_class
from harness.checks.verdict import inconclusive
from harness.faults import FaultRunner, PfcStorm
from harness.fixtures import Conformance
from harness.plugin_state import HarnessOptions

pytestmark = [pytest.mark.conformance, pytest.mark.item("6.1.5"), pytest.mark.slow]

RR_S = 3.0                      # paced round trips, one per 5 ms: ~600, enough for a p99 bounded at 97.5 %
BULK_S, BULK_REPEATS = 0.5, 8    # bulk flows per sample: a bootstrap of their median needs 8
FLOOD_S = RR_S + BULK_REPEATS * (BULK_S + 0.5) + 4   # the lossless flood outlasts one sample's probes
BEFORE_FACTOR = 8               # the baseline's round trips: 8 x RR_S (~4800, as many as the most during samples)
PAUSE_MS, RESUME_MS = 300.0, 100.0
FLOOD_JOIN_S = 60.0             # a flood stuck behind the paused queue is waited for this long
SAMPLE_S = RR_S + FLOOD_JOIN_S + 5   # the most one "during" sample takes: its probes, then the flood's join


def storm_bursts(most: int) -> int:
    """Bursts enough for ``most`` "during" samples and a margin, taken back to back (the storm is
    reverted as soon as the verdict is decided). A storm sized for fewer once ended under the later
    samples: the flood then had the NIC at full rate and TCP read 0.52 x baseline (a false FAIL).
    One sized for ``FLOOD_S`` per sample still ended under the 7th: a flood behind the paused queue
    takes up to its join limit to end (25-53 s measured)."""
    return int((most * SAMPLE_S + 20) * 1000 // (PAUSE_MS + RESUME_MS))


def test_pfc_storm_does_not_spread_to_tcp(cluster: ClusterHandle, faults: FaultRunner, conformance: Conformance,
                                          harness_options: HarnessOptions) -> None:
    most = int(cluster.thresholds.threshold(ITEM_PFC_ISOLATION, "max_repeats").value)
    bursts = storm_bursts(most)
    if (nodes := ssh_nodes(cluster, faults.audit)) is not None:
        stormed, peer, other = nodes["source"], nodes["peer"], nodes["other"]
        if stormed.lossless_class is None:
            conformance.record(skipped(cluster.thresholds, ITEM_PFC_ISOLATION,
                                       f"host {stormed.name} names no fabric.lossless_class (a tc class) to pause"))
            return
        client, server = stormed.tcp_station, peer.tcp_station
        flood_from, flood_to, flood_port = stormed.station, other.station, stormed.bench_port
        lossless, sabotage = stormed.lossless_ports, "unknown (a foreign cluster)"
        nics = {"stormed": f"{stormed.interface} on {stormed.name}", "tcp_probe": f"{stormed.tcp_interface} on "
                f"{stormed.name} -> {peer.tcp_interface} on {peer.name}"}
        storm = PfcStorm(nics=[[None, stormed.interface]], host=stormed.name, classid=stormed.lossless_class,
                         pause_ms=PAUSE_MS, resume_ms=RESUME_MS, bursts=bursts)
    else:
        placed = placement_or_skip(cluster, conformance, ITEM_PFC_ISOLATION)
        if placed is None:
            return
        fabric = cluster.fabric
        stormed, peer = placed["prefill-0"], placed["decode-0"]
        client, server = Station.of(stormed), Station.of(peer)
        flood_from, flood_to = client, Station.of(placed.get("decode-1", peer))
        flood_port, lossless = fabric.config.bench_port, fabric.config.shaping.lossless_ports
        sabotage = fabric.config.shaping.tcp_in_lossless
        storm = PfcStorm.on_fabric_hosts([stormed], pause_ms=PAUSE_MS, resume_ms=RESUME_MS, bursts=bursts)
        nics = {"stormed": f"{stormed.fabric_dev} in {stormed.netns}", "tcp_probe": "the same NIC, TCP ports"}
    if harness_options.dry_run:
        faults.inject(storm)
        faults.revert_all()
        conformance.record(skipped(cluster.thresholds, ITEM_PFC_ISOLATION, "dry run: the storm was planned, not run"))
        return

    def sample(label: str, rr_s: float = RR_S) -> TcpClassSample:
        return sample_tcp_class(client, server, label=label, rr_seconds=rr_s, bulk_seconds=BULK_S,
                                bulk_repeats=BULK_REPEATS, lossless_ports=lossless)

    floods: list[dict] = []
    after_storm: list[dict] = []   # samples that ended after the storm's bursts: not "during" it, left out

    def sample_during() -> TcpClassSample:
        flood: dict = {}
        floods.append(flood)
        # congestion: a bulk flow in the lossless class keeps the paused queue full (its result is evidence only)
        flooder = threading.Thread(target=lambda: flood.update(measure_bulk(
            flood_from, flood_to, port=flood_port, duration_s=FLOOD_S, tool="python", allow_zero=True).to_dict()),
            daemon=True)
        flooder.start()
        try:
            return sample("during")
        finally:
            flooder.join(FLOOD_JOIN_S)

    # the baseline is taken once (the storm cannot be undone to extend it): long enough that its p99's
    # lower bound sits close to its p99, so the ratio's interval is as wide as the storm window makes it
    before = sample("before", RR_S * BEFORE_FACTOR)
    evidence = {"target": storm.target, "pause_ms": PAUSE_MS, "resume_ms": RESUME_MS, "lossless_flood": floods,
                "tcp_in_lossless": sabotage, "nics": nics}
    during: list[TcpClassSample] = []
    faults.inject(storm)
    ex = faults.executor_factory(storm.host)
    counters_start = storm.counters(ex)
    try:
        def more_during(k: int) -> None:
            for _ in range(k):
                taken = sample_during()
                if not storm.running():  # the bursts ended under this sample: stop, never judge it
                    after_storm.append(taken.to_dict())
                    evidence["storm_ended_under_sample"] = len(during) + 1
                    return
                during.append(taken)

        def judged() -> list:
            if not during:  # sized for the whole budget, the storm cannot end this soon unless it failed
                return [inconclusive(cluster.thresholds, ITEM_PFC_ISOLATION, "the storm's bursts ended before the "
                                     "first TCP-class sample during it did: nothing was measured during the storm")]
            return [pfc_isolation_verdict(cluster.thresholds, before, functools.reduce(TcpClassSample.merged, during),
                                          None, evidence)]

        (verdict,) = repeat_until_decided(
            judged, more_during, lambda: len(during), first=1, most=most, noun="TCP-class samples during the storm")
        counters_end = storm.counters(ex)
    finally:
        faults.revert(storm)
    verdict.evidence.setdefault("samples", []).append(sample("after").to_dict())   # recovery, evidence only
    verdict.evidence.setdefault("storm", dict(evidence))["after_storm_samples_left_out"] = after_storm
    verdict.evidence["storm"]["lossless_class_counters"] = {"at_inject": counters_start,
                                                            "after_during_sample": counters_end}
    conformance.record(verdict)
