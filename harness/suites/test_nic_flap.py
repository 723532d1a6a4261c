"""NIC port flapping on the fabric (DESIGN fault catalogue; REFERENCE: Mooncake #3596, transfers
5x slower for 25 minutes after a flap had recovered).

Under load, the fabric NIC of decode-0's host goes down and up (period 2 s, 50 % down, 3 times;
verified through operstate). The engine must keep serving meanwhile (KV retries, then the
fallback path over the control network), and nothing may be lost: every request completes
token-exact against the oracle or fails with a clear error. After the last flap, the KV
bandwidth from the prefill host to that host must be back to >= 95 % of its pre-fault figure
within the checklist's recovery time (checklists/section6.yaml, item ``nic-flap``): the median of
every transfer after the flaps against the median of those before them, with a 95 % bootstrap
interval. Before the flaps, ``min_repeats`` transfers and more, up to ``max_repeats``, until the
baseline's median is known to within half the margin (``flap_baseline_settled``: a rule on the
baseline alone); after them, at least ``min_repeats``, more up to ``max_repeats`` while it straddles.

On an external cluster with ``ssh:`` + ``fabric:`` hosts the flaps run on a decode host's named
fabric interface over SSH (with the on-host safety timer that brings the link up by itself),
and the bandwidth before and after is the probe ends' bulk flow on the lossless port from the
prefill host, started over SSH: no admin API, no namespace.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import pytest

from harness.checks.extend import repeat_until_decided
from harness.checks.fabric import (ITEM_NIC_FLAP, flap_baseline_settled, flap_recovery_verdict, placement_or_skip,
                                   skipped)
from harness.fabric.remote import ssh_nodes
from harness.stats import nearest_rank
from harness.checks.verdict import Verdict
from harness.cluster import ClusterHandle
from harness.fabric.bandwidth import Station
from harness.fabric.kvbandwidth import KVBench
from harness.fabric.remote import FabricNode
from harness.faults import FaultRunner, NicFlap
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions
from harness.suites.epilogue import finish_suite, run_links
from harness.states import EventKind

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.item("nic-flap", "nothing-lost"), pytest.mark.slow]

PERIOD_S, DUTY, COUNT = 2.0, 0.5, 3
PROBE_MIB = 32
LOAD_S = 60.0


def _around_flaps(cluster: ClusterHandle, faults: FaultRunner, flap: NicFlap, probe: Callable[[], float],
                  flaps: dict[str, object]) -> tuple[Verdict, list[tuple[str, float]], float]:
    """Probe transfers before the flaps until the baseline is settled, flap, then transfers after
    them until the bandwidth is back (or twice the allowed recovery time) and at least
    ``min_repeats``, more while the verdict straddles; the verdict and the flap transitions."""
    t = cluster.thresholds.item(ITEM_NIC_FLAP).thresholds
    first, most = int(t["min_repeats"].value), int(t["max_repeats"].value)
    before = [probe() for _ in range(first)]
    while not flap_baseline_settled(cluster.thresholds, before):
        before.append(probe())
    faults.inject(flap)
    transitions = flap.wait_done(faults.executor_factory(flap.host))
    faults.revert(flap)
    last_up = max((t for what, t in transitions if what == "off"), default=time.time())
    after: list[tuple[float, float, float]] = []

    def transfer() -> None:
        start = time.time() - last_up
        gbit = probe()
        after.append((start, time.time() - last_up, gbit))

    back = t["kv_bandwidth_recovered_fraction"].value * nearest_rank(before, 50)
    while not any(g >= back for *_, g in after) and (not after or after[-1][1] <= 2 * t["recovery_time_s"].value):
        transfer()
    flaps["transitions"] = [{"state": "down" if w == "on" else "up", "t_wall": t} for w, t in transitions]
    (verdict,) = repeat_until_decided(lambda: [flap_recovery_verdict(cluster.thresholds, before, after, flaps)],
                                      lambda k: [transfer() for _ in range(k)], lambda: len(after), first=first,
                                      most=most, noun="transfers after the flaps")
    return verdict, transitions, last_up


def test_nic_flap_loses_nothing_and_kv_bandwidth_recovers(cluster: ClusterHandle, load: Load, faults: FaultRunner,
                                                          timeline: Timeline, conformance: Conformance,
                                                          harness_options: HarnessOptions) -> None:
    if (nodes := ssh_nodes(cluster, faults.audit)) is not None:
        return _over_ssh(cluster, load, faults, timeline, conformance, harness_options, nodes)
    placed = placement_or_skip(cluster, conformance, ITEM_NIC_FLAP)
    if placed is None:
        return
    fabric = cluster.fabric
    victim_id = "decode-0"
    victim, source = placed[victim_id], placed["prefill-0"]
    flap = NicFlap.on_fabric_host(victim, period_s=PERIOD_S, duty=DUTY, count=COUNT)
    if harness_options.dry_run:
        faults.inject(flap)
        faults.revert_all()
        conformance.record(skipped(cluster.thresholds, ITEM_NIC_FLAP, "dry run: the flaps were planned, not run"))
        return
    run = load(duration_s=harness_options.load_duration or LOAD_S, max_tokens=32)
    flaps = {"target": flap.target, "period_s": PERIOD_S, "duty": DUTY, "count": COUNT, "probe_mib": PROBE_MIB}
    with KVBench(Station.of(source), Station.of(victim), port=fabric.config.bench_port,
                 preset=cluster.spec.bundled.preset) as bench:
        tokens = bench.tokens_for(PROBE_MIB << 20)
        bench.transfer_once(tokens)  # warm-up

        def probe() -> float:
            r = bench.transfer_once(tokens)
            return r["bytes"] * 8 / r["seconds"] / 1e9

        verdict, transitions, last_up = _around_flaps(cluster, faults, flap, probe, flaps)
    records = run.finish()  # the faults are done: no new requests, the ones in flight end
    events = timeline.events()
    first_down = min((t for what, t in transitions if what == "on"), default=last_up)
    to_victim = [e for e in events if e["type"] == EventKind.KV_TRANSFER and e.get("decode") == victim_id
                 and first_down <= e["wall_time"] <= last_up + 5]
    # what the engine did meanwhile: TCP rode out short outages, retries and the fallback path longer ones
    verdict.evidence["flaps"]["kv_transfers_to_victim_during_flaps"] = {
        "count": len(to_victim), "max_transfer_s": max((e["transfer_s"] for e in to_victim), default=None),
        "retries": sum(e["retries"] for e in to_victim), "fallbacks": sum(1 for e in to_victim if e["fallback"])}
    conformance.record(verdict)

    finish_suite(conformance, cluster, records, ignore_eos=run.profile.ignore_eos, links=run_links(run),
                 faults=faults, events=events)


def _over_ssh(cluster: ClusterHandle, load: Load, faults: FaultRunner, timeline: Timeline, conformance: Conformance,
              harness_options: HarnessOptions, nodes: dict[str, FabricNode]) -> None:
    from harness.fabric.remote import bulk

    source, victim = nodes["source"], nodes["peer"]
    flap = NicFlap(device=victim.interface, host=victim.name, period_s=PERIOD_S, duty=DUTY, count=COUNT)
    if harness_options.dry_run:
        faults.inject(flap)
        faults.revert_all()
        conformance.record(skipped(cluster.thresholds, ITEM_NIC_FLAP, "dry run: the flaps were planned, not run"))
        return

    def gbit() -> float:
        return bulk(source.station, victim.station, port=source.bench_port, seconds=1.0, allow_zero=True).bps / 1e9

    run = load(duration_s=harness_options.load_duration or LOAD_S, max_tokens=32)
    flaps = {"target": flap.target, "period_s": PERIOD_S, "duty": DUTY, "count": COUNT, "over": "ssh",
             "probe": f"bulk TCP {source.name} -> {victim.name} on lossless port {source.bench_port}, 1 s each"}
    verdict, *_ = _around_flaps(cluster, faults, flap, gbit, flaps)
    records = run.finish()
    conformance.record(verdict)
    finish_suite(conformance, cluster, records, ignore_eos=run.profile.ignore_eos, links=run_links(run),
                 faults=faults, events=timeline.events())
