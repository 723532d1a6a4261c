"""pytest plugin: conformance options, session fixtures, verdict collection and the report.

Loaded through the ``pytest11`` entry point (or the root ``conftest.py`` in a checkout). It only
acts -- loads the cluster file, brings the cluster up, writes the report, maps the exit code --
when tests marked ``conformance`` are collected (``suites/``), so ``pytest tests/`` is unaffected.

Fixtures: ``harness_options``, ``cluster`` (session: bundled clusters are started, external ones
attached), ``conformance`` (record verdicts, latency, events into the report), ``faults`` (a
FaultRunner that refuses faults the cluster's safety settings forbid and reverts everything when
the test ends), ``load`` (start Locust load against the cluster), ``timeline`` (router events).
Exit codes (docs/exit-codes.md): 0 conformant, 1 not, 2 inconclusive, 3 harness error, 4 revert failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from harness.checks.verdict import ExitCode, Status, Verdict, exit_code_for
from harness.errors import ConfigError, HarnessError, RevertError
from harness.report import RunResult, collect_environment, new_run_id

log = logging.getLogger(__name__)

MARKER = "conformance"


class _Invalid:
    """An option value that failed its check. Kept (not raised) so the run can exit with code 3,
    the harness-error code, instead of pytest's usage-error code 4 (our "revert failed")."""

    def __init__(self, message: str) -> None:
        self.message = message


def _number(kind: type, minimum: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            return _Invalid(f"{what}: {text!r} is not a{'n integer' if kind is int else ' number'}")
        if value < minimum:
            return _Invalid(f"{what}: {text!r} must be >= {minimum:g}")
        return value
    parse.__name__ = what
    return parse


def _non_empty(text: str) -> Any:
    return text if text.strip() else _Invalid("--cluster: empty value")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "PD conformance harness")
    group.addoption("--cluster", default="local", type=_non_empty,
                    help="cluster name (clusters/NAME.yaml) or path to a cluster YAML file (default: local)")
    group.addoption("--report-dir", default="reports", help="where reports/<run-id>/ is written (default: reports)")
    group.addoption("--dry-run", action="store_true", default=False,
                    help="print what each fault would do instead of doing it (verdicts become inconclusive)")
    group.addoption("--load-users", default=4, type=_number(int, 1, "--load-users"),
                    help="concurrent load users (the in-flight cap in open loop; default 4)")
    group.addoption("--load-rate", default=None, type=_number(float, 0.001, "--load-rate"),
                    help="open-loop (Poisson) request rate per second; default: closed loop")
    group.addoption("--load-duration", default=None, type=_number(float, 1, "--load-duration"),
                    help="seconds of load per suite test (default: as long as the test's faults need)")
    group.addoption("--kills", default=3, type=_number(int, 1, "--kills"),
                    help="kills per worker role in fault suites (default 3)")
    group.addoption("--harness-seed", default=0, type=_number(int, 0, "--harness-seed"),
                    help="seed for load prompts, arrivals and fault target selection (default 0)")
    group.addoption("--live", default="auto", type=_live_mode,
                    help="live progress while suites run: rich (a panel), plain (a status line every 10 s and "
                         "at each change), off; default auto: rich on a terminal, plain otherwise")


def _live_mode(text: str) -> Any:
    from harness.report.live import MODES

    return text if text in MODES else _Invalid(f"--live: {text!r} is not one of {', '.join(MODES)}")


@dataclass(frozen=True)
class HarnessOptions:
    cluster: str
    report_dir: Path
    dry_run: bool
    load_users: int
    load_rate: float | None
    load_duration: float | None
    kills: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "report_dir": str(self.report_dir), "dry_run": self.dry_run,
                "load_users": self.load_users, "load_rate": self.load_rate, "load_duration": self.load_duration,
                "kills": self.kills, "harness_seed": self.seed}


@dataclass
class HarnessState:
    options: HarnessOptions
    result: RunResult
    active: bool = False
    config_error: str | None = None
    run_dir: Path | None = None
    spec: Any = None  # ClusterSpec once loaded
    verdicts_by_test: dict[str, list[Verdict]] = field(default_factory=dict)
    live: Any = None  # harness.report.live.LiveStatus once suites were collected
    terminal: Any = None  # a duplicate of the terminal's stdout, taken before any capture
    signals: Any = None   # harness.faults.session.RunSignals once conformance suites were collected


STATE = pytest.StashKey[HarnessState]()


def _state(config: pytest.Config) -> HarnessState:
    return config.stash[STATE]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a Section 6.1 conformance suite test")
    config.addinivalue_line("markers", "item(*item_ids, needs=None): the checklist items a suite judges; a cluster "
                                       "lacking what they need gets them inconclusive (harness/checks/capabilities.py)")
    # the suites' own marks, registered here too: outside a checkout there is no pyproject.toml to do it
    config.addinivalue_line("markers", "slow: end-to-end tests that start processes, clusters or browsers")
    config.addinivalue_line("markers", "root: needs root and iproute2 (network namespaces, tc)")
    names = ("cluster", "report_dir", "dry_run", "load_users", "load_rate", "load_duration", "kills", "harness_seed")
    values = {n: config.getoption(n) for n in names}
    bad = [v.message for v in [*values.values(), config.getoption("live")] if isinstance(v, _Invalid)]
    if bad:
        pytest.exit("harness option error: " + "; ".join(bad) + " (fix: pass a valid value, see `pytest --help`)",
                    returncode=int(ExitCode.HARNESS_ERROR))
    report_dir = Path(values["report_dir"])
    if not report_dir.is_absolute():
        report_dir = Path(config.invocation_params.dir) / report_dir
    options = HarnessOptions(values["cluster"], report_dir, values["dry_run"], values["load_users"],
                             values["load_rate"], values["load_duration"], values["kills"], values["harness_seed"])
    state = HarnessState(options, RunResult(run_id=new_run_id(), started=time.time(), options=options.to_dict()))
    config.stash[STATE] = state
    config.pluginmanager.register(_CollectionWatcher(state), "harness-collection-watcher")
    from harness.report.live import LivePhases

    config.pluginmanager.register(LivePhases(lambda: state.live, MARKER), "harness-live-phases")
    with contextlib.suppress(OSError, ValueError):  # capture is suspended here: fd 1 is the real stdout
        state.terminal = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None and state.signals is not None:
        state.signals.restore()
    if state is not None:
        if state.live is not None:
            state.live.close()
        if state.terminal is not None:
            state.terminal.close()


class _CollectionWatcher:
    """A broken suite file is a harness error even though none of its tests was collected."""

    def __init__(self, state: HarnessState) -> None:
        self.state = state

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed and "suites" in Path(report.nodeid.split("::")[0]).parts:
            self.state.active = True
            self.state.result.harness_errors.append(f"collection error in {report.nodeid}: "
                                                    f"{report.longreprtext[-500:]}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = _state(config)
    if not any(item.get_closest_marker(MARKER) for item in items) and not state.active:
        return
    state.active = True
    from harness.checks.capabilities import check_item_markers
    from harness.cluster import check_before_start, load_cluster

    what = "cluster file"
    try:  # checked in full here, before anything starts (no namespace, no process)
        state.spec = load_cluster(state.options.cluster)
        check_before_start(state.spec)
        what = "suite marker"  # pytest.mark.item naming an unknown item or capability
        check_item_markers(items, state.spec.checklist())
    except ConfigError as exc:
        state.config_error = str(exc)
        _print(config, f"[bold magenta]{what} error:[/] {exc}")
        pytest.exit(f"{what} error: {exc}", returncode=int(ExitCode.HARNESS_ERROR))
    state.result.cluster = {"name": state.spec.name, "kind": state.spec.kind, "path": state.spec.path}
    from harness.faults.session import RunSignals

    state.signals = RunSignals()  # SIGTERM unwinds like Ctrl-C; only the first signal interrupts
    state.signals.install()
    from harness.report.junit import take_over_junit_xml

    take_over_junit_xml(config)
    if state.terminal is not None:
        from harness.report.live import LiveStatus

        state.live = LiveStatus(state.terminal, mode=config.getoption("live"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    state = item.config.stash.get(STATE, None)
    if state is None or not state.active or item.get_closest_marker(MARKER) is None:
        return report
    verdicts = state.verdicts_by_test.get(item.nodeid, [])
    if report.when == "call" and report.passed:
        bad = [v for v in verdicts if v.status in (Status.FAIL, Status.ERROR)]
        if bad:  # the test ran to its end and the cluster did not conform: a failed test, not a crash
            report.outcome = "failed"
            report.longrepr = "\n".join(f"{v.item} {v.status.value}: {v.reason}" for v in bad)
        elif not verdicts:  # a conformance test that judged nothing proves nothing: a harness bug
            message = (f"{item.nodeid} recorded no verdict (fix: a conformance test must record a verdict, "
                       "inconclusive with its reason when it cannot measure)")
            report.outcome, report.longrepr = "failed", message
            state.result.harness_errors.append(message)
    if report.failed and call.excinfo is not None:
        message = f"{item.nodeid} ({report.when}): {call.excinfo.typename}: {call.excinfo.value}"
        if call.excinfo.errisinstance(RevertError):
            state.result.revert_failures.append(message)
        else:
            state.result.harness_errors.append(message)
    if report.when == "call" or not report.passed:  # setup/teardown only when they did not pass
        state.result.tests.append({"nodeid": item.nodeid, "outcome": report.outcome, "duration_s": report.duration,
                                   "message": "" if report.passed else str(report.longreprtext)[-300:]})
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(STATE, None)
    if state is None or not state.active:
        return
    if state.signals is not None:
        state.signals.finish()  # teardown and report from here on: signals are only noted
    if state.config_error is not None:
        session.exitstatus = int(ExitCode.HARNESS_ERROR)
        return
    result = state.result
    interrupted = state.signals.interrupted if state.signals is not None else None
    if (exitstatus == pytest.ExitCode.INTERRUPTED or interrupted is not None) and not result.harness_errors:
        by = f" by signal {interrupted}" if interrupted is not None else " (Ctrl-C or SIGTERM)"
        result.harness_errors.append(f"the run was interrupted{by} before it finished")
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        result.harness_errors.append("no conformance test was collected")
    result.finished = time.time()
    if state.live is not None:
        state.live.stop()
        result.cluster_samples = list(state.live.samples)
    result.environment = {**collect_environment(), **result.environment}  # plus what the run read on its hosts
    from harness.checks.capabilities import coverage

    result.coverage = coverage(result.verdicts, list(state.spec.checklist().items) if state.spec else [])
    code = exit_code_for(result.verdicts, harness_error=bool(result.harness_errors),
                         revert_failed=bool(result.revert_failures))
    result.exit_code = int(code)
    from harness.report import write_reports

    try:
        state.run_dir = write_reports(result, state.options.report_dir)
        from harness.report.junit import write_junit_option_path

        write_junit_option_path(result, session.config)
    except (OSError, HarnessError) as exc:
        log.error("could not write the report: %s", exc)
        result.harness_errors.append(f"could not write the report: {exc}")
        if code != ExitCode.REVERT_FAILED:
            result.exit_code = int(ExitCode.HARNESS_ERROR)
    session.exitstatus = result.exit_code


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is None or not state.active or state.config_error is not None or state.result.exit_code is None:
        return
    from harness.report.terminal import print_summary

    print_summary(_console(), state.result, state.run_dir)


def _console() -> Any:
    from rich.console import Console

    console = Console(file=sys.stdout)
    if not console.is_terminal:  # CI logs: rich would assume 80 columns and fold every reason
        console = Console(file=sys.stdout, width=160)
    return console


def _print(config: pytest.Config, markup: Any) -> None:
    """Print to the terminal during a test (outside pytest's output capture)."""
    state = config.stash.get(STATE, None)
    if state is not None and state.live is not None and state.live.print(markup):
        return  # printed above the live panel
    capman = config.pluginmanager.getplugin("capturemanager")
    ctx = capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()
    with ctx:
        _console().print(markup, soft_wrap=True)


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def harness_options(pytestconfig: pytest.Config) -> HarnessOptions:
    return _state(pytestconfig).options


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[Any]:
    """The cluster under test (a :class:`harness.cluster.ClusterHandle`) for the whole session.
    Before anything starts, what a dead run left is reverted and ended (the ledger's faults, its
    stopped or stray processes, its namespaces): see harness.faults.session.recover_before_bringup."""
    from harness.cluster import load_cluster, open_cluster
    from harness.faults.runs import RunRecord
    from harness.faults.session import recover_before_bringup

    state = _state(pytestconfig)
    spec = state.spec or load_cluster(state.options.cluster)
    recover_before_bringup(spec.name, say=lambda line: _print(pytestconfig, line))
    verb = "bringing up" if spec.kind == "bundled" else "attaching to"
    _print(pytestconfig, f"[bold]{verb} cluster {spec.name}[/] ({spec.kind}, {spec.path})")
    t0 = time.monotonic()
    log_dir = state.options.report_dir / state.result.run_id / "artifacts" / "cluster-logs"
    run = RunRecord(spec.name, spec.kind) if spec.kind == "bundled" else None
    with open_cluster(spec, log_dir=log_dir if spec.kind == "bundled" else None, run=run) as handle:
        handle.run = run
        state.result.cluster = handle.describe()
        state.result.capabilities = handle.capabilities().to_dict()
        if state.live is not None:
            state.live.set_cluster(handle.metrics_url, handle)
        _print(pytestconfig, f"cluster {spec.name} ready in {time.monotonic() - t0:.1f} s: {handle.api_url}")
        gpus = _watch_host_gpus(pytestconfig, handle)
        try:
            yield handle
        finally:
            if gpus is not None:  # the hosts' GPU state again: what moved during the run goes in the report
                gpus.finish()
                state.result.environment.update(gpus.environment())
                state.result.cluster["gpu_readings"] = state.result.environment.pop("gpu_readings", None)
    if run is not None:
        run.close()  # torn down cleanly: nothing for a later run to clean up


def _watch_host_gpus(config: pytest.Config, handle: Any) -> Any:
    """GPU state of the cluster's SSH hosts when it is attached (harness/probes/gpu_hosts.py); None
    without SSH hosts or in a dry run (it runs commands on the hosts)."""
    from harness.faults.ledger import state_dir
    from harness.probes.gpu_hosts import HostGpuWatch

    if _state(config).options.dry_run:
        return None
    watch = HostGpuWatch(handle, state_dir() / "audit.jsonl")
    if not watch.active:
        return None
    _print(config, "reading the GPUs of the cluster's hosts (nvidia-smi over SSH)")
    watch.start()
    return watch


class Conformance:
    """What a suite test records into the report. Verdicts are stamped with the test's node id."""

    def __init__(self, config: pytest.Config, nodeid: str) -> None:
        self._config = config
        self._state = _state(config)
        self.nodeid = nodeid

    def record(self, verdict: Verdict) -> Verdict:
        verdict.test = self.nodeid
        self._state.result.verdicts.append(verdict)
        self._state.verdicts_by_test.setdefault(self.nodeid, []).append(verdict)
        from harness.report.terminal import verdict_line

        _print(self._config, verdict_line(verdict))
        return verdict

    def phase(self, name: str) -> None:
        """Name what the test does now ("baseline", "storm", "recovery"): shown in the live display."""
        if self._state.live is not None:
            self._state.live.set_phase(name)

    def add_latency(self, records: list[Any], *, window_s: float = 2.0) -> None:
        """Percentiles over time of TTFT and TPOT (ok requests only) for the report's charts."""
        from harness.probes.analysis import windowed

        t0_ns = int(self._state.result.started * 1e9)
        for metric in ("ttft_ms", "tpot_ms"):
            frame = windowed(records, window_s=window_s, metric=metric, t0_wall_ns=t0_ns)
            for row in frame.to_dict("records"):
                self._state.result.latency.append(
                    {"t": self._state.result.started + row["window_start_s"], "metric": metric,
                     **{k: (None if v != v else float(v)) for k, v in row.items() if k.startswith("p")},
                     "n": int(row["ok"]), "failed": int(row["failed"])})

    def add_fault_records(self, records: list[Any]) -> None:
        """Fault activities for the ledger table, and one shaded window per fault (inject to revert)."""
        spans: dict[str, list[float]] = {}
        for rec in records:
            d = rec.to_dict() if hasattr(rec, "to_dict") else dict(rec)
            self._state.result.faults.append(d)
            span = spans.setdefault(d["fault_id"], [d["started_wall"], d["ended_wall"] or d["started_wall"], 0])
            span[1] = max(span[1], d["ended_wall"] or d["started_wall"])
            if d["action"] == "inject":
                span[0], span[2] = d["started_wall"], f"{d['kind']} {d['target']}"
        for start, end, label in spans.values():
            self._state.result.fault_windows.append({"start": start, "end": end, "label": label or "fault"})

    def add_timeline(self, entries: list[dict[str, Any]]) -> None:
        """Entries of :func:`harness.probes.timeline.merge_timeline`."""
        for e in entries:
            detail = e.get("detail")
            if isinstance(detail, dict):
                detail = ", ".join(f"{k}={v}" for k, v in detail.items() if v not in (None, "", [], {}))
            self._state.result.timeline.append({"t": e["t_wall_ns"] / 1e9, "source": e["source"], "kind": e["kind"],
                                                "detail": str(detail or "")[:300]})

    def artifact_dir(self, name: str) -> Path:
        """A folder for this test's raw data inside the run's report folder."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        path = self._state.options.report_dir / self._state.result.run_id / "artifacts" / safe
        path.mkdir(parents=True, exist_ok=True)
        return path


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
            from rich.text import Text
            _print(self._config, Text(line))
        return len(text)

    def flush(self) -> None:
        pass


def make_fault_runner(cluster: Any, *, dry_run: bool = False, state_dir: str | Path | None = None,
                      out: Any = None) -> Any:
    """A FaultRunner for ``cluster`` (a ClusterHandle) that refuses, before touching anything, every
    fault the cluster's safety settings do not allow (production clusters: all but those listed)."""
    from harness.faults import FaultRunner, Ledger
    from harness.hosts import ExecutorPool

    class SafeFaultRunner(FaultRunner):
        def inject(self, fault: Any) -> Any:
            cluster.check_fault_allowed(fault.kind)
            return super().inject(fault)

    class ClusterExecutors(ExecutorPool):
        def __call__(self, host: str | None) -> Any:
            key = host or "localhost"
            if key not in self.ssh and (target := cluster.ssh_target(key)) is not None:
                self.ssh[key] = target
            return super().__call__(host)

    pool = ClusterExecutors(dry_run=dry_run, out=out)
    run = getattr(cluster, "run", None)
    return SafeFaultRunner(Ledger.for_cluster(cluster.name, state_dir), pool, dry_run=dry_run, out=out,
                           context=run.context() if run is not None else None)


@pytest.fixture
def faults(cluster: Any, harness_options: HarnessOptions, conformance: Conformance,
           pytestconfig: pytest.Config) -> Iterator[Any]:
    """A FaultRunner bound to the cluster (see :func:`make_fault_runner`); records every activity
    into the report and reverts whatever is still active when the test ends, however it ends."""
    from rich.markup import escape

    runner = make_fault_runner(cluster, dry_run=harness_options.dry_run, out=_LiveOutput(pytestconfig))
    styles = {"succeeded": "green", "failed": "bold red", "dry_run": "yellow"}
    if (live := _state(pytestconfig).live) is not None:
        runner.listeners.append(live.fault_event)
    runner.listeners.append(lambda rec: _print(
        pytestconfig, f"  fault {rec.action.value:<15} {rec.kind} {escape(rec.target)}: "
                      f"[{styles.get(rec.status.value, '')}]{rec.status.value}[/] ({rec.duration_s:.2f} s)"))
    try:
        with runner:
            yield runner
    finally:
        conformance.add_fault_records(runner.records)


@pytest.fixture
def load(cluster: Any, harness_options: HarnessOptions, conformance: Conformance,
         request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``load(**profile_overrides)`` starts a Locust run against the cluster (LoadProfile from the
    options); every run is stopped and reaped when the test ends."""
    from harness.probes.load import LoadRunner
    from harness.probes.workload import LoadProfile, workload_profile

    runs: list[LoadRunner] = []

    def start(**overrides: Any) -> LoadRunner:
        o = harness_options
        base: dict[str, Any] = {"users": o.load_users, "seed": o.seed, "duration_s": o.load_duration or 30.0,
                                "model": cluster.model}
        if o.load_rate is not None:
            base.update(mode="poisson", rate=o.load_rate)
        base.update(workload_profile(getattr(cluster, "workload", None), overrides))
        profile = LoadProfile(**{**base, **overrides})
        runner = LoadRunner(cluster.api_url, profile, api_key=cluster.api_key(),
                            output_dir=conformance.artifact_dir(f"{request.node.name}-load{len(runs)}"))
        runs.append(runner)
        runner.start()
        if (live := _state(request.config).live) is not None:
            live.add_load(runner)
        return runner

    from harness.faults.runner import signals_deferred

    try:
        yield start
    finally:
        with signals_deferred():  # a second Ctrl-C must not leave Locust sending to the cluster
            for runner in runs:
                runner.stop()


class Timeline:
    """Router events of the cluster under test (bundled or any engine with the admin API); without
    one, events (extra evidence) are empty and ``workers()`` says what would provide a table."""

    def __init__(self, cluster: Any) -> None:
        self._cluster = cluster

    @property
    def available(self) -> bool:
        return bool(self._cluster.admin_url)

    def events(self, **params: Any) -> list[dict[str, Any]]:
        from harness.probes.admin import AdminClient

        if not self.available:
            return []
        with AdminClient(self._cluster.admin_url) as client:
            return client.events(**params)

    def workers(self) -> list[dict[str, Any]]:
        from harness.probes.admin import AdminClient

        if not self.available:
            raise HarnessError(f"cluster {self._cluster.name!r} has no admin endpoint: no live worker table",
                               fix="set endpoints.admin in the cluster file, or mark the suite with the "
                                   "capability it needs (pytest.mark.item(..., needs=[\"admin_api\"]))")
        with AdminClient(self._cluster.admin_url) as client:
            return client.workers()


@pytest.fixture
def timeline(cluster: Any) -> Timeline:
    return Timeline(cluster)
