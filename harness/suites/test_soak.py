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

On a cluster without the bundled engine's admin API (vLLM, NVIDIA Dynamo, any external cluster) the
soak runs on its cluster file (harness/scenarios/soak_view.py ExternalView): black-box kills and hangs
of the workers' processes, each judged from the client's records; leak readings from /proc on each
worker's host and the engine's KV metric; the kinds it cannot inject are named as left out.
"""

from __future__ import annotations

import logging

import pytest

from harness.checks.leaks import leak_verdict
from harness.checks.invariants import check_history
from harness.checks.reschedule import FirstSuccess, measure_with
from harness.checks.reschedule_blackbox import client_view_evidence
from harness.checks.soak import FAULTS_ITEM, SLO_ITEM, faults_verdict, slo_windows_verdict
from harness.checks.soak_client_view import ClientViewKeeper
from harness.checks.verdict import inconclusive
from harness.checklists import Checklist
from harness.cluster import ClusterHandle

from harness.errors import FaultError
from harness.faults import FaultRunner
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions, harness_state, show_line
from harness.probes.workers.leaks import read_samples
from harness.probes.client.record_digest import RecordDigest
from harness.scenarios.soak import SoakUnderLoad
from harness.scenarios.soak_schedule import KINDS, generate, left_out_because
from harness.scenarios.soak_view import CLIENT_VIEW, AdminView, ExternalView, SoakClusterView
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
    # an external cluster: the workers of its file whose process can be found (the others cannot be faulted)
    return [(str(w.name), str(w.role)) for w in cluster.workers if w.process is not None]


def _kinds(cluster: ClusterHandle, has_admin: bool) -> tuple[list[str], dict[str, str]]:
    """The kinds to schedule, and each kind left out with why: what the cluster lacks for it (the
    fabric, the admin API), its safety settings, or (a kill on an external cluster) a worker with no
    way back."""
    allowed, left_out = [], {}
    lone = [str(w.name) for w in cluster.workers if w.process is not None and not w.restartable]
    for kind in KINDS:
        why = left_out_because(kind, fabric=cluster.fabric is not None, admin=has_admin)
        if why is None and kind == "process_kill" and not has_admin and lone:
            why = (f"{', '.join(lone)} cannot be brought back (no `restart:` and not `supervised: true` in the "
                   "cluster file)")
        if why is None:
            try:
                cluster.check_fault_allowed(kind)
            except FaultError as exc:
                why = str(exc)
        if why is None:
            allowed.append(kind)
        else:
            left_out[kind] = why
    return allowed, left_out


def _unfaultable(cluster: ClusterHandle) -> str | None:
    """Why the soak cannot fault this cluster without an admin API at all (None: it can)."""
    if cluster.spec.bundled is not None:
        return "the bundled engine's admin API did not answer"
    if not any(w.process is not None for w in cluster.workers):
        return ("its cluster file names no worker process (`process: {pid_file | pgrep | systemd_unit}` under "
                "`workers:`), so no worker can be killed, hung or read in /proc")
    return None


def test_soak(cluster: ClusterHandle, checklist: Checklist, load: Load, faults: FaultRunner, timeline: Timeline,
              conformance: Conformance, harness_options: HarnessOptions, pytestconfig: pytest.Config) -> None:
    opts = harness_options
    if opts.soak_s is None:
        pytest.skip("the soak runs only when asked: pass --soak=DURATION (e.g. --soak=30m; docs/soak.md)")
    state = harness_state(pytestconfig)

    def say(line: str) -> None:
        show_line(pytestconfig, f"[soak] {line}")
        log.info("%s", line)

    has_admin = timeline.available if not opts.dry_run else (cluster.spec.bundled is not None or
                                                             bool(cluster.admin_url))
    why_not = None if has_admin else _unfaultable(cluster)
    if why_not:
        for item in ITEMS:
            conformance.record(inconclusive(checklist, item, f"not judged: {why_not}"))
        return
    allowed, left_out = _kinds(cluster, has_admin)
    for kind, why in left_out.items():
        say(f"{kind} left out: {why}")
    share = checklist.threshold(FAULTS_ITEM, "max_role_share_down").value
    seed = opts.seed if opts.soak_seed is None else opts.soak_seed
    schedule = generate(seed, _inventory(cluster, timeline, live=not opts.dry_run), opts.soak_s, allowed,
                        faults_per_min=opts.soak_faults_per_min, max_role_share=share)
    state.result.soak["schedule"] = schedule.to_dict()
    state.result.soak["left_out"] = left_out
    for line in schedule.lines():
        say(line)
    if opts.dry_run:
        for item in ITEMS:
            conformance.record(inconclusive(checklist, item, code="dry_run", reason=f"dry run: {len(schedule.faults)} faults scheduled "
                                            f"(seed {seed}), none injected", plan=schedule.lines()))
        return

    window_s = opts.soak_window_s or min(checklist.threshold(SLO_ITEM, "window_s").value, opts.soak_s / 3)
    view: SoakClusterView
    if has_admin:
        placement = cluster.fabric.placement(cluster.topology.worker_ids()) if cluster.fabric is not None else {}
        view = AdminView(timeline, cluster.admin_url or "", topology=cluster.topology, fabric_hosts=placement)
    else:   # the cluster file, the engine's metrics and the workers' pid files (docs/soak.md)
        view = ExternalView(cluster, faults.executor_factory)
    scenario = SoakUnderLoad(faults, view, load, schedule,
                             rejoin_limit_s=checklist.threshold(FAULTS_ITEM, "rejoin_limit_s").value,
                             out_dir=opts.report_dir / state.result.run_id / "artifacts" / "soak", progress=say)
    conformance.phase("soak")
    try:
        run = scenario.run()
    finally:
        view.close()
    marks = [m for o in run.outcomes if (m := o.mark()) is not None]
    # one pass over the records on disk: nothing-lost checks each (token ids and all) as the digest
    # keeps the few figures the timing checks need (a 10-hour run's records never sit in memory); without
    # router events, the records around each kill or hang are kept slim for the client's view of it
    digest = RecordDigest()
    keeper = ClientViewKeeper(marks) if run.judged_by == CLIENT_VIEW else None
    stream = digest.observe(run.iter_records())
    history = check_history(stream if keeper is None else keeper.observe(stream),
                            expectation(cluster, ignore_eos=run.load_runs[0].profile.ignore_eos))
    say(f"{len(digest)} request records read from disk ({digest.nbytes() / 2**20:.1f} MB of figures kept"
        + ("" if keeper is None else f"; {len(keeper.kept)} kept slim for the client view of the faults") + ")")
    if keeper is None:
        samples, by_id = measure_with(marks, run.events, FirstSuccess(digest.successes())), None
    else:
        samples, by_id = [], keeper.samples()
    fv, judged = faults_verdict(checklist, run.outcomes, samples, stopped=run.stopped, schedule=schedule.to_dict(),
                                by_fault_id=by_id, judged_by=run.judged_by)
    if by_id is not None:
        fv.evidence["client_view"] = client_view_evidence(list(by_id.values()))
    sv = slo_windows_verdict(checklist, digest, run.started_wall, run.load_ended_wall, window_s,
                             planned_s=opts.soak_s, steal_bursts=conformance.steal_bursts())
    lv = leak_verdict(checklist, read_samples(run.leak_samples_path), idle_before=run.idle_before,
                      idle_after=run.idle_after, kv_unmeasured=run.kv_unmeasured, requests=len(digest))
    links = run_links(*run.load_runs)
    for v in (fv, sv, lv):
        v.evidence.update(links=links, requests=len(digest), soak_s=opts.soak_s, seed=seed, left_out=left_out)
        conformance.record(v, windows=[(run.started_wall, run.load_ended_wall)])
    state.result.soak.update(outcomes=[j.to_dict() for j in judged], by_kind=fv.evidence["by_kind"],
                             windows=sv.evidence["windows"], leaks=lv.evidence, requests=len(digest),
                             started=run.started_wall, load_ended=run.load_ended_wall,
                             leak_samples=str(run.leak_samples_path), kinds=sorted(KINDS))
    say(f"{len(digest)} requests; {fv.status.value}: {fv.reason}")
    finish_streamed(conformance, cluster, history, digest, links=links, faults=faults, events=run.events)
