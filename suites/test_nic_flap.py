"""NIC port flapping on the fabric (DESIGN fault catalogue; REFERENCE: Mooncake #3596, transfers
5x slower for 25 minutes after a flap had recovered).

Under load, the fabric NIC of decode-0's host goes down and up (period 2 s, 50 % down, 3 times;
verified through operstate). The engine must keep serving meanwhile (KV retries, then the
fallback path over the control network), and nothing may be lost: every request completes
token-exact against the oracle or fails with a clear error. After the last flap, the KV
bandwidth from the prefill host to that host must be back to >= 95 % of its pre-fault figure
within the checklist's recovery time (checklists/section6.yaml, item ``nic-flap``).

On an external cluster with ``ssh:`` + ``fabric:`` hosts the flaps run on a decode host's named
fabric interface over SSH (with the on-host safety timer that brings the link up by itself),
and the bandwidth before and after is the probe ends' bulk flow on the lossless port from the
prefill host, started over SSH: no admin API, no namespace.
"""

from __future__ import annotations

import logging
import time

import pytest

from harness.checks.epilogue import finish_suite, run_links
from harness.fabric.bandwidth import Station
from harness.fabric.kvbandwidth import KVBench
from harness.checks.fabric import ITEM_NIC_FLAP, flap_recovery_verdict, placement_or_skip, skipped, ssh_nodes
from harness.faults import NicFlap

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.item("nic-flap", "nothing-lost"), pytest.mark.slow]

PERIOD_S, DUTY, COUNT = 2.0, 0.5, 3
PROBE_MIB, PROBE_REPEATS = 32, 2
LOAD_S = 60.0


def _kv_gbit(bench: KVBench, tokens: int) -> float:
    results = [bench.transfer_once(tokens) for _ in range(PROBE_REPEATS)]
    return sorted(r["bytes"] * 8 / r["seconds"] / 1e9 for r in results)[PROBE_REPEATS // 2]


def test_nic_flap_loses_nothing_and_kv_bandwidth_recovers(cluster, load, faults, timeline, conformance,
                                                         harness_options):
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
    recovery_limit = cluster.thresholds.threshold(ITEM_NIC_FLAP, "recovery_time_s").value
    run = load(duration_s=harness_options.load_duration or LOAD_S, max_tokens=32)
    with KVBench(Station.of(source), Station.of(victim), port=fabric.config.bench_port,
                 preset=cluster.spec.bundled.preset) as bench:
        tokens = bench.tokens_for(PROBE_MIB << 20)
        bench.transfer_once(tokens)  # warm-up
        baseline = _kv_gbit(bench, tokens)
        faults.inject(flap)
        transitions = flap.wait_done(faults.executor_factory(flap.host))
        faults.revert(flap)
        last_up = max((t for what, t in transitions if what == "off"), default=time.time())
        after: list[tuple[float, float]] = []
        while True:
            gbit = _kv_gbit(bench, tokens)
            after.append((time.time() - last_up, gbit))
            if gbit >= 0.95 * baseline or after[-1][0] > recovery_limit * 2:
                break
    records = run.finish()  # the faults are done: no new requests, the ones in flight end
    events = timeline.events()
    first_down = min((t for what, t in transitions if what == "on"), default=last_up)
    to_victim = [e for e in events if e["type"] == "kv_transfer" and e.get("decode") == victim_id
                 and first_down <= e["wall_time"] <= last_up + 5]
    flaps = {"target": flap.target, "period_s": PERIOD_S, "duty": DUTY, "count": COUNT,
             "transitions": [{"state": "down" if w == "on" else "up", "t_wall": t} for w, t in transitions],
             "probe_mib": PROBE_MIB,
             # what the engine did meanwhile: TCP rode out short outages, retries and the fallback path longer ones
             "kv_transfers_to_victim_during_flaps": {
                 "count": len(to_victim), "max_transfer_s": max((e["transfer_s"] for e in to_victim), default=None),
                 "retries": sum(e["retries"] for e in to_victim),
                 "fallbacks": sum(1 for e in to_victim if e["fallback"])}}
    conformance.record(flap_recovery_verdict(cluster.thresholds, baseline, after, flaps))

    finish_suite(conformance, cluster, records, ignore_eos=run.profile.ignore_eos, links=run_links(run),
                 faults=faults, events=events)


def _over_ssh(cluster, load, faults, timeline, conformance, harness_options, nodes) -> None:
    from harness.fabric.remote import bulk

    source, victim = nodes["source"], nodes["peer"]
    flap = NicFlap(device=victim.interface, host=victim.name, period_s=PERIOD_S, duty=DUTY, count=COUNT)
    if harness_options.dry_run:
        faults.inject(flap)
        faults.revert_all()
        conformance.record(skipped(cluster.thresholds, ITEM_NIC_FLAP, "dry run: the flaps were planned, not run"))
        return

    def gbit() -> float:
        runs = [bulk(source.station, victim.station, port=source.bench_port, seconds=2.0, allow_zero=True).bps
                for _ in range(PROBE_REPEATS)]
        return sorted(runs)[PROBE_REPEATS // 2] / 1e9

    recovery_limit = cluster.thresholds.threshold(ITEM_NIC_FLAP, "recovery_time_s").value
    run = load(duration_s=harness_options.load_duration or LOAD_S, max_tokens=32)
    baseline = gbit()
    faults.inject(flap)
    transitions = flap.wait_done(faults.executor_factory(flap.host))
    faults.revert(flap)
    last_up = max((t for what, t in transitions if what == "off"), default=time.time())
    after: list[tuple[float, float]] = []
    while True:
        after.append((time.time() - last_up, gbit()))
        if after[-1][1] >= 0.95 * baseline or after[-1][0] > recovery_limit * 2:
            break
    records = run.finish()
    flaps = {"target": flap.target, "period_s": PERIOD_S, "duty": DUTY, "count": COUNT, "over": "ssh",
             "transitions": [{"state": "down" if w == "on" else "up", "t_wall": t} for w, t in transitions],
             "probe": f"bulk TCP {source.name} -> {victim.name} on lossless port {source.bench_port}, 2 s, "
                      f"median of {PROBE_REPEATS}"}
    conformance.record(flap_recovery_verdict(cluster.thresholds, baseline, after, flaps))
    finish_suite(conformance, cluster, records, ignore_eos=run.profile.ignore_eos, links=run_links(run),
                 faults=faults, events=timeline.events())
