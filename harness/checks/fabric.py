"""Verdicts of the fabric checklist items from fabric measurements: item 6.1.1 (KV bandwidth vs
line rate), 6.1.5 (TCP class through a PFC storm) and the NIC flap recovery item; and which
fabric a suite measures: the bundled cluster's emulated one (namespaces) or named hosts over SSH."""

from __future__ import annotations

from typing import Any, Sequence

from harness.checks.thresholds import Checklist
from harness.checks.verdict import Measurement, Verdict, inconclusive, judge
from harness.fabric.bandwidth import BandwidthResult
from harness.fabric.kvbandwidth import KVCurve
from harness.fabric.linerate import LineRate
from harness.fabric.tcpprobe import TcpClassSample

ITEM_KV_BANDWIDTH = "6.1.1"
ITEM_PFC_ISOLATION = "6.1.5"
ITEM_NIC_FLAP = "nic-flap"
# RTT changes below this are the timer and scheduler resolution of a busy host, not the network
RTT_NOISE_FLOOR_MS = 1.0


def skipped(checklist: Checklist, item_id: str, reason: str) -> Verdict:
    reason = reason if reason.startswith("skipped:") else f"skipped: {reason}"
    return inconclusive(checklist, item_id, reason, skipped=reason)


def placement_or_skip(cluster: Any, conformance: Any, item_id: str) -> dict[str, Any] | None:
    """{worker id: FabricHost} of a cluster running on the emulated fabric; otherwise record an
    inconclusive "skipped" verdict for ``item_id`` (saying why) and return None."""
    if cluster.fabric is None:
        conformance.record(skipped(cluster.thresholds, item_id,
                                   cluster.fabric_unavailable or "the cluster has no emulated fabric"))
        return None
    return cluster.fabric.placement(cluster.topology.worker_ids())


def ssh_nodes(cluster: Any, audit: Any = None) -> dict[str, Any] | None:
    """The fabric items' roles among the cluster's SSH fabric hosts (harness.fabric.remote.pick),
    or None when the cluster is not reached that way (bundled, or fewer than 2 such hosts)."""
    from harness.fabric.remote import fabric_nodes, pick, ssh_fabric_reason

    if cluster.fabric is not None or ssh_fabric_reason(cluster.spec) is not None:
        return None
    return pick(fabric_nodes(cluster, audit))


def raw_bandwidth_verdict(checklist: Checklist, line: LineRate, timed: BandwidthResult,
                          curve: Sequence[BandwidthResult], kv_goodput: dict[str, Any] | None = None) -> Verdict:
    """Item 1 on named hosts: the raw fabric bandwidth (ib_write_bw, else iperf3) between them as
    a fraction of the line rate, with the curve over transfer sizes; the engine's own KV goodput
    (from its metrics, where its profile has one) is evidence beside it."""
    t = checklist.threshold(ITEM_KV_BANDWIDTH, "line_rate_fraction")
    best = max([timed, *curve], key=lambda r: r.bytes)
    points = [{"size_bytes": r.bytes, "gbit_per_s": r.bps / 1e9, "seconds": r.seconds,
               "line_rate_fraction": r.bps / line.bps} for r in curve]
    return judge(checklist.item(ITEM_KV_BANDWIDTH), [
        Measurement(t, best.bps / line.bps,
                    f"raw {best.tool} bandwidth {best.sender} -> {best.receiver} ({best.bps / 1e9:.3f} of a "
                    f"{line.bps / 1e9:.3f} Gbit/s line rate, {best.bytes / (1 << 20):.0f} MiB)")],
        evidence={"line_rate": line.to_dict(), "raw_probe": {**timed.to_dict(), "line_rate_fraction": timed.bps / line.bps},
                  "curve": points, "kv_goodput": kv_goodput or {"unavailable": "the engine's metric profile has no "
                                                                               "KV transfer goodput"},
                  "definition": f"{best.tool} goodput between the hosts' fabric addresses on a lossless-class port, "
                                "started and stopped over SSH; the verdict uses the largest transfer"})


def kv_bandwidth_verdict(checklist: Checklist, line: LineRate, raw: BandwidthResult, curve: KVCurve) -> Verdict:
    """Item 1: the largest transfer's median bandwidth as a fraction of the line rate."""
    gbit_line = line.bps / 1e9
    largest = curve.largest
    t = checklist.threshold(ITEM_KV_BANDWIDTH, "line_rate_fraction")
    points = [{**p.to_dict(), "line_rate_fraction": p.median_gbit_per_s / gbit_line} for p in curve.points]
    return judge(checklist.item(ITEM_KV_BANDWIDTH), [
        Measurement(t, largest.median_gbit_per_s / gbit_line,
                    f"KV transfer bandwidth at {largest.size_bytes / (1 << 20):.0f} MiB "
                    f"({largest.median_gbit_per_s:.3f} of a {gbit_line:.3f} Gbit/s line rate)")],
        evidence={"line_rate": line.to_dict(), "raw_probe": {**raw.to_dict(), "line_rate_fraction": raw.bps / line.bps},
                  "kv_curve": points, "preset": curve.preset, "sender": curve.sender, "receiver": curve.receiver,
                  "definition": "wire bytes / sender transfer time (first layer handed over until the receiver "
                                "committed); raw probe = plain TCP bulk goodput between the same hosts"})


def pfc_isolation_verdict(checklist: Checklist, before: TcpClassSample, during: TcpClassSample,
                          after: TcpClassSample, storm: dict[str, Any]) -> Verdict:
    """Item 5: TCP-class p99 RTT and bulk throughput during the storm against the sample before it
    (latency at least RTT_NOISE_FLOOR_MS). The sample after it is evidence of recovery only: a
    class that shared the storm may still be draining then, which must not flatter the baseline."""
    base_p99 = max(before.rtt_p99_ms, RTT_NOISE_FLOOR_MS)
    base_tput = before.throughput_bps
    t = checklist.item(ITEM_PFC_ISOLATION).thresholds
    return judge(checklist.item(ITEM_PFC_ISOLATION), [
        Measurement(t["tcp_p99_latency_ratio"], during.rtt_p99_ms / base_p99,
                    f"TCP-class p99 round trip during the storm ({during.rtt_p99_ms:.3f} ms vs {base_p99:.3f} ms)"),
        Measurement(t["tcp_throughput_ratio"], during.throughput_bps / base_tput if base_tput > 0 else None,
                    f"TCP-class bulk throughput during the storm ({during.throughput_bps / 1e9:.3f} vs "
                    f"{base_tput / 1e9:.3f} Gbit/s)")],
        evidence={"samples": [s.to_dict() for s in (before, during, after)], "storm": storm,
                  "rtt_noise_floor_ms": RTT_NOISE_FLOOR_MS},
        inconclusive_because=None if base_tput > 0 else "the TCP class moved nothing even before the storm")


def flap_recovery_verdict(checklist: Checklist, baseline_gbit: float, after: Sequence[tuple[float, float]],
                          flaps: dict[str, Any]) -> Verdict:
    """NIC flap item: ``after`` is [(seconds since the flaps ended, Gbit/s)]; recovered at the first
    measurement at or above the required fraction of the pre-fault bandwidth."""
    t = checklist.item(ITEM_NIC_FLAP).thresholds
    need = t["kv_bandwidth_recovered_fraction"].value
    recovered = next(((s, g) for s, g in after if g >= need * baseline_gbit), None)
    best = max((g for _, g in after), default=0.0)
    measured_fraction = (recovered[1] if recovered else best) / baseline_gbit if baseline_gbit > 0 else None
    return judge(checklist.item(ITEM_NIC_FLAP), [
        Measurement(t["kv_bandwidth_recovered_fraction"], measured_fraction,
                    "KV bandwidth after the flaps as a fraction of before"),
        Measurement(t["recovery_time_s"], recovered[0] if recovered else None,
                    "time from the last flap until KV bandwidth was back")],
        evidence={"baseline_gbit_per_s": baseline_gbit, "after": [{"t_s": s, "gbit_per_s": g} for s, g in after],
                  "flaps": flaps},
        inconclusive_because=None if baseline_gbit > 0 else "no pre-fault KV bandwidth")
