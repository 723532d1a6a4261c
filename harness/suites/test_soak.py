"""Soak: hours, not minutes (issue 27; docs/soak.md). Only with ``--soak=DURATION``.

Load runs for the whole duration (the ``load`` fixture's profile, closed loop unless --load-rate)
while a fault schedule, drawn from ``--soak-seed`` and the cluster's inventory before the run
(harness/scenarios/soak_schedule.py), fires the faults the cluster allows: kills, hangs, HBM fills,
ECC poisonings and, on the emulated fabric, NIC flaps and PFC storms, overlapping up to the blast
radius (``soak.faults`` max_role_share_down). The same seed on the same inventory replays the same
schedule; ``--dry-run`` prints it, and results.json keeps it under ``soak.schedule``.

Judged (harness/checks/soak.py, harness/checks/leaks.py): every fault by its item's rule
(``soak.faults``), TTFT/TPOT per window and over the whole run (``soak.slo``), KV blocks, memory,
file descriptors and threads of every engine process across the faults (``soak.leaks``), and
nothing lost over every request of the run, token-exact.
"""

from __future__ import annotations

import logging

import pytest

from harness.checks.leaks import leak_verdict
from harness.checks.invariants import check_history
from harness.checks.reschedule import FirstSuccess, measure_with
from harness.checks.soak import FAULTS_ITEM, SLO_ITEM, faults_verdict, slo_windows_verdict
from harness.checks.verdict import inconclusive
from harness.checklists import Checklist
from harness.cluster import ClusterHandle

from harness.errors import FaultError
from harness.faults import FaultRunner
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions, harness_state, show_line
from harness.probes.leaks import read_samples
from harness.probes.record_digest import RecordDigest
from harness.scenarios.soak import SoakUnderLoad
from harness.scenarios.soak_schedule import KINDS, eligible_kinds, generate
from harness.suites.epilogue import expectation, finish_streamed, run_links

log = logging.getLogger(__name__)

ITEMS = (FAULTS_ITEM, SLO_ITEM, "soak.leaks")
pytestmark = [pytest.mark.conformance, pytest.mark.item(*ITEMS, "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(0)]   # as long as --soak says; the soak bounds every wait itself


def _inventory(cluster: ClusterHandle, timeline: Timeline, live: bool) -> list[tuple[str, str]]:
    if live and timeline.available:
        return [(w.id, str(w.role)) for w in timeline.workers()]
    bundled = getattr(cluster.spec, "bundled", None)
    if bundled is not None:   # a dry run: the ids the bundled engine will give its workers
        return [(f"{role}-{i}", role) for role, n in (("prefill", bundled.prefill), ("decode", bundled.decode))
                for i in range(n)]
    return [(w.id, str(w.role)) for w in cluster.workers]


def test_soak(cluster: ClusterHandle, checklist: Checklist, load: Load, faults: FaultRunner, timeline: Timeline,
              conformance: Conformance, harness_options: HarnessOptions, pytestconfig: pytest.Config) -> None:
    opts = harness_options
    if opts.soak_s is None:
        pytest.skip("the soak runs only when asked: pass --soak=DURATION (e.g. --soak=30m; docs/soak.md)")
    state = harness_state(pytestconfig)

    def say(line: str) -> None:
        show_line(pytestconfig, f"[soak] {line}")
        log.info("%s", line)

    if not opts.dry_run and not timeline.available:
        for item in ITEMS:
            conformance.record(inconclusive(checklist, item, "not judged: the soak needs the router's events and "
                                            "worker table (the bundled engine's admin API); this cluster has none"))
        return
    allowed = []
    for kind in eligible_kinds(None, fabric=cluster.fabric is not None):
        try:
            cluster.check_fault_allowed(kind)
            allowed.append(kind)
        except FaultError as exc:
            say(f"{kind} left out: {exc}")
    share = checklist.threshold(FAULTS_ITEM, "max_role_share_down").value
    seed = opts.seed if opts.soak_seed is None else opts.soak_seed
    schedule = generate(seed, _inventory(cluster, timeline, live=not opts.dry_run), opts.soak_s, allowed,
                        faults_per_min=opts.soak_faults_per_min, max_role_share=share)
    state.result.soak["schedule"] = schedule.to_dict()
    for line in schedule.lines():
        say(line)
    if opts.dry_run:
        for item in ITEMS:
            conformance.record(inconclusive(checklist, item, f"dry run: {len(schedule.faults)} faults scheduled "
                                            f"(seed {seed}), none injected", plan=schedule.lines()))
        return

    window_s = opts.soak_window_s or min(checklist.threshold(SLO_ITEM, "window_s").value, opts.soak_s / 3)
    placement = cluster.fabric.placement(cluster.topology.worker_ids()) if cluster.fabric is not None else {}
    scenario = SoakUnderLoad(faults, timeline, load, schedule, cluster.admin_url, topology=cluster.topology,
                             fabric_hosts=placement,
                             rejoin_limit_s=checklist.threshold(FAULTS_ITEM, "rejoin_limit_s").value,
                             out_dir=opts.report_dir / state.result.run_id / "artifacts" / "soak", progress=say)
    conformance.phase("soak")
    run = scenario.run()
    marks = [m for o in run.outcomes if (m := o.mark()) is not None]
    # one pass over the records on disk: nothing-lost checks each (token ids and all) as the digest
    # keeps the few figures the timing checks need (a 10-hour run's records never sit in memory)
    digest = RecordDigest()
    history = check_history(digest.observe(run.iter_records()),
                            expectation(cluster, ignore_eos=run.load_runs[0].profile.ignore_eos))
    say(f"{len(digest)} request records read from disk ({digest.nbytes() / 2**20:.1f} MB of figures kept)")
    samples = measure_with(marks, run.events, FirstSuccess(digest.successes()))
    fv, judged = faults_verdict(checklist, run.outcomes, samples, stopped=run.stopped, schedule=schedule.to_dict())
    sv = slo_windows_verdict(checklist, digest, run.started_wall, run.load_ended_wall, window_s)
    lv = leak_verdict(checklist, read_samples(run.leak_samples_path), idle_before=run.idle_before,
                      idle_after=run.idle_after)
    links = run_links(*run.load_runs)
    for v in (fv, sv, lv):
        v.evidence.update(links=links, requests=len(digest), soak_s=opts.soak_s, seed=seed)
        conformance.record(v, windows=[(run.started_wall, run.load_ended_wall)])
    state.result.soak.update(outcomes=[j.to_dict() for j in judged], by_kind=fv.evidence["by_kind"],
                             windows=sv.evidence["windows"], leaks=lv.evidence, requests=len(digest),
                             started=run.started_wall, load_ended=run.load_ended_wall,
                             leak_samples=str(run.leak_samples_path), kinds=sorted(KINDS))
    say(f"{len(digest)} requests; {fv.status.value}: {fv.reason}")
    finish_streamed(conformance, cluster, history, digest, links=links, faults=faults, events=run.events)
