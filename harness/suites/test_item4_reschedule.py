"""Checklist item 6.1.4 (Section 6.1, "故障注入测试：Kill Prefill/Decode 进程，验证全局调度器在 3s 内完成重调度").

Under load, kill prefill and decode workers several times each (SIGKILL), then hang one of each
(SIGSTOP), and judge the distribution of rescheduling times (harness/checks/reschedule.py: from the
fault until the worker is declared down, every affected request is re-placed and a new request
succeeds) against the checklist's 3 s; the same faults measured from the client records alone
(harness/checks/reschedule_blackbox.py: streams on the victim ended, a new request served, the
longest stall clients saw) go into the verdict's evidence. Every request of the run must satisfy
the nothing-lost invariant. Each fault is reverted (killed workers restarted, hung ones resumed) before the next.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, Sequence

import pytest

from harness import dry_run
from harness.checks.epilogue import finish_suite, run_links
from harness.checks.reschedule import ITEM, FaultMark, affected_request_id, measure, reschedule_verdict
from harness.checks.reschedule_blackbox import (client_faults, client_view_evidence, client_view_verdict,
                                                first_success_sent_after, measure_client_view, same_run_baseline)
from harness.checks.verdict import Verdict, inconclusive
from harness.errors import FaultError, ProbeError
from harness.faults import FaultRunner, ProcessHang, ProcessKill, select_targets
from harness.probes import blackbox_faults as blackbox
from harness.probes.admin_models import EngineEvent, Worker
from harness.probes.records import RequestRecord
from harness.probes.rejoin import Rejoin
from harness.waiting import WaitTimeoutError, wait_until
from harness.clusterfile import ClusterHandle
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions
from harness.probes.load import LoadRunner

log = logging.getLogger(__name__)

# timeout: a hang guard sized for the default plan with room for --kills up to about 20
pytestmark = [pytest.mark.conformance, pytest.mark.item("6.1.4", "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(1800)]

# Every fault must happen under load, however long a restart takes on this machine; and no load
# run may be stopped (SIGTERM cancels its in-flight requests, which the nothing-lost check would
# rightly count as hung). So load comes in runs, a new one started, overlapping the old one, before
# the old one would end inside the next fault's cycle; after the last fault every run is finished
# (LoadRunner.finish: no new request, those in flight complete), not waited out.
CYCLE_BUDGET_S = {"process_kill": 20.0, "process_hang": 8.0}  # first guesses; then the longest seen
LOAD_RUN_S = 60.0           # length of one load run (--load-duration overrides)
BUSY_WAIT_S = 3.0           # wait at most this long for the target to hold requests before the fault
SETTLE_TIMEOUT_S = 15.0     # watch the router this long for one fault's rescheduling to finish
REJOIN_TIMEOUT_S = 120.0    # a killed worker restarts and registers (27-65 s seen on a loaded 2-core machine)
SERVING_TIMEOUT_S = 90.0    # Locust start-up on a loaded 2-core machine
WATCH_FACTOR = 1.25         # a worker not served through is watched this many times rejoin_limit_s
KEEP_LOAD_S = 10.0          # while a restarted worker is awaited, load for at least this long more
POLL_S = 0.1                 # polling the admin API only observes; measurements use event timestamps


def fault_plan(faults_per_kind: int, roles: Sequence[str] = ("prefill", "decode")) -> list[tuple[str, str]]:
    """``faults_per_kind`` kills of each role, then as many hangs of each (the checklist's
    min_faults_per_kind applies to every kind), for the roles that have a survivor."""
    kills = [("process_kill", r) for _ in range(faults_per_kind) for r in ("prefill", "decode") if r in roles]
    hangs = [("process_hang", r) for _ in range(faults_per_kind) for r in ("decode", "prefill") if r in roles]
    return kills + hangs


def lone_roles(workers: Sequence[Worker]) -> dict[str, str]:
    """Roles with fewer than two workers, each with why it cannot be judged: a fault on its only
    worker leaves nothing to take over, so rescheduling can never happen there."""
    out = {}
    for role in ("prefill", "decode"):
        ids = [w.id for w in workers if w.role == role]
        if len(ids) < 2:
            out[role] = (f"only one {role} worker ({ids[0]}): nothing can take over" if ids
                         else f"no {role} worker")
    return out


def make_fault(kind: str, worker: Mapping[str, object], cluster: ClusterHandle) -> ProcessKill | ProcessHang:
    if kind == "process_hang":
        return ProcessHang.from_worker(worker)
    topo = cluster.topology
    if topo is None:  # external cluster: nothing to restart with; the worker stays down (docs/clusters.md)
        return ProcessKill.from_worker(worker)
    return ProcessKill.from_worker(worker, restart=lambda wid: topo.restart(wid),
                                   healthy=lambda wid: _health(topo.workers(), wid) == "healthy",
                                   healthy_timeout_s=REJOIN_TIMEOUT_S)


def wait_served_through(timeline: Timeline, worker_id: str, since_seq: int, keep_load: Callable[[], None],
                        limit_s: float) -> Rejoin:
    """How ``worker_id`` came back after its revert: from when the router lists it healthy until the
    router serves through it (moves a request's KV through it: a ``kv_transfer`` event naming it),
    load kept flowing meanwhile. Watched past ``limit_s`` (WATCH_FACTOR x) so that a worker kept out
    shows as kept out for longer than the limit: a recovery finding under 6.1.4
    (harness/checks/reschedule.py rejoin_measurement)."""
    started = time.time()
    rejoin: Rejoin | None = None
    seq = since_seq
    while True:
        keep_load()
        now = time.time()
        if rejoin is None and _health(timeline.workers(), worker_id) == "healthy":
            rejoin = Rejoin(worker_id, limit_s, now, watched=["kv_transfer events of the router"],
                            kept_out_by="the router")
        if rejoin is not None:
            for e in timeline.events(since=seq, type="kv_transfer"):
                seq = max(seq, e["seq"])
                if worker_id in (e.get("prefill"), e.get("decode")):
                    rejoin.serving_wall = rejoin.traffic_wall = max(e["wall_time"], rejoin.healthy_wall)
                    rejoin.seen_by = rejoin.watched[0]
                    break
        since = now - (rejoin.healthy_wall if rejoin is not None else started)
        if (rejoin is not None and rejoin.back) or since > limit_s * WATCH_FACTOR:
            break
        time.sleep(POLL_S * 2)
    if rejoin is None:  # never even listed healthy again: kept out at least as long as it was watched
        rejoin = Rejoin(worker_id, limit_s, started, watched=["the router's worker table"], kept_out_by="the router")
    rejoin.watched_s = round(time.time() - rejoin.healthy_wall, 2)
    return rejoin


def _health(workers: list[Worker], worker_id: str) -> str | None:
    return next((w.health for w in workers if w.id == worker_id), None)


def _wait_busy(timeline: Timeline, worker_id: str) -> None:
    """Up to BUSY_WAIT_S for the target to hold requests; the fault goes ahead either way."""
    if not wait_until(lambda: any(w.id == worker_id and w.active_requests > 0 for w in timeline.workers()),
                      BUSY_WAIT_S, POLL_S, what=f"requests on {worker_id}", on_timeout="return"):
        log.info("%s held no request after %.0f s; faulting it anyway", worker_id, BUSY_WAIT_S)


class ContinuousLoad:
    """Chained load runs (see the comment on CYCLE_BUDGET_S); ``ensure(s)`` guarantees load for the
    next ``s`` seconds, ``records()`` finishes every run (LoadRunner.finish: requests in flight end,
    nothing new is sent) and merges their records."""

    def __init__(self, start_load: Load, run_s: float) -> None:
        self._start_load, self.run_s = start_load, run_s
        self.runs: list[LoadRunner] = []
        self.ends_at = 0.0  # monotonic time the newest run stops sending (conservative)

    def ensure(self, needed_s: float) -> None:
        if self.runs and self.ends_at - time.monotonic() >= needed_s:
            return
        run = self._start_load(duration_s=max(self.run_s, needed_s + 5.0), max_tokens=32)
        self.runs.append(run)
        _wait_serving(run, f"load run {len(self.runs)}")
        # its clock started at least one request ago, so this end estimate errs early
        self.ends_at = time.monotonic() + run.profile.duration_s - 1.0

    def records(self) -> list[RequestRecord]:
        # the faults are done: finish every run now (no new request, the ones in flight end) rather
        # than wait out the rest of its duration
        records = [r for run in self.runs for r in run.finish()]
        return sorted(records, key=lambda r: r.start_wall_ns())

    def links(self) -> list[str]:
        return run_links(*self.runs)


def _wait_settled(timeline: Timeline, worker_id: str, since_seq: int) -> int:
    """Until the router declared the worker down and every affected request was re-placed or
    failed (or SETTLE_TIMEOUT_S passed: the measurement then says what did not happen)."""
    last = since_seq
    seen: list[EngineEvent] = []

    def settled() -> bool:
        nonlocal last
        new = timeline.events(since=last)
        seen.extend(new)
        last = max([last] + [e["seq"] for e in new])
        down = next((e for e in seen if e["type"] == "worker_down" and e.get("worker") == worker_id), None)
        if down is None:
            return False
        pending = {affected_request_id(a) for a in down.get("affected", [])}
        return not pending - {e.get("request_id") for e in seen if e["type"] in ("reschedule", "reschedule_failed")}

    if not wait_until(settled, SETTLE_TIMEOUT_S, POLL_S, what=f"the rescheduling after the fault on {worker_id}",
                      on_timeout="return"):
        log.warning("rescheduling after the fault on %s did not settle within %.0f s", worker_id, SETTLE_TIMEOUT_S)
    return last


def test_killed_and_hung_workers_are_rescheduled_within_3s(cluster: ClusterHandle, load: Load, faults: FaultRunner,
                                                           timeline: Timeline, conformance: Conformance,
                                                           harness_options: HarnessOptions) -> None:
    if not cluster.admin_url:  # a foreign cluster: its inventory's processes, judged from the client
        _blackbox(cluster, load, faults, conformance, harness_options)
        return
    checklist = cluster.thresholds
    if harness_options.dry_run and dry_run.reads_no_admin_api(cluster):
        plan = fault_plan(harness_options.kills)
        conformance.show_plan([dry_run.unread_targets(cluster, kind, f"one {role} worker", f"fault {i + 1}/{len(plan)}")
                               for i, (kind, role) in enumerate(plan)])
        conformance.record(inconclusive(checklist, ITEM, f"dry run: {len(plan)} faults planned, none injected"))
        return
    lone = lone_roles(timeline.workers())
    plan = fault_plan(harness_options.kills, [r for r in ("prefill", "decode") if r not in lone])
    seed = harness_options.seed
    if not plan:
        conformance.record(inconclusive(checklist, ITEM, "not judged: " + "; ".join(lone.values()), not_judged=lone))
        return
    if harness_options.dry_run:
        for i, (kind, role) in enumerate(plan):  # prints each fault's plan; nothing is signalled
            faults.inject(make_fault(kind, select_targets(timeline.workers(), role, seed=seed + i)[0], cluster))
        faults.revert_all()
        item = checklist.item(ITEM)
        conformance.record(Verdict(item=ITEM, title=item.title, status="inconclusive",
                                   reason=f"dry run: {len(plan)} faults planned, none injected",
                                   evidence={"plan": [f"{k} {r}" for k, r in plan]}))
        return

    rejoin_limit = checklist.threshold(ITEM, "rejoin_limit_s").value
    traffic = ContinuousLoad(load, harness_options.load_duration or LOAD_RUN_S)
    seq = max([0] + [e["seq"] for e in timeline.events()])
    marks: list[FaultMark] = []
    rejoins: list[Rejoin] = []
    stopped: str | None = None
    cycle_s = dict(CYCLE_BUDGET_S)  # the longest fault cycle seen so far, per kind
    for i, (kind, role) in enumerate(plan):
        traffic.ensure(cycle_s[kind])
        cycle_started = time.monotonic()
        healthy = [w for w in timeline.workers() if w.healthy]
        target = select_targets(healthy, role, seed=seed + i)[0]
        _wait_busy(timeline, target["id"])
        fault = faults.inject(make_fault(kind, target, cluster))
        injected = next(r for r in faults.records if r.fault_id == fault.fault_id and r.action.value == "inject")
        marks.append(FaultMark(fault.fault_id, kind, target["id"], role, injected.started_wall,
                               inject_s=injected.duration_s))
        seq = _wait_settled(timeline, target["id"], seq)
        faults.revert(fault)  # a kill: restarted and registered; a hang: resumed
        rejoin = wait_served_through(timeline, target["id"], seq, lambda: traffic.ensure(KEEP_LOAD_S), rejoin_limit)
        rejoins.append(rejoin)
        cycle_s[kind] = max(cycle_s[kind], time.monotonic() - cycle_started)
        if not rejoin.back:  # the cluster is not whole: the next fault would be judged on a broken cluster
            stopped = f"the plan stopped after {i + 1} of {len(plan)} faults: {rejoin.sentence()}"
            break

    # what the item measures after the last fault (a request sent after it served) must have had
    # its chance before the load is finished
    _wait_success_after(traffic, marks[-1].wall)
    records = traffic.records()
    events = timeline.events()
    samples = measure(marks, events, records)
    verdict = reschedule_verdict(samples, checklist, rejoins=rejoins, not_judged=lone, stopped=stopped)
    # the same faults seen by the clients alone (the measurement a cluster without router events gets)
    verdict.evidence["client_view"] = client_view_evidence(measure_client_view(client_faults(marks), records))
    links = traffic.links()
    verdict.evidence.update(links=links, load_runs=len(traffic.runs), requests=len(records),
                            longest_fault_cycle_s={k: round(v, 2) for k, v in cycle_s.items()})
    conformance.record(verdict)

    finish_suite(conformance, cluster, records, ignore_eos=traffic.runs[0].profile.ignore_eos, links=links,
                 faults=faults, events=events)


def _wait_success_after(traffic: ContinuousLoad, wall: float) -> None:
    """Until a request sent after ``wall`` completed ok (or SETTLE_TIMEOUT_S passed: the measurement
    then says no request sent after the fault succeeded, which is then the cluster's doing)."""
    traffic.ensure(SETTLE_TIMEOUT_S)

    def served() -> bool:
        for run in traffic.runs:
            try:
                records = run.records()
            except ProbeError:  # a run that just started has written nothing yet
                continue
            if first_success_sent_after(records, wall) is not None:
                return True
        return False

    wait_until(served, SETTLE_TIMEOUT_S, 0.5, what="a request sent after the last fault to succeed",
               on_timeout="return")


BLACKBOX_LOAD_MAX_S = 3600.0  # upper bound of the load run; it is finished after the last fault
# after the last fault's revert the load goes on until a request sent after that fault was served (what
# 6.1.4 measures has had its chance), at most this long: one client-view fault window
BLACKBOX_TAIL_S = 30.0


def _blackbox(cluster: ClusterHandle, load: Load, faults: FaultRunner, conformance: Conformance,
              harness_options: HarnessOptions) -> None:
    """6.1.4 on a cluster without router events: the inventory's workers killed and hung under load
    (harness/probes/blackbox_faults.py), each back in the cluster's traffic before the next fault, judged
    from the client records alone (harness/checks/reschedule_blackbox.py): until the streams on the victim
    ended and a new request was served, the longest stall clients saw (a hang the cluster does not detect
    shows there), and how long the cluster kept each restarted worker out after it was healthy. A role with
    one worker is not faulted (nothing can take over); too few faults of a kind leave it inconclusive."""
    checklist = cluster.thresholds
    not_judged = blackbox.without_survivor(cluster.workers)
    steps = blackbox.plan(cluster.workers, harness_options.kills)
    roles = list(dict.fromkeys(role for _, role in steps))
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
        conformance.record(inconclusive(checklist, ITEM, f"dry run: {len(steps)} faults planned, none injected"
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
    run = load(duration_s=harness_options.load_duration or BLACKBOX_LOAD_MAX_S,
               max_tokens=workload.output_tokens if workload else 32)
    try:
        _wait_serving(run)
        done = blackbox.run_faults(cluster, faults, steps, seed=harness_options.seed, observe_s=observe_s,
                                   before_each=lambda: None if run.running else _load_ended(run))
        _serve_after_last_fault(run, done.faults[-1].wall if done.faults else None)
    finally:
        records = run.finish() if run.running else run.wait()
    samples = measure_client_view(done.faults, records)
    verdict = client_view_verdict(samples, checklist, rejoins=done.rejoins, roles=roles, not_judged=not_judged,
                                  stopped=done.stopped)
    links = run_links(run)
    verdict.evidence.update(links=links, requests=len(records), restart_s=done.restart_s,
                            plan=[f"{k} {r}" for k, r in steps],
                            same_run_baseline=same_run_baseline(done.faults, records, budget))
    conformance.record(verdict)
    finish_suite(conformance, cluster, records, expected=None, links=links, faults=faults)


def _serve_after_last_fault(run: LoadRunner, fault_wall: float | None) -> None:
    """Keep the load running until a request sent after the last fault was served (up to
    BLACKBOX_TAIL_S), so that "no request sent after the fault succeeded" is measured, not planned."""
    if fault_wall is None:
        return
    if not wait_until(lambda: not run.running or first_success_sent_after(run.records(), fault_wall) is not None,
                      BLACKBOX_TAIL_S, 1.0, what="a request sent after the last fault to be served",
                      on_timeout="return"):
        log.warning("no request sent after the last fault was served within %.0f s", BLACKBOX_TAIL_S)


def _wait_serving(run: LoadRunner, what: str = "the load") -> None:
    """Until ``run`` completed a request (its records file has a line)."""
    def served() -> bool:
        if run.records_path.exists() and run.records_path.stat().st_size > 0:
            return True
        if not run.running:
            raise ProbeError(f"{what} ended before it served a request",
                             fix=f"check the cluster answers; see the Locust log: {run.log_path}")
        return False

    try:
        wait_until(served, SERVING_TIMEOUT_S, POLL_S, what=f"{what} to serve a request")
    except WaitTimeoutError as exc:
        raise ProbeError(f"{what} served no request within {SERVING_TIMEOUT_S:.0f} s",
                         fix=f"check the cluster answers; see the Locust log: {run.log_path}") from exc


def _load_ended(run: LoadRunner) -> None:
    raise ProbeError(f"the load run ended before the faults were done (Locust log: {run.log_path})",
                     fix="raise --load-duration, or see the Locust log for why it stopped")
