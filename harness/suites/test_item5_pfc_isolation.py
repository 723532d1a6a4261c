"""Checklist item 6.1.5 (Section 6.1, "PFC Storm 隔离：在 RDMA fabric 上制造拥塞，验证不扩散到 TCP/IP 流量").

On the bundled cluster's emulated fabric, the prefill host's fabric NIC carries both classes.
A UDP flood fills that NIC's lossless class (it never backs off: a full socket buffer holds it, as
PFC holds an RDMA sender) while a PFC storm pauses the class in bursts (300 ms paused, 100 ms running), the bursts in groups of GROUP with as long a calm gap between groups.
The TCP/IP class is sampled all along (paced round trips, then bulk flows, prefill host -> decode
host on TCP ports) and each round trip and flow is put on the side it fell in: inside a storm
group, or in a calm gap (after SETTLE_S of the group's aftermath). The two sides run under the
same flood, interleaved every few seconds, so they differ by the pause frames alone: the flood's
own cost and this machine's noise, which drifts over minutes, fall on both. (A baseline taken
before the storm once read TCP p99 0.4 ms against 1.1-4 ms during it, and quiet windows a minute
apart read 0.6 and 2.3 ms: 6.1.5 failed in CI and in 2 of 3 quiet bench runs on a cluster that
isolates; docs/fabric.md.)
The TCP class must keep its p99 latency and throughput (thresholds in checklists/section6.yaml),
judged on 95 % intervals: the ratio of the sides' p99 round trips and the ratio of their median
bulk flows. A ratio that straddles its limit takes another round, up to the checklist's
``max_repeats``. A cluster whose TCP traffic shares the lossless class (``fabric.tcp_in_lossless``)
fails here.

On an external cluster with ``ssh:`` + ``fabric:`` hosts the same storm runs over SSH only: the
prefill host's ``fabric.lossless_class`` (a tc class) is paused in bursts by the PfcStorm fault
on that host while the probe ends (``python3`` there) flood the lossless port towards a second
decode host and sample the TCP class towards the first. Round trips are timed by the stormed
host's clock, as the storm's transitions are; bulk flows by the harness's, with a margin of
CLOCK_MARGIN_S.
"""

from __future__ import annotations

import time

import pytest

from harness.checks.extend import repeat_until_decided
from harness.checks.fabric import ITEM_PFC_ISOLATION, pfc_isolation_verdict, placement_or_skip, skipped
from harness.fabric.remote import ssh_nodes
from harness.cluster import ClusterHandle
from harness.fabric.bandwidth import LosslessFlood, Station, measure_bulk
from harness.fabric.tcpprobe import DEFAULT_PORT as PROBE_PORT
from harness.fabric.tcpprobe import (TcpClassSample, check_probe_ports, class_sample,
                                      sample_tcp_class, split_by_spans, timed_round_trips)
from harness.checks.verdict import Status, inconclusive
from harness.faults import FaultRunner, PfcStorm
from harness.fixtures import Conformance
from harness.plugin_state import HarnessOptions

pytestmark = [pytest.mark.conformance, pytest.mark.item("6.1.5"), pytest.mark.slow]

RR_S, RR_INTERVAL_MS = 8.0, 2.0 # paced round trips per round: ~4000, ~1700 a side
BULK_S = 0.5                    # one bulk flow
BULK_EACH, BULK_MOST = 4, 16    # flows per round: until each side gained BULK_EACH, at most BULK_MOST
PAUSE_MS, RESUME_MS = 300.0, 100.0
GROUP = 8                       # bursts per storm group: 3.2 s of storm ...
GAP_MS = GROUP * (PAUSE_MS + RESUME_MS)   # ... then as long a calm gap
SETTLE_S = 0.5                  # a group's aftermath (the flood catching up) is on neither side
CLOCK_MARGIN_S = 0.1            # bulk flows are timed by the harness's clock, the storm by the host's
ROUND_S = RR_S + BULK_MOST * (BULK_S + 1.5) + 10   # the most one round takes


def storm_bursts(most: int) -> int:
    """Bursts enough for ``most`` rounds and a margin, taken back to back (the storm is reverted as
    soon as the verdict is decided). A storm sized for fewer once ended under the later samples:
    the flood then had the NIC at full rate and TCP read 0.52 x baseline (a false FAIL)."""
    per_group_s = (GROUP * (PAUSE_MS + RESUME_MS) + GAP_MS) / 1000
    return int((most * ROUND_S + 20) / per_group_s + 1) * GROUP


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
        mtu = faults.executor_factory(stormed.name).run(["cat", f"/sys/class/net/{stormed.interface}/mtu"],
                                                        timeout=15, check=False).stdout.strip()
        datagram = (int(mtu) if mtu.isdigit() else 1500) - 28
        storm = PfcStorm(nics=[[None, stormed.interface]], host=stormed.name, classid=stormed.lossless_class,
                         pause_ms=PAUSE_MS, resume_ms=RESUME_MS, bursts=bursts,
                         group=GROUP, gap_ms=GAP_MS)
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
        datagram = fabric.config.shaping.mtu - 28
        storm = PfcStorm.on_fabric_hosts([stormed], pause_ms=PAUSE_MS, resume_ms=RESUME_MS, bursts=bursts,
                                         group=GROUP, gap_ms=GAP_MS)
        nics = {"stormed": f"{stormed.fabric_dev} in {stormed.netns}", "tcp_probe": "the same NIC, TCP ports"}
    if harness_options.dry_run:
        faults.inject(storm)
        faults.revert_all()
        conformance.record(skipped(cluster.thresholds, ITEM_PFC_ISOLATION, "dry run: the storm was planned, not run"))
        return

    check_probe_ports(PROBE_PORT, lossless)
    floods: list[dict] = []
    timed: list[tuple[float, float, float]] = []    # (sent, answered, ms) of every round trip under the storm
    flows: list[tuple[float, float, float]] = []    # (start, end, bit/s) of every bulk flow under the storm
    rounds: list[dict] = []
    ended_under: list[int] = []   # a round under which the storm's bursts ended: left out, never judged

    def sides() -> tuple[TcpClassSample, TcpClassSample]:
        spans = storm.spans(ex)
        rtt_in, rtt_out = split_by_spans(timed, spans, settle_s=SETTLE_S)
        flow_in, flow_out = split_by_spans(
            [(a - CLOCK_MARGIN_S, b + CLOCK_MARGIN_S, bps) for a, b, bps in flows], spans, settle_s=SETTLE_S)
        t0 = min((a for a, _, _ in timed), default=0.0)
        t1 = max((b for _, b, _ in timed + flows), default=0.0)
        return (class_sample("calm", rtt_out, flow_out, t0, t1),
                class_sample("during", rtt_in, flow_in, t0, t1))

    def one_round() -> None:
        """Round trips, then bulk flows until each side has BULK_EACH more, while a UDP flood keeps
        the lossless class busy (its paused queue full; what it moved is evidence only)."""
        flood = LosslessFlood(flood_from, flood_to, port=flood_port, datagram_bytes=datagram)
        with flood:
            taken = [(sent, sent + ms / 1e3, ms) for sent, ms in
                     timed_round_trips(client, server, seconds=RR_S, interval_ms=RR_INTERVAL_MS)]
            calm0, storm0 = (len(x.throughputs_bps) for x in sides())
            mine: list[tuple[float, float, float]] = []
            while len(mine) < BULK_MOST:
                t0 = time.time()
                bps = measure_bulk(client, server, port=PROBE_PORT + 1, duration_s=BULK_S, tool="python",
                                   allow_zero=True).bps
                mine.append((t0, time.time(), bps))
                flows.append(mine[-1])
                calm, during = sides()
                if (len(calm.throughputs_bps) - calm0 >= BULK_EACH
                        and len(during.throughputs_bps) - storm0 >= BULK_EACH):
                    break
        floods.append({"round": len(rounds) + 1, **flood.result})
        if not storm.running():   # the bursts ended under this round: its figures are not the storm's
            del flows[len(flows) - len(mine):]
            ended_under.append(len(rounds) + 1)
            return
        timed.extend(taken)
        rounds.append({"round_trips": len(taken), "bulk_flows": len(mine)})

    def more(k: int) -> None:
        # k counts round trips or flows that would decide (the extension loop's estimate): judge
        # again after at most 2 rounds (~3400 round trips a side) rather than running the budget out
        for _ in range(min(k, 2)):
            one_round()
            if ended_under:
                return

    evidence = {"target": storm.target, "pause_ms": PAUSE_MS, "resume_ms": RESUME_MS, "group": GROUP,
                "gap_ms": GAP_MS, "settle_s": SETTLE_S, "lossless_flood": floods, "rounds": rounds,
                "baseline": "TCP-class round trips and flows in the calm gaps between storm groups, "
                            "under the same lossless flood", "tcp_in_lossless": sabotage, "nics": nics}
    faults.inject(storm)
    ex = faults.executor_factory(storm.host)
    counters_start = storm.counters(ex)
    try:
        def judged() -> list:
            calm, during = sides()
            if not rounds or not calm.round_trips or not during.round_trips:
                # sized for the whole budget, the storm cannot end this soon unless it failed
                return [inconclusive(cluster.thresholds, ITEM_PFC_ISOLATION, "the storm's bursts ended before a "
                                     "round of TCP-class samples did: nothing was measured on both sides of it")]
            # the group under way has no end yet (None: JSON has no infinity)
            evidence["spans"] = [[a, b if b != float("inf") else None] for a, b in storm.spans(ex)]
            return [pfc_isolation_verdict(cluster.thresholds, calm, during, None, evidence)]

        (verdict,) = repeat_until_decided(judged, more, lambda: len(rounds), first=1, most=most,
                                          noun="rounds of TCP-class samples under the storm")
        if ended_under and verdict.status is Status.INCONCLUSIVE:
            verdict.reason += (f"; the storm's bursts ended under round {ended_under[0]} (its figures left out), "
                               "so no more could be measured under it")
        counters_end = storm.counters(ex)
    finally:
        faults.revert(storm)
    after = sample_tcp_class(client, server, label="after", rr_seconds=3.0, bulk_seconds=BULK_S,
                             bulk_repeats=BULK_EACH, lossless_ports=lossless)
    verdict.evidence.setdefault("samples", []).append(after.to_dict())   # recovery, evidence only
    verdict.evidence.setdefault("storm", dict(evidence))["storm_ended_under_round"] = ended_under
    verdict.evidence["storm"]["lossless_class_counters"] = {"at_inject": counters_start,
                                                            "after_last_round": counters_end}
    conformance.record(verdict)
