"""The harness's pytest fixtures, registered by the plugin (harness/plugin.py, ``pytest_plugins``).

``harness_options``, ``cluster`` (session: bundled clusters are started, external ones attached;
the test machine's health is sampled while it is up), ``conformance`` (record verdicts, gated by
the machine's health, latency, events into the report), ``faults`` (a FaultRunner that
refuses faults the cluster's safety settings forbid and reverts everything when the test ends),
``load`` (start Locust load against the cluster), ``timeline`` (router events), and the autouse
capability gate of the conformance suites.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol, TextIO

import pytest

from harness.conformance import MACHINE, Conformance
from harness.errors import HarnessError
from harness.plugin_state import MARKER, HarnessOptions, harness_state, show, show_line

if TYPE_CHECKING:  # imported where used: the plugin loads this module before any test needs them
    from harness.checklists import Checklist
    from harness.cluster import ClusterHandle
    from harness.faults import FaultRunner
    from harness.engine.admin.models import EngineEvent, AdminWorker
    from harness.probes.workers.gpu_hosts import HostGpuWatch
    from harness.probes.loadgen.load import LoadRunner
    from harness.probes.machine_health.machine import MachineMonitor
    from harness.signals import SignalOwner



@pytest.fixture(scope="session")
def harness_options(pytestconfig: pytest.Config) -> HarnessOptions:
    return harness_state(pytestconfig).options


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[ClusterHandle]:
    """The cluster under test (a :class:`harness.cluster.ClusterHandle`) for the whole session.
    Before anything starts, what a dead run left is reverted and ended (the ledger's faults, its
    stopped or stray processes, its namespaces): see harness.faults.session.recover_before_bringup."""
    from harness.cluster import open_cluster
    from harness.clusterfile import load_cluster
    from harness.faults.runs import RunRecord
    from harness.faults.session import recover_before_bringup

    state = harness_state(pytestconfig)
    spec = state.spec or load_cluster(state.options.cluster)
    recover_before_bringup(spec.name, say=lambda line: show(pytestconfig, line), dry_run=state.options.dry_run)
    verb = "bringing up" if spec.kind == "bundled" else "attaching to"
    show(pytestconfig, f"[bold]{verb} cluster {spec.name}[/] ({spec.kind}, {spec.path})")
    t0 = time.monotonic()
    log_dir = state.options.report_dir / state.result.run_id / "artifacts" / "cluster-logs"
    run = RunRecord(spec.name, spec.kind) if spec.kind == "bundled" else None
    with open_cluster(spec, state.checklist, log_dir=log_dir if spec.kind == "bundled" else None, run=run,
                      send=not state.options.dry_run) as handle:
        handle.run = run
        state.result.cluster = handle.describe()
        state.result.capabilities = handle.capabilities().to_dict()
        if state.live is not None and not state.options.dry_run:  # a dry run scrapes nothing
            state.live.set_cluster(handle.metrics_url, handle)
        if state.options.dry_run and spec.kind == "external":
            show(pytestconfig, f"cluster {spec.name}: dry run, {handle.api_url} not contacted")
        else:
            show(pytestconfig, f"cluster {spec.name} ready in {time.monotonic() - t0:.1f} s: {handle.api_url}")
        gpus = _watch_host_gpus(pytestconfig, handle)
        machine = _watch_machine(pytestconfig)
        try:
            yield handle
        finally:
            machine.stop()
            del pytestconfig.stash[MACHINE]
            state.result.machine = _machine_record(machine)
            if gpus is not None:  # the hosts' GPU state again: what moved during the run goes in the report
                gpus.finish()
                state.result.environment.update(gpus.environment())
                state.result.cluster["gpu_readings"] = state.result.environment.pop("gpu_readings", None)
    if run is not None:
        run.close()  # torn down cleanly: nothing for a later run to clean up


def _watch_host_gpus(config: pytest.Config, handle: ClusterHandle) -> HostGpuWatch | None:
    """GPU state of the cluster's SSH hosts when it is attached (harness/probes/workers/gpu_hosts.py); None
    without SSH hosts or in a dry run (it runs commands on the hosts)."""
    from harness.faults.ledger import state_dir
    from harness.probes.workers.gpu_hosts import HostGpuWatch

    if harness_state(config).options.dry_run:
        return None
    watch = HostGpuWatch(handle, state_dir() / "audit.jsonl")
    if not watch.active:
        return None
    show(config, "reading the GPUs of the cluster's hosts (nvidia-smi over SSH)")
    watch.start()
    return watch


def _watch_machine(config: pytest.Config) -> MachineMonitor:
    """The test machine's health (CPU pressure, the load generator's and engine's run-queue wait,
    timer lag) sampled until the cluster's session ends: harness/probes/machine_health/machine.py."""
    from harness.probes.machine_health.machine import MachineMonitor

    monitor = MachineMonitor().start()
    config.stash[MACHINE] = monitor
    return monitor


def _machine_record(monitor: MachineMonitor) -> dict[str, Any]:
    """``results.json``'s ``machine``: the limits and the run's samples, at most 300 points."""
    from harness.checks.machine import LIMITS

    return {"interval_s": monitor.interval_s, "cpus": monitor.cpus, "psi_note": monitor.psi_note,
            "limits": LIMITS.to_dict(), "samples": monitor.series(300)}


@pytest.fixture(scope="session")
def checklist(cluster: ClusterHandle) -> Checklist:
    """The run's thresholds: checklists/section6.yaml parsed into its model with the cluster file's
    overrides applied, the one Checklist the cluster was opened with. Suites hand it to the checks
    unchanged (docs/architecture.md, "One threshold's path: 6.1.4")."""
    return cluster.thresholds


@pytest.fixture
def conformance(request: pytest.FixtureRequest) -> Conformance:
    return Conformance(request.config, request.node.nodeid)


@pytest.fixture(autouse=True)
def _capability_gate(request: pytest.FixtureRequest) -> None:
    """Before a suite's body (and its other fixtures) run: if the cluster lacks a capability its
    items need (``pytest.mark.item``), record each item inconclusive with the reason; skip the body."""
    if request.node.get_closest_marker(MARKER) is None:
        return
    from harness.checks.capabilities import gate

    missing = gate(request.node, request.getfixturevalue)
    if missing:
        pytest.skip(f"the cluster lacks {', '.join(missing)}")


class _LiveOutput:
    """A text stream that shows each line on the terminal at once, past pytest's capture (dry-run
    plans must be seen while the suite runs, not only in a failure report)."""

    def __init__(self, config: pytest.Config) -> None:
        self._config, self._buf = config, ""

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            show_line(self._config, line)
        return len(text)

    def flush(self) -> None:
        pass


def make_fault_runner(cluster: ClusterHandle, *, dry_run: bool = False, state_dir: str | Path | None = None,
                      out: TextIO | None = None, signals: SignalOwner | None = None) -> FaultRunner:
    """A FaultRunner for ``cluster`` (a ClusterHandle) that refuses, before touching anything, every
    fault the cluster's safety settings do not allow (production clusters: all but those listed)."""
    from harness.faults import Fault, FaultRunner, Ledger
    from harness.hosts import ExecutorPool

    class SafeFaultRunner(FaultRunner):
        def inject(self, fault: Fault) -> Fault:
            if self.dry_run:  # the plan says what safety would do; a dry run changes nothing either way
                from harness.dry_run import PREFIX, safety_word

                self._say(f"{PREFIX} {fault.kind} {fault.target}: {safety_word(cluster.spec, fault.kind)}")
            else:
                cluster.check_fault_allowed(fault.kind)
            return super().inject(fault)

        def inject_many(self, kind: str, jobs: Any, **kwargs: Any) -> list[Fault]:
            if not self.dry_run:  # a dry run's inject says it per fault
                cluster.check_fault_allowed(kind)
            return super().inject_many(kind, jobs, **kwargs)

    class ClusterExecutors(ExecutorPool):
        def __call__(self, host: str | None) -> Any:
            key = host or "localhost"
            if key not in self.ssh and (target := cluster.ssh_target(key)) is not None:
                self.ssh[key] = target
            elif key not in self.ssh and cluster.this_machine(key):
                self.local.add(key)
            return super().__call__(host)

    pool = ClusterExecutors(dry_run=dry_run, out=out)
    run = getattr(cluster, "run", None)
    return SafeFaultRunner(Ledger.for_cluster(cluster.name, state_dir), pool, dry_run=dry_run, out=out,
                           signals=signals, context=run.context() if run is not None else None)


@pytest.fixture
def faults(cluster: ClusterHandle, harness_options: HarnessOptions, conformance: Conformance,
           pytestconfig: pytest.Config) -> Iterator[FaultRunner]:
    """A FaultRunner bound to the cluster (see :func:`make_fault_runner`); records every activity
    into the report and reverts whatever is still active when the test ends, however it ends."""
    import tempfile

    from rich.markup import escape

    # a dry run changes nothing and writes nothing where it runs (issue 37): its ledger is a temporary one
    scratch = tempfile.TemporaryDirectory(prefix="harness-dry-run-") if harness_options.dry_run else None
    runner = make_fault_runner(cluster, dry_run=harness_options.dry_run, out=_LiveOutput(pytestconfig),
                               signals=harness_state(pytestconfig).signals,
                               state_dir=None if scratch is None else scratch.name)
    styles = {"succeeded": "green", "failed": "bold red", "dry_run": "yellow"}
    if (live := harness_state(pytestconfig).live) is not None:
        runner.listeners.append(live.fault_event)
    verbose = pytestconfig.getoption("verbose", 0) > 0

    def step(rec: Any) -> None:
        # each step with -v; without it only a failed one (the main job printed 151 step lines among its
        # 327, issue 37): the report's ledger and the live panel show every step
        if verbose or rec.status.value == "failed":
            show(pytestconfig, f"  fault {rec.action.value:<15} {rec.kind} {escape(rec.target)}: "
                               f"[{styles.get(rec.status.value, '')}]{rec.status.value}[/] ({rec.duration_s:.2f} s)")

    runner.listeners.append(step)
    try:
        with runner:
            yield runner
    finally:
        conformance.add_fault_records(runner.records)
        # every step on the timeline: all of them for a suite stopped before its epilogue (a signal, a
        # crash), else the ones after it (a revert in this teardown)
        if missing := conformance.missing_fault_records(runner.records):
            from harness.probes.client.timeline import merge_timeline

            conformance.add_timeline(merge_timeline(faults=missing, seen_events=conformance.seen_events))
        if scratch is not None:
            scratch.cleanup()


class Load(Protocol):
    """The ``load`` fixture: ``load(duration_s=..., max_tokens=...)`` (any LoadProfile field over the
    options' profile) starts a Locust run against the cluster and returns its running LoadRunner."""

    def __call__(self, **overrides: Any) -> LoadRunner: ...


@pytest.fixture
def load(cluster: ClusterHandle, harness_options: HarnessOptions, conformance: Conformance,
         request: pytest.FixtureRequest) -> Iterator[Load]:
    """``load(**profile_overrides)`` starts a Locust run against the cluster (LoadProfile from the
    options); every run is stopped and reaped when the test ends."""
    from harness.faults.ledger import state_dir
    from harness.hosts import AuditLog
    from harness.probes.loadgen.load import LoadRunner
    from harness.probes.loadgen.load_distributed import runner_for
    from harness.probes.loadgen.workload import LoadProfile, workload_profile

    runs: list[LoadRunner] = []

    def start(**overrides: Any) -> LoadRunner:
        o = harness_options
        base: dict[str, Any] = {"users": o.load_users, "seed": o.seed, "duration_s": o.load_duration or 30.0,
                                "model": cluster.model, "engine": cluster.engine}
        if o.load_rate is not None:
            base.update(mode="poisson", rate=o.load_rate)
        base.update(workload_profile(getattr(cluster, "workload", None), overrides))
        profile = LoadProfile(**{**base, **overrides})
        # the cluster file's load_hosts: a Locust worker on each over SSH (else Locust here)
        runner = runner_for(cluster.spec, cluster.api_url, profile, api_key=cluster.api_key(),
                            output_dir=conformance.artifact_dir(f"{request.node.name}-load{len(runs)}"),
                            audit=AuditLog(state_dir() / "audit.jsonl"))
        runs.append(runner)
        conformance.load_runs.append(runner)
        runner.start()
        if (live := harness_state(request.config).live) is not None:
            live.add_load(runner)
        return runner

    from harness.signals import deferred

    try:
        yield start
    finally:
        with deferred():  # a second Ctrl-C must not leave Locust sending to the cluster
            for runner in runs:
                runner.stop()


class Timeline:
    """Router events of the cluster under test (bundled or any engine with the admin API); without
    one, events (extra evidence) are empty and ``workers()`` says what would provide a table."""

    def __init__(self, cluster: ClusterHandle) -> None:
        self._cluster = cluster

    @property
    def available(self) -> bool:
        return bool(self._cluster.admin_url)

    def events(self, since: int = 0, type: str | None = None) -> list[EngineEvent]:  # noqa: A002 (the API's name)
        from harness.engine.admin.client import AdminClient

        if not self.available:
            return []
        with AdminClient(self._cluster.admin_url) as client:
            return client.events(since=since, type=type)

    def workers(self) -> list[AdminWorker]:
        from harness.engine.admin.client import AdminClient

        if not self.available:
            raise HarnessError(f"cluster {self._cluster.name!r} has no admin endpoint: no live worker table",
                               fix="set endpoints.admin in the cluster file, or mark the suite with the "
                                   "capability it needs (pytest.mark.item(..., needs=[\"admin_api\"]))")
        with AdminClient(self._cluster.admin_url) as client:
            return client.workers()


@pytest.fixture
def timeline(cluster: ClusterHandle) -> Timeline:
    return Timeline(cluster)
