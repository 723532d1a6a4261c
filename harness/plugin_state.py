"""The conformance run's state inside pytest: the parsed options, what the run collects (its
RunResult), and printing to the terminal past pytest's capture. Kept in ``config.stash`` under
:data:`STATE` by the plugin (harness/plugin.py) and read by its fixtures (harness/fixtures.py).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.checklists import Checklist, default_checklist
from harness.checks.verdict import Verdict
from harness.report import RunResult
from harness.signals import SignalOwner

MARKER = "conformance"


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
    soak_s: float | None = None          # --soak: the soak suite runs only when given
    soak_seed: int | None = None         # None: the harness seed
    soak_faults_per_min: float = 2.5
    soak_window_s: float | None = None
    baseline: str | None = None          # --baseline: a stored run's results.json to compare this run with
    label: str | None = None             # --label: what the run is (a build, a setting), for `harness history`

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "report_dir": str(self.report_dir), "dry_run": self.dry_run,
                "load_users": self.load_users, "load_rate": self.load_rate, "load_duration": self.load_duration,
                "kills": self.kills, "harness_seed": self.seed, "soak_s": self.soak_s, "soak_seed": self.soak_seed,
                "soak_faults_per_min": self.soak_faults_per_min, "soak_window_s": self.soak_window_s,
                "baseline": self.baseline, "label": self.label}


@dataclass
class HarnessState:
    options: HarnessOptions
    result: RunResult
    active: bool = False
    config_error: str | None = None
    run_dir: Path | None = None
    spec: Any = None  # ClusterSpec once loaded
    checklist: Checklist | None = None  # the run's thresholds (the cluster's overrides applied), once loaded
    verdicts_by_test: dict[str, list[Verdict]] = field(default_factory=dict)
    live: Any = None  # harness.report.live.LiveStatus once suites were collected
    terminal: Any = None  # a duplicate of the terminal's stdout, taken before any capture
    signals: SignalOwner | None = None   # once conformance suites were collected
    seen_events: set[str] = field(default_factory=set)  # engine events already on the timeline (once per run)
    running: tuple[str, float] | None = None  # (node id, wall time it started) of the test running now


STATE = pytest.StashKey[HarnessState]()


def harness_state(config: pytest.Config) -> HarnessState:
    return config.stash[STATE]


def load_run_cluster(state: HarnessState) -> None:
    """Parse the checklist (the one parse of a run) and check the cluster file against it, before
    anything starts; the plugin, the fixtures and the report read ``state.checklist`` from here on."""
    from harness.clusterfile.load import check_cluster

    base = default_checklist()
    state.spec = check_cluster(state.options.cluster, dry_run=state.options.dry_run, checklist=base)
    state.checklist = state.spec.checklist(base)


def console() -> Any:
    from rich.console import Console

    out = Console(file=sys.stdout)
    if not out.is_terminal:  # CI logs: rich would assume 80 columns and fold every reason
        out = Console(file=sys.stdout, width=160)
    return out


def show(config: pytest.Config, markup: Any) -> None:
    """Print to the terminal during a test (outside pytest's output capture)."""
    state = config.stash.get(STATE, None)
    if state is not None and state.live is not None and state.live.print(markup):
        return  # printed above the live panel
    capman = config.pluginmanager.getplugin("capturemanager")
    ctx = capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext()
    with ctx:
        console().print(markup, soft_wrap=True)


def show_line(config: pytest.Config, text: str) -> None:
    """One plain line on the terminal, on a line of its own (pytest's terminal reporter ends its
    progress line first), past pytest's capture: above the live panel when there is one."""
    from rich.text import Text

    state = config.stash.get(STATE, None)
    if state is not None and state.live is not None and state.live.print(Text(text)):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        show(config, Text(text))
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        reporter.ensure_newline()
        reporter.write_line(text)


def option_given(config: pytest.Config, option: str) -> bool:
    """Whether ``option`` was on the command line (not only its default)."""
    return any(a == option or a.startswith(option + "=") for a in config.invocation_params.args)


def report_message(report: pytest.TestReport, limit: int = 2000) -> str:
    """A finished test's message for the report: a skip's reason (not pytest's (path, line, reason)
    tuple, issue 37), else its first line (what failed) and as much of the end (the assertion) as
    fits in ``limit`` characters."""
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    text = str(report.longreprtext)
    if len(text) <= limit:
        return text
    first = text.splitlines()[0][:200]
    return f"{first}\n[... {len(text) - limit} characters left out ...]\n{text[-(limit - len(first)):]}"
