"""Checklist item 6.1.4 (Section 6.1, "故障注入测试：Kill Prefill/Decode 进程，验证全局调度器在 3s 内完成重调度").

Under load, kill prefill and decode workers several times each (SIGKILL), then hang one of each
(SIGSTOP), and judge the distribution of rescheduling times (harness/checks/reschedule.py: from the
fault until the worker is declared down, every affected request is re-placed and a new request
succeeds) against the checklist's 3 s; the same faults measured from the client records alone
(harness/checks/reschedule_blackbox.py: streams on the victim ended, a new request served, the
longest stall clients saw) go into the verdict's evidence. Every request of the run must satisfy
the nothing-lost invariant. Each fault is reverted (killed workers restarted, hung ones resumed) before the next.

The faults under load are driven by harness/scenarios/reschedule.py (router events) and
harness/scenarios/reschedule_blackbox.py (a foreign cluster); this module wires them to the
fixtures and judges what they return.
"""

from __future__ import annotations

import pytest

from harness import dry_run
from harness.checks.reschedule import ITEM, measure, reschedule_verdict
from harness.checks.reschedule_blackbox import (client_faults, client_view_evidence, client_view_verdict,
                                                measure_client_view, same_run_baseline)
from harness.checklists import Checklist
from harness.checks.verdict import inconclusive
from harness.cluster import ClusterHandle
from harness.errors import FaultError
from harness.faults import FaultRunner
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions
from harness.scenarios import blackbox_faults as blackbox
from harness.scenarios.reschedule import LOAD_RUN_S, RescheduleUnderLoad, fault_plan, lone_roles
from harness.scenarios.reschedule_blackbox import LOAD_MAX_S, BlackboxRescheduleUnderLoad
from harness.suites.epilogue import finish_suite, run_links
from harness.states import PD_ROLES

# timeout: a hang guard sized for the default plan with room for --kills up to about 20
pytestmark = [pytest.mark.conformance, pytest.mark.item("6.1.4", "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(1800)]


def test_killed_and_hung_workers_are_rescheduled_within_3s(cluster: ClusterHandle, checklist: Checklist, load: Load,
                                                           faults: FaultRunner, timeline: Timeline,
                                                           conformance: Conformance,
                                                           harness_options: HarnessOptions) -> None:
    if not cluster.admin_url:  # a foreign cluster: its inventory's processes, judged from the client
        _blackbox(cluster, checklist, load, faults, conformance, harness_options)
        return
    if harness_options.dry_run and dry_run.reads_no_admin_api(cluster):
        plan = fault_plan(harness_options.kills)
        conformance.show_plan([dry_run.unread_targets(cluster, kind, f"one {role} worker", f"fault {i + 1}/{len(plan)}")
                               for i, (kind, role) in enumerate(plan)])
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason=f"dry run: {len(plan)} faults planned, none injected"))
        return
    lone = lone_roles(timeline.workers())
    plan = fault_plan(harness_options.kills, [r for r in PD_ROLES if r not in lone])
    if not plan:
        conformance.record(inconclusive(checklist, ITEM, "not judged: " + "; ".join(lone.values()), not_judged=lone))
        return
    scenario = RescheduleUnderLoad(faults, timeline, load, cluster.topology, plan, seed=harness_options.seed,
                                   rejoin_limit_s=checklist.threshold(ITEM, "rejoin_limit_s").value,
                                   load_run_s=harness_options.load_duration or LOAD_RUN_S)
    if harness_options.dry_run:
        scenario.rehearse()  # prints each fault's plan; nothing is signalled
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason=f"dry run: {len(plan)} faults planned, none injected",
                                        plan=[f"{k} {r}" for k, r in plan]))
        return

    done = scenario.run()
    verdict = reschedule_verdict(measure(done.marks, done.events, done.records), checklist, rejoins=done.rejoins,
                                 not_judged=lone, stopped=done.stopped)
    # the same faults seen by the clients alone (the measurement a cluster without router events gets)
    verdict.evidence["client_view"] = client_view_evidence(measure_client_view(client_faults(done.marks), done.records))
    links = run_links(*done.load_runs)
    verdict.evidence.update(links=links, load_runs=len(done.load_runs), requests=len(done.records),
                            longest_fault_cycle_s=done.longest_cycle_s)
    conformance.record(verdict)
    finish_suite(conformance, cluster, done.records, ignore_eos=done.load_runs[0].profile.ignore_eos, links=links,
                 faults=faults, events=done.events)


def _blackbox(cluster: ClusterHandle, checklist: Checklist, load: Load, faults: FaultRunner, conformance: Conformance,
              harness_options: HarnessOptions) -> None:
    """6.1.4 on a cluster without router events: the inventory's workers killed and hung under load
    (harness/scenarios/reschedule_blackbox.py), each back in the cluster's traffic before the next fault,
    judged from the client records alone (harness/checks/reschedule_blackbox.py): until the streams on the
    victim ended and a new request was served, the longest stall clients saw (a hang the cluster does not
    detect shows there), and how long the cluster kept each restarted worker out after it was healthy. A
    role with one worker is not faulted (nothing can take over); too few faults of a kind leave it
    inconclusive."""
    not_judged = blackbox.without_survivor(cluster.workers)
    steps = blackbox.plan(cluster.workers, harness_options.kills)
    budget = checklist.threshold(ITEM, "reschedule_p100_s").value
    observe_s = budget + 2.0  # the cluster must cope alone for longer than the budget
    if harness_options.dry_run:
        safety = [dry_run.safety_word(cluster.spec, kind) for kind, _ in steps]
        described = blackbox.describe_plan(cluster.workers, steps, blackbox.HANG_S, observe_s)
        lines = [f"{kind} {i + 1}/{len(steps)}: {line} [{word}]"
                 for i, (line, (kind, _), word) in enumerate(zip(described, steps, safety))]
        lines += [f"not faulted: {why}" for why in not_judged.values()]
        conformance.show_plan(lines)
        refused = sum(word.startswith("REFUSED") for word in safety)
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason=f"dry run: {len(steps)} faults planned, none injected"
                                        + (f" ({refused} refused by the cluster's safety settings)" if refused else ""),
                                        plan=lines))
        return
    if not steps:  # every role has a single worker (or none can be faulted): nothing to judge, say why
        why = "; ".join(not_judged.values()) or "no worker of the inventory can be faulted"
        conformance.record(inconclusive(checklist, ITEM, f"not judged on this cluster: {why}",
                                        not_judged=not_judged))
        return
    try:  # a production cluster refuses the faults: say so before any load is sent, never crash
        for kind in sorted({k for k, _ in steps}):
            cluster.check_fault_allowed(kind)
    except FaultError as exc:
        conformance.record(inconclusive(checklist, ITEM, f"not judged on this cluster: {exc}",
                                        plan=[f"{k} {r}" for k, r in steps]))
        return
    workload = cluster.workload
    done = BlackboxRescheduleUnderLoad(cluster, faults, load, steps, seed=harness_options.seed, observe_s=observe_s,
                                       rejoin_limit_s=checklist.threshold(ITEM, "rejoin_limit_s").value,
                                       load_s=harness_options.load_duration or LOAD_MAX_S,
                                       max_tokens=workload.output_tokens if workload else 32).run()
    verdict = client_view_verdict(measure_client_view(done.faults.faults, done.records), checklist,
                                  rejoins=done.faults.rejoins, roles=list(dict.fromkeys(role for _, role in steps)),
                                  not_judged=not_judged, stopped=done.faults.stopped)
    links = run_links(done.load_run)
    verdict.evidence.update(links=links, requests=len(done.records), restart_s=done.faults.restart_s,
                            plan=[f"{k} {r}" for k, r in steps],
                            same_run_baseline=same_run_baseline(done.faults.faults, done.records, budget))
    conformance.record(verdict)
    finish_suite(conformance, cluster, done.records, expected=None, links=links, faults=faults)
