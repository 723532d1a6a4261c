"""Verdicts of the fabric checklist items from fabric measurements: item 6.1.1 (KV bandwidth vs
line rate), 6.1.5 (TCP class through a PFC storm) and the NIC flap recovery item; and which
fabric a suite measures: the bundled cluster's emulated one (namespaces) or named hosts over SSH.

Each figure carries its 95 % interval (docs/statistics.md): the line-rate fraction, the median of
repeated transfers at the judged size (order statistics); 6.1.5's p99 round-trip ratio, the ratio
of the two windows' p99 intervals (each at 97.5 %, Bonferroni; the calm side at no less than the
host's loopback round trip measured beside it), its throughput ratio and the NIC
flap's recovered fraction, a seeded bootstrap of the ratio of medians between the windows."""

from __future__ import annotations

from typing import Any, Sequence

from harness.stats.intervals import (bootstrap_interval, measured_within, median, percentile_interval,
                                     ratio_input_level, ratio_interval, ratio_of_medians)
from harness.stats import nearest_rank
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Status, Verdict, inconclusive, judge
from harness.fabric.bandwidth import BandwidthResult
from harness.fabric.kvbandwidth import KVCurve
from harness.fabric.linerate import LineRate
from harness.fabric.nixl import LINK_RATIO_MAX, LINK_RATIO_MIN, NixlRun
from harness.fabric.tcpprobe import TcpClassSample

ITEM_KV_BANDWIDTH = "6.1.1"
ITEM_PFC_ISOLATION = "6.1.5"
ITEM_NIC_FLAP = "nic-flap"
# which measurement of 6.1.1 came from where (evidence "source": the one the verdict's headline is)
SOURCES = {"line_rate_fraction": "raw_probe", "kv_transfer_line_rate_fraction": "nixl_metrics"}
RTT_FLOOR_WHAT = ("p99 of the same probe's round trips over the stormed host's loopback (127.0.0.1, no network), "
                  "timed on each side of the storm beside that side's round trips: what the host's timer, "
                  "scheduler, probe ends and the storm's own tc commands add to a round trip; the calm p99 is "
                  "judged at no less than the higher of the two sides' floors")


def skipped(checklist: Checklist, item_id: str, reason: str) -> Verdict:
    reason = reason if reason.startswith("skipped:") else f"skipped: {reason}"
    return inconclusive(checklist, item_id, reason, code="skipped", skipped=reason)


def placement_or_skip(cluster: Any, conformance: Any, item_id: str) -> dict[str, Any] | None:
    """{worker id: FabricHost} of a cluster running on the emulated fabric; otherwise record an
    inconclusive "skipped" verdict for ``item_id`` (saying why) and return None."""
    if cluster.fabric is None:
        conformance.record(skipped(cluster.thresholds, item_id,
                                   cluster.fabric_unavailable or "the cluster has no emulated fabric"))
        return None
    return cluster.fabric.placement(cluster.topology.worker_ids())


def raw_bandwidth_verdict(checklist: Checklist, line: LineRate, timed: Sequence[BandwidthResult],
                          curve: Sequence[BandwidthResult], kv_goodput: dict[str, Any] | None = None,
                          nixl: NixlRun | None = None) -> Verdict:
    """Item 1 on named hosts: the raw fabric bandwidth (ib_write_bw, else iperf3) between them as
    a fraction of the line rate, the median of the repeated ``timed`` measurements, with the curve
    over transfer sizes; the engine's own KV goodput (from its metrics, where its profile has one)
    is evidence beside it. With ``nixl`` (the cluster runs vLLM's NixlConnector: its own transfers,
    harness/fabric/nixl.py) the verdict judges a second figure, ``kv_transfer_line_rate_fraction``
    (:func:`nixl_measurement`), and ``evidence["source"]`` says which figures decided."""
    t = checklist.threshold(ITEM_KV_BANDWIDTH, "line_rate_fraction")
    first = timed[0]
    bps = [r.bps for r in timed]
    points = [{"size_bytes": r.bytes, "gbit_per_s": r.bps / 1e9, "seconds": r.seconds,
               "line_rate_fraction": r.bps / line.bps} for r in curve]
    measurements = [
        Measurement(t, nearest_rank(bps, 50) / line.bps,
                    f"raw {first.tool} bandwidth {first.sender} -> {first.receiver} (median of {len(bps)} "
                    f"{first.bytes / (1 << 20):.0f} MiB runs, of a {line.bps / 1e9:.3f} Gbit/s line rate)",
                    percentile_interval(bps, 50, noun="runs").scaled(1 / line.bps))]
    evidence = {"line_rate": line.to_dict(),
                "raw_probe": {**first.to_dict(), "line_rate_fraction": first.bps / line.bps},
                "repeats_line_rate_fraction": [b / line.bps for b in bps],
                "curve": points, "kv_goodput": kv_goodput or {"unavailable": "the engine's metric profile has no "
                                                                             "KV transfer goodput"},
                "definition": f"{first.tool} goodput between the hosts' fabric addresses on a lossless-class port, "
                              "started and stopped over SSH; the verdict uses the median of the repeated timed runs"}
    because = None
    if nixl is not None:
        measurement, evidence["nixl"], because = nixl_measurement(checklist, line, nixl)
        measurements.append(measurement)
    verdict = judge(checklist.item(ITEM_KV_BANDWIDTH), measurements, evidence=evidence, inconclusive_because=because)
    judged = verdict.evidence["measurements"]
    # the figure the verdict's headline is (judge's order: the first that missed, else undecided, else the first)
    head = next((m for m in judged if m["holds"] is False), None) or next((m for m in judged if m["holds"] is None),
                                                                         judged[0])
    verdict.evidence["source"] = SOURCES[head["key"]]
    verdict.evidence["sources"] = {m["key"]: SOURCES[m["key"]] for m in judged}
    return verdict


def nixl_measurement(checklist: Checklist, line: LineRate,
                     run: NixlRun) -> tuple[Measurement, dict[str, Any], str | None]:
    """6.1.1's figure from vLLM's own NIXL transfers: the median over transfers of bytes / seconds
    (each from decode's histograms, harness/fabric/nixl.py) as a fraction of the line rate, with its
    order-statistics interval (noun "NIXL transfers"). Not measured (value None) and the reason
    returned, for the verdict to say inconclusive, when the figure would not be the link's:
    no transfer finished; the prefill host's lossless class did not count NIXL's bytes
    (LINK_RATIO_MIN .. LINK_RATIO_MAX: the KV went another way, or other traffic shared the class);
    or the median transfer is shorter at line rate than ``kv_transfer_min_wire_ms`` (then NIXL's
    post and the engine's completion polling, not the link, set its time). Returns the measurement,
    ``evidence["nixl"]`` and that reason (None: judged on its interval)."""
    t = checklist.threshold(ITEM_KV_BANDWIDTH, "kv_transfer_line_rate_fraction")
    min_wire_ms = checklist.threshold(ITEM_KV_BANDWIDTH, "kv_transfer_min_wire_ms").value
    transfers = [x for x in run.transfers if x.seconds > 0]
    fractions = [x.bps / line.bps for x in transfers]
    sizes = sorted(x.bytes / x.count for x in transfers)
    median_bytes = sizes[(len(sizes) - 1) // 2] if sizes else 0.0
    wire_ms = 8e3 * median_bytes / line.bps
    link = run.link
    evidence: dict[str, Any] = {**run.to_dict(), "line_rate_fractions": fractions,
                                "median_transfer_bytes": median_bytes, "median_wire_ms_at_line_rate": wire_ms,
                                "min_wire_ms": min_wire_ms}
    what = (f"vLLM's own KV transfers over NIXL (median of {len(transfers)} transfers of "
            f"{median_bytes / (1 << 20):.2f} MiB, bytes / time from decode's nixl histograms, of a "
            f"{line.bps / 1e9:.3f} Gbit/s line rate)")
    value = nearest_rank(fractions, 50) if fractions else None
    because = None
    if not transfers:
        because = (f"no NIXL transfer finished in {run.requests} requests through the router"
                   + (f" ({run.errors[0]})" if run.errors else "") + "; the raw probe alone cannot judge the engine")
    elif link is None or not link.crossed:
        ratio = None if link is None else link.ratio
        host = link.host if link else "the prefill host"
        because = (f"the KV bytes NIXL reported did not cross the measured link: {host}'s "
                   f"lossless class sent {'an unknown multiple' if ratio is None else f'{ratio:.3f} x'} of NIXL's "
                   f"{(link.nixl_bytes if link else 0) / 1e6:.2f} MB (accepted {LINK_RATIO_MIN:g}-{LINK_RATIO_MAX:g}: "
                   "below, the KV went another way; above, other traffic shared the class)")
    elif wire_ms < min_wire_ms:
        because = (f"NIXL's transfers are too small to time the link: {median_bytes / 1e3:.0f} kB takes "
                   f"{wire_ms:.2f} ms at line rate, under {min_wire_ms:g} ms, so NIXL's post and decode's completion "
                   f"polling set their time (median {value:.3f} x line rate, not judged)")
    if because is not None:
        evidence["not_judged"] = {"value": value, "because": because}
        return Measurement(t, None, what), evidence, because
    return (Measurement(t, value, what, percentile_interval(fractions, 50, noun="NIXL transfers")),
            evidence, None)


def kv_bandwidth_verdict(checklist: Checklist, line: LineRate, raw: BandwidthResult, curve: KVCurve) -> Verdict:
    """Item 1: the largest transfer's median bandwidth as a fraction of the line rate."""
    gbit_line = line.bps / 1e9
    largest = curve.largest
    t = checklist.threshold(ITEM_KV_BANDWIDTH, "line_rate_fraction")
    points = [{**p.to_dict(), "line_rate_fraction": p.median_gbit_per_s / gbit_line} for p in curve.points]
    return judge(checklist.item(ITEM_KV_BANDWIDTH), [
        Measurement(t, largest.median_gbit_per_s / gbit_line,
                    f"KV transfer bandwidth at {largest.size_bytes / (1 << 20):.0f} MiB "
                    f"({largest.median_gbit_per_s:.3f} of a {gbit_line:.3f} Gbit/s line rate)",
                    percentile_interval(largest.gbit_per_s, 50, noun="transfers").scaled(1 / gbit_line))],
        evidence={"line_rate": line.to_dict(), "raw_probe": {**raw.to_dict(), "line_rate_fraction": raw.bps / line.bps},
                  "kv_curve": points, "preset": curve.preset, "sender": curve.sender, "receiver": curve.receiver,
                  "definition": "wire bytes / sender transfer time (first layer handed over until the receiver "
                                "committed), the median of the repeats at the largest size; raw probe = plain TCP "
                                "bulk goodput between the same hosts"})


def pfc_isolation_verdict(checklist: Checklist, before: TcpClassSample, during: TcpClassSample,
                          after: TcpClassSample | None, storm: dict[str, Any]) -> Verdict:
    """Item 5: TCP-class p99 RTT and bulk throughput during the storm against the calm side
    (``before``: taken under the same lossless flood, without the storm). The calm p99 counts at no
    less than its floor, the higher p99 of the loopback round trips measured on either side
    (``floor_rtts_ms``, RTT_FLOOR_WHAT): below that the host cannot time the network. No
    floor measured: none applied, and the evidence says so. The sample after the storm (None: not
    taken yet) is evidence of recovery only: a class that shared the storm may still be draining
    then, which must not flatter the baseline."""
    floors = {side: s.floor_p99_ms for side, s in (("calm", before), ("storm", during)) if s.floor_p99_ms is not None}
    floor = max(floors.values()) if floors else None
    base_p99 = max(before.rtt_p99_ms, floor or 0.0)
    base_tput = before.throughput_bps
    t = checklist.item(ITEM_PFC_ISOLATION).thresholds
    each = ratio_input_level()
    latency = ratio_interval(percentile_interval(during.rtts_ms, 99, each, noun="round trips"),
                             percentile_interval(before.rtts_ms, 99, each), den_floor=floor or 0.0)
    throughput = bootstrap_interval(ratio_of_medians, during.throughputs_bps, before.throughputs_bps,
                                    noun="bulk flows", grows=[0])
    calm = (f"calm {base_p99:.3f} ms" if floor is None or before.rtt_p99_ms >= floor else
            f"the loopback floor {floor:.3f} ms, the calm p99 {before.rtt_p99_ms:.3f} ms being below it")
    floor_evidence = {"p99_ms": floor, "by_side_p99_ms": floors,
                      "round_trips": len(before.floor_rtts_ms) + len(during.floor_rtts_ms), "what": RTT_FLOOR_WHAT,
                      "applied": floor is not None and before.rtt_p99_ms < floor}
    if errors := list(storm.get("loopback_floor_errors") or ()):
        floor_evidence["errors"] = errors   # rounds whose floor could not be taken (a port taken on the host)
    if floor is None:
        floor_evidence["what"] = ("not measured: the calm p99 is judged as measured, with no floor"
                                  + (f" ({errors[0]})" if errors else ""))
    # no bulk flow fell in a calm gap yet (flows started over SSH can keep in step with the storm's groups:
    # vLLM over NIXL, 2026-12-06, 16 flows, 4 in storm groups, 0 calm): more rounds, not "moved nothing"
    no_calm_flow = not before.throughputs_bps and bool(during.throughputs_bps)
    verdict = judge(checklist.item(ITEM_PFC_ISOLATION), [
        Measurement(t["tcp_p99_latency_ratio"], during.rtt_p99_ms / base_p99 if base_p99 > 0 else None,
                    f"TCP-class p99 round trip during the storm ({during.rtt_p99_ms:.3f} ms vs {calm})", latency),
        Measurement(t["tcp_throughput_ratio"], during.throughput_bps / base_tput if base_tput > 0 else None,
                    f"TCP-class bulk throughput during the storm ({during.throughput_bps / 1e9:.3f} vs "
                    f"{base_tput / 1e9:.3f} Gbit/s, medians)", throughput)],
        evidence={"samples": [s.to_dict() for s in (before, during, after) if s is not None], "storm": dict(storm),
                  "rtt_floor": floor_evidence, "rtt_noise_floor_ms": floor, "calm_p99_used_ms": base_p99,
                  # every round trip (to 0.1 us), for `harness compare` to recompute the p99 ratio (docs/compare.md)
                  "rtts_ms": {"calm": [round(x, 4) for x in before.rtts_ms],
                              "during": [round(x, 4) for x in during.rtts_ms]}},
        inconclusive_because=None if base_tput > 0 else
        (f"no TCP bulk flow fell in a calm gap yet ({len(during.throughputs_bps)} during the storm)" if no_calm_flow
         else "the TCP class moved nothing even before the storm"))
    if no_calm_flow and verdict.status is Status.INCONCLUSIVE:   # the extension loop measures more rounds
        verdict.evidence.setdefault("undecided", []).append(
            {"key": "tcp_throughput_ratio", "more_to_decide": None, "noun": "bulk flows", "n": 0})
    return verdict


def flap_baseline_settled(checklist: Checklist, before: Sequence[float]) -> bool:
    """Whether the pre-fault bandwidth is known well enough to stop probing before the flaps: its
    median's 95 % bootstrap interval lies within half the item's margin either side (the margin is
    1 - ``kv_bandwidth_recovered_fraction``: +-2.5 % at 0.95). The recovered fraction's interval
    is a ratio of two medians; a baseline known only to +-4 % (8 transfers on this 2-core machine)
    made it straddle 0.95 at a true ratio of 1.01 (A/A runs, docs/statistics.md). The rule looks at
    the baseline's own spread, never at the transfers after, so it cannot steer the verdict."""
    t = checklist.item(ITEM_NIC_FLAP).thresholds
    if len(before) < int(t["min_repeats"].value):
        return False
    if len(before) >= int(t["max_repeats"].value):
        return True
    mid = nearest_rank(before, 50)
    if mid <= 0:
        return False
    half = (1.0 - t["kv_bandwidth_recovered_fraction"].value) / 2
    iv = bootstrap_interval(median, before, noun="transfers before")
    return iv.lo >= mid * (1 - half) and iv.hi <= mid * (1 + half)


def flap_recovery_verdict(checklist: Checklist, before: Sequence[float], after: Sequence[tuple[float, float, float]],
                          flaps: dict[str, Any]) -> Verdict:
    """NIC flap item. ``before``: Gbit/s of each transfer before the flaps; ``after``: (start, end
    in seconds since the flaps ended, Gbit/s) of each transfer after them. The recovered fraction
    is the median of every transfer after the flaps over the median before (bootstrap interval);
    recovery is at the end of the first transfer at the required fraction of the median before,
    known to within that transfer and the slow one before it."""
    t = checklist.item(ITEM_NIC_FLAP).thresholds
    need = t["kv_bandwidth_recovered_fraction"].value
    baseline = nearest_rank(before, 50) if before else 0.0
    speeds = [g for _, _, g in after]
    first = next((i for i, (_, _, g) in enumerate(after) if g >= need * baseline), None) if baseline > 0 else None
    recovery = None
    if first is not None:
        end, since = after[first][1], after[first - 1][0] if first > 0 else 0.0
        recovery = measured_within(end, below=end - since, above=0.0, noun="transfers")
    return judge(checklist.item(ITEM_NIC_FLAP), [
        Measurement(t["kv_bandwidth_recovered_fraction"], nearest_rank(speeds, 50) / baseline if speeds and baseline > 0
                    else None, f"median KV bandwidth of the {len(speeds)} transfers after the flaps as a fraction of "
                               f"the {len(before)} before",
                    bootstrap_interval(ratio_of_medians, speeds, before, noun="transfers after", grows=[0])),
        Measurement(t["recovery_time_s"], None if recovery is None else recovery.hi,
                    "time from the last flap until KV bandwidth was back", recovery)],
        evidence={"baseline_gbit_per_s": baseline, "before_gbit_per_s": list(before),
                  "after": [{"start_s": s, "t_s": e, "gbit_per_s": g} for s, e, g in after], "flaps": flaps},
        inconclusive_because=None if baseline > 0 else "no pre-fault KV bandwidth")
