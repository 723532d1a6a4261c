"""ECC poisoning of KV pages (seed 5.1 Layer 2: "ECC 错误计数 / HBM 永久故障 Page → 标记 Page 为 poison").

Under load, poison KV blocks of a busy decode worker several times (blocks of running requests
first, so each poisoning bites), through the engine's fault hook, until one more than the
checklist's ``min_poisonings`` hit a running request (a poisoning lands on free blocks when the
worker's requests all ended since its last heartbeat; it is kept as evidence and another is tried,
up to three tries a hit). Each fault is verified (the
worker reports the blocks' memory poisoned), held while the worker keeps serving and its
``kv_blocks_quarantined`` is polled, then reverted (the "replaced page" returns, zeroed) and the
next poisoning waits until the router's table shows the revert. Judged
by harness/checks/ecc.py: poisoned blocks stay out of service while poisoned, every request on
them completes token-exactly; and the run's nothing-lost invariant. An engine that ignores the
page-retirement signal (clusters/local-no-ecc.yaml) fails both.

What this exercises, honestly: the engine's handling of a page the node agent marked bad. It
does not make a GPU raise an ECC error (REFERENCE.md: DCGM injection only fakes monitoring).

On a real cluster (no admin API) with DCGM on its hosts (`hosts[].dcgm`, `workers[].gpus`), a
double-bit ECC error is injected into one worker's GPU monitoring (`dcgmi test --inject`) under
load, and that worker must be drained within the checklist's time (harness/checks/ecc_dcgm.py):
the cluster's monitoring and health path, not the memory (:func:`_through_dcgm`).
"""

from __future__ import annotations

import logging
import random
import time

import pytest

from harness import dry_run
from harness.checks.capabilities import dcgm_workers
from harness.checks.ecc import ITEM, Poisoning, ecc_verdict, judge_outcomes
from harness.checks.ecc_dcgm import WHAT_IT_EXERCISES, dcgm_verdict
from harness.checks.verdict import inconclusive
from harness.cluster import ClusterHandle
from harness.errors import FaultError
from harness.faults import DcgmInject, EccPoison, FaultRunner
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions
from harness.engine.admin.models import AdminWorker
from harness.probes.metrics.prometheus import ENGINE_PROFILES
from harness.probes.client.records import RequestRecord
from harness.scenarios.ecc_dcgm import DcgmDrainUnderLoad
from harness.suites.epilogue import expectation, finish_suite, run_links
from harness.waiting import WaitTimeoutError, wait_until
from harness.states import EventKind, WorkerRole

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.item("ecc", "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(900)]

BLOCKS_PER_POISONING = 2
HOLD_S = 2.0     # the worker keeps serving this long with the blocks poisoned
CYCLE_S = 6.0    # load budget per poisoning
MAX_TRIES_PER_BITE = 3  # poisonings tried per one that must hit a running request, at most
POLL_S = 0.1
REVERT_SEEN_S = 5.0  # a heartbeat after the revert reaches the router's table (they go every second)


def _healthy_decodes(timeline: Timeline) -> list[AdminWorker]:
    return [w for w in timeline.workers() if w.role == WorkerRole.DECODE and w.healthy]


def _busy_decode(timeline: Timeline, deadline_s: float = 20.0,
                 skip: frozenset[str] = frozenset()) -> AdminWorker | None:
    """The healthy decode worker running the most requests, once one runs any (none in ``skip``);
    None after ``deadline_s``."""
    try:
        return wait_until(lambda: max((w for w in _healthy_decodes(timeline) if w.id not in skip),
                                      key=lambda w: w.num_running, default=None),
                          deadline_s, POLL_S, what="a decode worker running requests",
                          accept=lambda busy: busy is not None and busy.num_running > 0)
    except WaitTimeoutError:
        return None


def test_poisoned_kv_pages_are_quarantined_and_never_served(cluster: ClusterHandle, load: Load, faults: FaultRunner,
                                                            timeline: Timeline, conformance: Conformance,
                                                            harness_options: HarnessOptions) -> None:
    if not timeline.available:  # a real cluster: an ECC error injected into its GPU monitoring (DCGM)
        _through_dcgm(cluster, load, faults, conformance, harness_options)
        return
    checklist = cluster.thresholds
    item = checklist.item(ITEM)
    if harness_options.dry_run and dry_run.reads_no_admin_api(cluster):
        conformance.show_plan([dry_run.unread_targets(cluster, "ecc_poison", "each healthy decode worker",
                                                      f"{BLOCKS_PER_POISONING} blocks poisoned while it decodes")])
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: the poisonings were planned, none injected"))
        return
    if harness_options.dry_run:  # print the poisoning's plan on each decode worker
        for w in _healthy_decodes(timeline):
            faults.inject(EccPoison(admin_url=cluster.admin_url, worker_id=w.id, count=BLOCKS_PER_POISONING))
        faults.revert_all()
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: the poisonings were planned, none injected"))
        return
    n = int(item.thresholds["min_poisonings"].value) + 1  # poisonings that hit a running request
    tries = MAX_TRIES_PER_BITE * n  # one can miss: the worker's requests may all end before it lands
    duration = harness_options.load_duration or tries * CYCLE_S + 20.0  # a budget: it ends when they are done
    run = load(duration_s=duration, max_tokens=128)
    poisonings: list[Poisoning] = []
    unsettled: set[str] = set()   # workers whose last revert never showed in the table: not poisoned again
    started = time.monotonic()
    for i in range(tries):
        if sum(1 for p in poisonings if p.affected) >= n:
            break
        if not run.running or time.monotonic() - started > duration - CYCLE_S:
            log.warning("load ends soon: stopping after %d poisonings", i)
            break
        if unsettled and not any(w.id not in unsettled for w in _healthy_decodes(timeline)):
            log.warning("no decode worker left whose last revert was seen (%s): stopping after %d poisonings",
                        ", ".join(sorted(unsettled)), i)
            break
        target = _busy_decode(timeline, skip=frozenset(unsettled))
        if target is None:
            continue
        try:
            fault = faults.inject(EccPoison(admin_url=cluster.admin_url, worker_id=target.id,
                                            count=BLOCKS_PER_POISONING))
        except FaultError as exc:  # e.g. its requests finished in between; the runner reverted it
            log.warning("poisoning %d did not take: %s", i, exc)
            continue
        p = Poisoning(target.id, list(fault.reply["blocks"]), list(fault.reply.get("affected") or []),
                      quarantined_at_injection=fault.reply.get("kv_blocks_quarantined"))
        p.min_quarantined = p.quarantined_at_injection  # the worker's own count, as it poisoned
        held_until = time.monotonic() + HOLD_S
        while time.monotonic() < held_until:
            w = next((w for w in timeline.workers() if w.id == target.id), None)
            seen = w.kv_blocks_quarantined if w is not None else 0
            p.min_quarantined = seen if p.min_quarantined is None else min(p.min_quarantined, seen)
            time.sleep(POLL_S)
        faults.revert(fault)
        # until a heartbeat after the revert reaches the router's table, the table shows this
        # poisoning: the next one's verify would pass on it and its poll read this one's state
        p.revert_seen = fault.revert_seen(REVERT_SEEN_S)
        if not p.revert_seen:   # a late heartbeat could land in a next poisoning's hold on this worker
            unsettled.add(target.id)
            log.warning("the revert of %s on %s did not show in the router's table within %g s: that worker is "
                        "not poisoned again (its readings could predate the next fault)", fault.fault_id,
                        target.id, REVERT_SEEN_S)
        poisonings.append(p)
    records = run.finish()  # the faults are done: no new requests, the ones in flight end
    expected = expectation(cluster, ignore_eos=run.profile.ignore_eos)

    def exact(rec: RequestRecord) -> bool | None:
        want = expected(rec) if expected else None
        return None if want is None else rec.token_ids == want

    judge_outcomes(poisonings, records, exact)
    verdict = ecc_verdict(poisonings, checklist)
    links = run_links(run)
    verdict.evidence.update(links=links, load_duration_s=duration)
    conformance.record(verdict)
    finish_suite(conformance, cluster, records, expected=expected, links=links, faults=faults,
                 events=timeline.events(type=EventKind.FAULT_STATE))


def _through_dcgm(cluster: ClusterHandle, load: Load, faults: FaultRunner, conformance: Conformance,
                  harness_options: HarnessOptions) -> None:
    """ecc on a real cluster: a double-bit ECC error injected into one worker's GPU monitoring through
    DCGM under load (harness/scenarios/ecc_dcgm.py); judged on whether the cluster drains that worker."""
    checklist = cluster.thresholds
    worker = random.Random(harness_options.seed).choice(dcgm_workers(cluster.spec))
    host = next(h for h in cluster.spec.hosts if h.name == worker.host)
    scenario = DcgmDrainUnderLoad(
        worker, host.dcgm.dcgmi, checklist.threshold(ITEM, "drain_after_injection_s").value, faults, load,
        running_family=ENGINE_PROFILES.get(cluster.spec.metric_profile or "", {}).get("requests_running"),
        auth_headers=cluster.auth_headers(), load_s=harness_options.load_duration)
    if harness_options.dry_run:
        scenario.rehearse()
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: the ECC injection was planned, not made",
                                        plan=scenario.plan, what_this_exercises=WHAT_IT_EXERCISES))
        return
    if not scenario.drain_visible:
        conformance.record(inconclusive(
            checklist, ITEM, f"{worker.name} has neither a health URL nor metrics with a running-requests gauge: "
                             "a drain could not be seen (set workers[].health or workers[].metrics)",
            plan=scenario.plan))
        return
    try:
        cluster.check_fault_allowed(DcgmInject.kind)
    except FaultError as exc:
        conformance.record(inconclusive(checklist, ITEM, f"not judged on this cluster: {exc}", plan=scenario.plan))
        return
    done = scenario.run()
    if done.injection is None:
        conformance.record(inconclusive(checklist, ITEM, f"the ECC injection could not be made: {done.not_made}", code="not_made",
                                        plan=scenario.plan))
        return
    verdict = dcgm_verdict([done.injection], checklist)
    links = run_links(done.load_run)
    verdict.evidence.update(links=links, plan=scenario.plan)
    conformance.record(verdict)
    finish_suite(conformance, cluster, done.records, ignore_eos=done.load_run.profile.ignore_eos, links=links,
                 faults=faults)
