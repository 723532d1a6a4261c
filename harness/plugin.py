"""pytest plugin: conformance options, verdict collection, the report and the exit code.

Loaded through the ``pytest11`` entry point (or the root ``conftest.py`` in a checkout). It only
acts -- loads the cluster file, brings the cluster up, writes the report, maps the exit code --
when tests marked ``conformance`` are collected (``suites/``), so ``pytest tests/`` is unaffected.
The run's state lives in ``config.stash`` (harness/plugin_state.py); the fixtures the suites use
(``cluster``, ``conformance``, ``faults``, ``load``, ``timeline``, ...) are in harness/fixtures.py,
registered from here through ``pytest_plugins``.
Exit codes (docs/exit-codes.md): 0 conformant, 1 not, 2 inconclusive, 3 harness error, 4 revert failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.checks.verdict import ExitCode, Status, exit_code_for
from harness.errors import ConfigError, HarnessError, RevertError
from harness.plugin_options import (Invalid, baseline_path, live_mode, non_empty, number,
                                     soak_duration)
from harness.plugin_state import (MARKER, STATE, HarnessOptions, HarnessState, console, harness_state,
                                   load_run_cluster, option_given, report_message, show)
from harness.report import RunResult, collect_environment, new_run_id

log = logging.getLogger(__name__)

pytest_plugins = ["harness.fixtures"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "PD conformance harness")
    group.addoption("--cluster", default="local", type=non_empty,
                    help="cluster name (clusters/NAME.yaml) or path to a cluster YAML file (default: local)")
    group.addoption("--report-dir", default="reports", help="where reports/<run-id>/ is written (default: reports)")
    group.addoption("--dry-run", action="store_true", default=False,
                    help="print what each fault would do instead of doing it (verdicts become inconclusive)")
    group.addoption("--load-users", default=4, type=number(int, 1, "--load-users"),
                    help="concurrent load users (the in-flight cap in open loop; default 4)")
    group.addoption("--load-rate", default=None, type=number(float, 0.001, "--load-rate"),
                    help="open-loop (Poisson) request rate per second; default: closed loop")
    group.addoption("--load-duration", default=None, type=number(float, 1, "--load-duration"),
                    help="seconds of load per suite test (default: as long as the test's faults need)")
    group.addoption("--kills", default=3, type=number(int, 1, "--kills"),
                    help="kills per worker role in fault suites (default 3)")
    group.addoption("--harness-seed", default=0, type=number(int, 0, "--harness-seed"),
                    help="seed for load prompts, arrivals and fault target selection (default 0)")
    group.addoption("--soak", default=None, type=soak_duration,
                    help="run suites/test_soak.py for this long (e.g. 30m, 3m, 2h): load all along, rolling faults "
                         "from a seeded schedule, leak sampling (docs/soak.md); without it the soak suite is not run")
    group.addoption("--soak-seed", default=None, type=number(int, 0, "--soak-seed"),
                    help="seed of the soak's fault schedule (default: --harness-seed); the same seed replays it")
    group.addoption("--soak-faults-per-min", default=2.5, type=number(float, 0.01, "--soak-faults-per-min"),
                    help="pace of the soak's faults (default 2.5 a minute)")
    group.addoption("--soak-window", default=None, type=soak_duration,
                    help="window of the soak's per-window 6.2 verdicts (default: the checklist's soak.slo window_s, "
                         "at most a third of the run)")
    group.addoption("--baseline", default=None, type=baseline_path,
                    help="a stored run (report folder or results.json) to judge this run against as well: a "
                         "figure regressed beyond the checklist's regression: tolerance exits 1 (docs/compare.md)")
    group.addoption("--label", default=None, type=lambda t: t.strip() or Invalid("--label: empty value"),
                    help="a name for this run (the build or setting it tries), shown by `harness history`")
    group.addoption("--live", default="auto", type=live_mode,
                    help="live progress while suites run: rich (a panel), plain (a status line every 10 s and "
                         "at each change), off; default auto: rich on a terminal, plain otherwise")


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> Iterator[None]:
    """The command line read in full (a trial parse, on a copy of the options) as soon as every
    option is known, so its usage errors -- an option typo such as ``--clustr=x``, "unrecognized
    arguments" -- exit 3 with pytest's message: pytest's own code for them, 4, is this harness's "a
    revert failed". A conftest that cannot be imported (pytest: 4) exits 3 too. Errors pytest finds
    before it loads any plugin stay 4 under plain ``pytest`` (docs/exit-codes.md); ``harness run``
    catches those as well (harness/cli_run.py)."""
    import copy

    from harness.cli_run import option_names, report_usage_error

    try:
        yield
    except Exception as exc:
        # pytest's ConftestImportFailure (private: known by name; it has ``path`` and ``cause``)
        if not any(c.__name__ == "ConftestImportFailure" for c in type(exc).__mro__):
            raise
        import traceback

        cause = getattr(exc, "cause", exc)
        text = "".join(traceback.format_exception_only(type(cause), cause)).strip()
        raise SystemExit(report_usage_error((f"ImportError while loading conftest '{getattr(exc, 'path', '?')}': "
                                             f"{text}",))) from None
    known = early_config.known_args_namespace
    if getattr(known, "help", False) or getattr(known, "version", False):
        return None  # pytest prints them
    try:
        parser.parse(args, namespace=copy.copy(early_config.option))
    except pytest.UsageError as exc:
        raise SystemExit(report_usage_error(exc.args, option_names(parser))) from None
    return None


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Iterator[None]:
    """pytest's own usage errors found once the run has started ("file or directory not found:
    suites/", a bad -m expression) exit 3 with their message, as those of the command line do
    (:func:`pytest_load_initial_conftests`)."""
    from harness.cli_run import report_usage_error

    try:
        return (yield)
    except pytest.UsageError as exc:
        return report_usage_error(exc.args)  # type: ignore[return-value]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a Section 6.1 conformance suite test")
    config.addinivalue_line("markers", "item(*item_ids, needs=None): the checklist items a suite judges; a cluster "
                                       "lacking what they need gets them inconclusive (harness/checks/capabilities.py)")
    # the suites' own marks, registered here too: outside a checkout there is no pyproject.toml to do it
    config.addinivalue_line("markers", "slow: end-to-end tests that start processes, clusters or browsers")
    config.addinivalue_line("markers", "root: needs root and iproute2 (network namespaces, tc)")
    names = ("cluster", "report_dir", "dry_run", "load_users", "load_rate", "load_duration", "kills", "harness_seed",
             "soak", "soak_seed", "soak_faults_per_min", "soak_window", "baseline", "label")
    values = {n: config.getoption(n) for n in names}
    bad = [v.message for v in [*values.values(), config.getoption("live")] if isinstance(v, Invalid)]
    if bad:
        pytest.exit("harness option error: " + "; ".join(bad) + " (fix: pass a valid value, see `pytest --help`)",
                    returncode=int(ExitCode.HARNESS_ERROR))
    report_dir = Path(values["report_dir"])
    if not report_dir.is_absolute():
        report_dir = Path(config.invocation_params.dir) / report_dir
    options = HarnessOptions(values["cluster"], report_dir, values["dry_run"], values["load_users"],
                             values["load_rate"], values["load_duration"], values["kills"], values["harness_seed"],
                             values["soak"], values["soak_seed"], values["soak_faults_per_min"], values["soak_window"],
                             values["baseline"], values["label"])
    state = HarnessState(options, RunResult(run_id=new_run_id(), started=time.time(), options=options.to_dict()))
    config.stash[STATE] = state
    config.pluginmanager.register(_RunWatcher(state), "harness-run-watcher")
    from harness.report.live_phases import LivePhases

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


class _RunWatcher:
    """A broken suite file is a harness error even though none of its tests was collected; the test
    that runs now is kept (a test a signal stops gets no report from pytest, but a row in ours)."""

    def __init__(self, state: HarnessState) -> None:
        self.state = state

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.state.running = (nodeid, time.time())

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        self.state.running = None

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed and "suites" in Path(report.nodeid.split("::")[0]).parts:
            self.state.active = True
            self.state.result.harness_errors.append(f"collection error in {report.nodeid}: "
                                                    f"{report.longreprtext[-500:]}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = harness_state(config)
    if not any(item.get_closest_marker(MARKER) for item in items) and not state.active:
        return
    state.active = True
    from harness.checks.capabilities import check_item_markers

    what = "cluster file"
    try:  # checked in full here, before anything starts (no namespace, no process); a dry run reads no key file
        load_run_cluster(state)
        what = "suite marker"  # pytest.mark.item naming an unknown item or capability
        check_item_markers(items, state.checklist)
    except ConfigError as exc:
        from rich.markup import escape

        state.config_error = str(exc)
        show(config, f"[bold magenta]{what} error:[/] {escape(str(exc))}")  # the one place it is printed
        pytest.exit(f"harness: exit {int(ExitCode.HARNESS_ERROR)} (the {what} error above)",
                    returncode=int(ExitCode.HARNESS_ERROR))
    state.result.cluster = {"name": state.spec.name, "kind": state.spec.kind, "path": state.spec.path}
    if state.options.dry_run:
        from harness.dry_run import announce

        announce(config, state.spec)
    from harness.signals import SignalOwner

    state.signals = SignalOwner().install()  # SIGTERM unwinds like Ctrl-C; only the first signal interrupts
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
        if call.excinfo.errisinstance(HarnessError) and item.config.getoption("verbose", 0) < 2:
            # a harness error says what and how to fix it: that, not the libraries' traceback (-vv shows it)
            report.longrepr = f"{call.excinfo.typename}: {call.excinfo.value}"
        if call.excinfo.errisinstance(RevertError):
            state.result.revert_failures.append(message)
        else:
            state.result.harness_errors.append(message)
        _record_crash_rows(item, state, report.when, f"{call.excinfo.typename}: {call.excinfo.value}")
    if report.when == "call" or not report.passed:  # setup/teardown only when they did not pass
        state.result.tests.append({"nodeid": item.nodeid, "outcome": report.outcome, "duration_s": report.duration,
                                   "started": report.start,
                                   "message": "" if report.passed else report_message(report)})
    return report


def _record_crash_rows(item: pytest.Item, state: HarnessState, when: str, error: str) -> None:
    """A suite that crashed still gives each of its items a row: "error: ..." (never "no suite of
    this run reported on it"). Items the test already judged keep their verdicts."""
    from harness.checks import reasons
    from harness.checks.capabilities import item_marker
    from harness.checks.verdict import Verdict

    marked = item_marker(item)
    if marked is None or state.checklist is None:
        return
    checklist = state.checklist
    have = {v.item for v in state.verdicts_by_test.get(item.nodeid, [])}
    reason = " ".join(f"error: the suite stopped in its {when} before judging this item: {error}".split())
    for item_id in marked[0]:
        if item_id in have or item_id not in checklist.items:
            continue
        verdict = Verdict(item=item_id, title=checklist.item(item_id).title, status=Status.ERROR,
                          causes=(reasons.cause("error", text=reason[:600]),), test=item.nodeid,
                          evidence={"error": error, "phase": when})
        state.result.verdicts.append(verdict)
        state.verdicts_by_test.setdefault(item.nodeid, []).append(verdict)


def _active_state_of_session(session: pytest.Session) -> HarnessState | None:
    state = session.config.stash.get(STATE, None)
    return state if state is not None and state.active else None


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Iterator[None]:
    """The report and the exit code, written once everything is torn down: after an interrupted
    run's fixtures (its faults reverted and recorded, its cluster stopped), which pytest tears down
    in this hook (its runner's pytest_sessionfinish), so the report holds the faults, the timeline
    and the tests the run did. A teardown that raises is recorded (a revert that failed: exit 4)."""
    state = _active_state_of_session(session)
    if state is None:
        return (yield)
    if state.signals is not None:
        state.signals.finish()  # teardown and report from here on: signals are only noted
    try:
        yield
    except Exception as exc:  # noqa: BLE001  # an interrupted run's teardown: reported, not a pytest crash
        failures = state.result.revert_failures if isinstance(exc, RevertError) else state.result.harness_errors
        failures.append(f"teardown after the run: {type(exc).__name__}: {exc}")
    _finish_run(session, state, exitstatus)
    return None


def _finish_run(session: pytest.Session, state: HarnessState, exitstatus: int) -> None:
    if state.config_error is not None:
        session.exitstatus = int(ExitCode.HARNESS_ERROR)
        return
    result = state.result
    interrupted = state.signals.interrupted if state.signals is not None else None
    by = f" by signal {interrupted}" if interrupted is not None else " (Ctrl-C or SIGTERM)"
    if exitstatus == pytest.ExitCode.INTERRUPTED or interrupted is not None:
        if not result.harness_errors:
            result.harness_errors.append(f"the run was interrupted{by} before it finished")
        if state.running is not None and state.running[0] not in {t["nodeid"] for t in result.tests}:
            nodeid, started = state.running  # pytest makes no report for a test a signal stopped
            result.tests.append({"nodeid": nodeid, "outcome": "interrupted", "duration_s": time.time() - started,
                                 "started": started, "message": f"the run was interrupted{by} during this test"})
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        result.harness_errors.append("no conformance test was collected")
    result.finished = time.time()
    if state.live is not None:
        state.live.stop()
        result.cluster_samples = list(state.live.samples)
    result.environment = {**collect_environment(), **result.environment}  # plus what the run read on its hosts
    from harness.checks.capabilities import coverage

    result.coverage = coverage(result.verdicts, list(state.checklist.items) if state.checklist else [])
    code = exit_code_for(result.verdicts, harness_error=bool(result.harness_errors),
                         revert_failed=bool(result.revert_failures))
    if state.options.baseline is not None and not state.options.dry_run:
        from harness.baseline import judge_against_baseline

        code = judge_against_baseline(result, state.options.baseline, state.options.report_dir / result.run_id,
                                      state.checklist, code)
    result.exit_code = int(code)
    from harness.report import write_reports

    try:   # a dry run writes nothing unless asked (--report-dir, --junit-xml): issue 37
        if not state.options.dry_run or option_given(session.config, "--report-dir"):
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

    print_summary(console(), state.result, state.run_dir)
    if state.run_dir is None and state.options.dry_run:
        console().print("dry run: no report written, nothing left here (--report-dir=DIR keeps one)")
