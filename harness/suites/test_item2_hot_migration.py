"""Checklist item 6.1.2 (Section 6.1, "热迁移 TTFT 增量：空载下迁移增加 < 50ms，满载下 < 200ms").

Live-migrate decoding streams between decode workers through the admin API (the same path the
health decision flow and a planned drain use), first on an idle cluster (one stream at a time),
then under full Locust load, and judge what each migration added to its stream's next-token
delay (harness/checks/migration.py) against the checklist's 50 ms / 200 ms. Every request of the
run must satisfy the nothing-lost invariant: migrated streams stay token-exact.

On an engine without that API that resumes a stream elsewhere when its worker is lost (Dynamo's
request migration; cluster file `migration: {on_worker_loss: true}`), workers of the cluster file's
inventory are killed while the harness's streams decode on them, and the crossing is judged from the
client alone (harness/checks/migration_blackbox.py, :func:`_on_worker_loss`).

Victims are the harness's own streams (harness/scenarios/migration.py): each is watched chunk by
chunk, and the migration of that very request is asked for off the worker its chunks name as soon
as it has MIGRATE_AFTER_TOKENS tokens, so the source is never guessed from a heartbeat that may
come after a short stream ended. A stream the harness could not catch mid-decode is *unmeasured*,
not a failed migration: the phase takes another victim (at most MAX_ATTEMPTS_FACTOR x the
required count); each phase ends as soon as it has its required measured migrations, or, while its
median delta's 95 % interval straddles the limit, more up to the checklist's ``max_migrations_*``
(harness/checks/extend.py); the Locust load is then finished without cutting its requests in flight.

On the bundled cluster everything shares two CPU cores: the loaded figure includes the load
generator's and the other workers' CPU time, as a real full-load migration includes contention.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import pytest

from harness.checks.extend import repeat_until_decided
from harness.checks.migration import ITEM, assess, measure, migration_verdict
from harness.checklists import Threshold
from harness.checks.verdict import Verdict, inconclusive
from harness.cluster import ClusterHandle
from harness.errors import FaultError, ProbeError
from harness.faults import FaultRunner
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions
from harness.engine.admin.models import EngineEvent, AdminWorker
from harness.probes.loadgen.load import LoadRunner
from harness.evidence.migration import MigrationAttempt
from harness.scenarios.migration import migrate_observed_stream
from harness.probes.client.records import RequestRecord
from harness.suites.epilogue import finish_suite, run_links
from harness.waiting import WaitTimeoutError, wait_until
from harness.states import EventKind, WorkerRole

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.item("6.1.2", "nothing-lost"), pytest.mark.slow, pytest.mark.timeout(900)]

MIGRATE_AFTER_TOKENS = 24  # migrate once a stream has this many tokens (a steady inter-token gap exists)
TOKENS_AFTER = 96          # tokens the stream still decodes after the migration is asked for
MAX_ATTEMPTS_FACTOR = 3    # victims tried per required migration before the phase gives up
LOADED_MAX_S = 240.0       # upper bound of the load run; it is finished as soon as the phase is done
LOADED_MAX_TOKENS = 160    # the Locust requests' length


def _decode_workers(timeline: Timeline) -> list[AdminWorker]:
    return [w for w in timeline.workers() if w.role == WorkerRole.DECODE and w.healthy]


class _Phase:
    """Victims of one phase, one at a time, until ``need`` migrations are measured or refused, or too
    many were tried."""

    def __init__(self, name: str, cluster: ClusterHandle, timeline: Timeline, need: int,
                 faults: FaultRunner | None = None) -> None:
        self.name, self.cluster, self.timeline, self.need, self.faults = name, cluster, timeline, need, faults
        self.attempts: list[MigrationAttempt] = []
        self.records: list[RequestRecord] = []

    def run(self, still_loaded: Callable[[], bool] = lambda: True) -> None:
        for i in range(len(self.attempts), self.need * MAX_ATTEMPTS_FACTOR):  # a later run continues
            refused = sum(a.outcome == "refused" for a in self.attempts)  # certain failures: enough evidence
            if self._measured() + refused >= self.need or not still_loaded():
                break
            attempt, rec = migrate_observed_stream(
                self.cluster.api_url, self.cluster.admin_url, phase=self.name, index=i,
                prompt=f"Hot migration, {self.name} cluster, stream {i}:",
                max_tokens=MIGRATE_AFTER_TOKENS + TOKENS_AFTER, after_tokens=MIGRATE_AFTER_TOKENS,
                faults=self.faults)  # each migration is a live_migration fault: safety-checked, in the ledger
            self.attempts.append(attempt)
            self.records.append(rec)
            log.info("6.1.2 %s stream %d: %s %s", self.name, i, attempt.outcome, attempt.detail)

    def _measured(self) -> int:
        """Measured migrations so far: asks the router's events once per finished victim."""
        if not any(a.outcome == "migrated" for a in self.attempts):
            return 0
        phase_of = {a.request_id: self.name for a in self.attempts if a.outcome == "migrated"}
        samples = measure(self.timeline.events(type=EventKind.MIGRATION_RESUMED), self.records, phase_of)
        return assess(self.attempts, samples, self.records).measured(self.name)


def _until_decided(t: Mapping[str, Threshold], phase: str, judge: Callable[[], Verdict], more: Callable[[int], None],
                   measured: Callable[[], int]) -> dict[str, object]:
    """Run a phase to its min_migrations, then more while its median delta straddles the limit (up
    to max_migrations); ``more(k)`` adds k measured migrations. Returns the extension evidence."""
    (verdict,) = repeat_until_decided(lambda: [judge()], more, measured, first=int(t[f"min_migrations_{phase}"].value),
                                      most=int(t[f"max_migrations_{phase}"].value), noun=f"{phase} migrations")
    return verdict.evidence["extension"]


def _wait_for_load(timeline: Timeline, run: LoadRunner, timeout_s: float = 90.0) -> None:
    """Until Locust's users keep requests in flight on the decode workers (ends as soon as they do)."""
    def in_flight() -> int:
        if not run.running:
            raise ProbeError(f"the load run ended before it reached the decode workers "
                             f"(Locust log tail: {run.log_tail(500)!r})", fix="see the Locust and router logs")
        return sum(w.active_requests for w in _decode_workers(timeline))

    try:
        wait_until(in_flight, timeout_s, 0.05, what="requests in flight on the decode workers",
                   accept=lambda n: n >= 2)
    except WaitTimeoutError as exc:
        raise ProbeError(f"the load did not reach the decode workers within {timeout_s:.0f} s "
                         f"(Locust log tail: {run.log_tail(500)!r})", fix="see the Locust and router logs") from exc


def test_hot_migration_ttft_delta(cluster: ClusterHandle, load: Load, faults: FaultRunner, timeline: Timeline,
                                  conformance: Conformance, harness_options: HarnessOptions) -> None:
    if not timeline.available:  # no admin API: the engine migrates streams when their worker is lost
        _on_worker_loss(cluster, load, faults, conformance, harness_options)
        return
    checklist = cluster.thresholds
    t = checklist.item(ITEM).thresholds
    if harness_options.dry_run:  # no fault to plan: migrations go through the admin API
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: no stream was migrated"))
        return
    if len(_decode_workers(timeline)) < 2:
        conformance.record(inconclusive(checklist, ITEM, "live migration needs at least two healthy decode workers"))
        return
    try:  # migrations change the cluster: a production cluster must allow them first
        cluster.check_fault_allowed("live_migration")
    except FaultError as exc:
        conformance.record(inconclusive(checklist, ITEM, f"refused: {exc}"))
        return
    idle, loaded = (_Phase(p, cluster, timeline, 0, faults) for p in ("idle", "loaded"))

    def judged(events: list[EngineEvent] | None = None) -> Verdict:
        attempts, victims = idle.attempts + loaded.attempts, idle.records + loaded.records
        phase_of = {a.request_id: a.phase for a in attempts if a.outcome == "migrated" and a.request_id}
        events = timeline.events(type=EventKind.MIGRATION_RESUMED) if events is None else events
        return migration_verdict(assess(attempts, measure(events, victims, phase_of), victims), checklist=checklist)

    def extend(phase: _Phase, still_loaded: Callable[[], bool] = lambda: True) -> dict[str, object]:
        def more(k: int) -> None:
            phase.need = phase._measured() + k
            phase.run(still_loaded)
        return _until_decided(t, phase.name, judged, more, phase._measured)

    extended = {"idle": extend(idle)}
    duration = harness_options.load_duration or LOADED_MAX_S
    run = load(duration_s=duration, max_tokens=LOADED_MAX_TOKENS)
    try:
        _wait_for_load(timeline, run)
        extended["loaded"] = extend(loaded, still_loaded=lambda: run.running)
    finally:
        load_records = run.finish() if run.running else run.wait()
    events = timeline.events()
    attempts = idle.attempts + loaded.attempts
    records = idle.records + loaded.records + load_records
    verdict = judged(events)
    links = run_links(run)
    verdict.evidence.update(links=links, load_duration_limit_s=duration, requests=len(records),
                            attempts=[a.to_dict() for a in attempts], extension=extended)
    conformance.record(verdict)

    finish_suite(conformance, cluster, records, ignore_eos=True, links=links, events=events,
                 event_filter=lambda e: e["type"].startswith("migration"))


STREAMS_PER_WORKER = 2     # the harness's streams per worker of the killed role, started before each kill
KILL_OBSERVE_S = 5.0       # a kill is held this long: the engine must move the streams by itself
LOSS_TOKENS_AFTER = 320    # tokens a stream still wants after the kill (it must outlive the kill's set-up)


def _on_worker_loss(cluster: ClusterHandle, load: Load, faults: FaultRunner, conformance: Conformance,
                    harness_options: HarnessOptions) -> None:
    """6.1.2 from the client on an engine that migrates on worker loss (see the module doc)."""
    from harness.checks.migration_blackbox import DEFINITION, measure as measure_crossings
    from harness.scenarios import blackbox_faults as blackbox
    from harness.probes.metrics.metrics_source import source_label
    from harness.scenarios.migration_on_loss import kill_role, kill_under_streams

    checklist = cluster.thresholds
    t = checklist.item(ITEM).thresholds
    need = {p: int(t[f"min_migrations_{p}"].value) for p in ("idle", "loaded")}
    role = kill_role(cluster.workers)
    streams = STREAMS_PER_WORKER * sum(str(w.role) == role for w in cluster.workers)
    plan = blackbox.describe_plan(cluster.workers, [("process_kill", role)], blackbox.HANG_S, KILL_OBSERVE_S)
    plan = [f"per kill ({need['idle']}+ idle, {need['loaded']}+ loaded migrations): {streams} streams decoding, then "
            + plan[0]]
    if harness_options.dry_run:
        from harness.dry_run import safety_word

        conformance.show_plan([f"{plan[0]} [{safety_word(cluster.spec, 'process_kill')}]"])
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: no worker was killed", plan=plan))
        return
    try:
        cluster.check_fault_allowed("process_kill")
    except FaultError as exc:
        conformance.record(inconclusive(checklist, ITEM, f"not judged on this cluster: {exc}", plan=plan))
        return
    windows, victims, load_records, links = [], [], [], []

    def measured(name: str) -> int:
        return measure_crossings([w for w in windows if w.phase == name], victims).measured(name)

    def phase(name: str, still_loaded: Callable[[], bool] = lambda: True) -> dict[str, object]:
        def more(k: int) -> None:
            need[name] = measured(name) + k
            kills(name, still_loaded)
        return _until_decided(t, name, lambda: migration_verdict(measure_crossings(windows, victims),
                                                                 checklist=checklist), more, lambda: measured(name))

    def kills(name: str, still_loaded: Callable[[], bool]) -> None:
        while sum(w.phase == name for w in windows) < need[name] * MAX_ATTEMPTS_FACTOR:
            assessed = measure_crossings([w for w in windows if w.phase == name], victims)
            if assessed.measured(name) + len(assessed.failures) >= need[name] or not still_loaded():
                return
            window, recs = kill_under_streams(cluster, faults, phase=name, index=len(windows),
                                              seed=harness_options.seed, streams=streams,
                                              after_tokens=MIGRATE_AFTER_TOKENS, tokens_after=LOSS_TOKENS_AFTER,
                                              observe_s=KILL_OBSERVE_S)
            windows.append(window)
            victims.extend(recs)

    failed_kill, extended = None, {}
    try:  # a worker the cluster file names but the host cannot find or bring back: say so, never crash
        extended["idle"] = phase("idle")
        run = load(duration_s=harness_options.load_duration or LOADED_MAX_S, max_tokens=LOADED_MAX_TOKENS)
        try:
            extended["loaded"] = phase("loaded", still_loaded=lambda: run.running)
        finally:
            load_records = run.finish() if run.running else run.wait()
            links = run_links(run)
    except FaultError as exc:  # the fault runner has reverted what it injected
        failed_kill = exc
    if failed_kill is not None:
        verdict = inconclusive(checklist, ITEM, f"a kill could not be made or undone: {failed_kill}", code="not_made", plan=plan,
                               kills=len(windows))
    else:
        # every stream in flight at a kill, the load's too: the engine's migration counter counts them all, so
        # the streams that crossed are the ones with the largest stalls among all of them, not only the harness's
        verdict = migration_verdict(measure_crossings(windows, victims + load_records), checklist=checklist)
        verdict.evidence.update(definition=DEFINITION, links=links, plan=plan, kills=len(windows),
                                migration_counter=[w.migrations for w in windows], extension=extended,
                                metrics_source=source_label(cluster))
    conformance.record(verdict)
    finish_suite(conformance, cluster, victims + load_records, ignore_eos=True, links=links, faults=faults)
