"""Conformance reports: one run's results, written as HTML, JSON and JUnit XML.

A :class:`RunResult` is JSON-able; the plugin fills it during the session and
:func:`write_reports` renders it once at the end into ``reports/<run-id>/`` and points the
``reports/latest`` link at that folder.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import __version__
from harness.checks.verdict import Verdict

log = logging.getLogger(__name__)

EXIT_MEANINGS = {0: "conformant", 1: "not conformant", 2: "inconclusive", 3: "harness error",
                 4: "a revert failed (cluster may be dirty)"}


@dataclass
class RunResult:
    """Everything one run produced. Times are wall-clock seconds (``time.time()``).

    ``latency`` rows: ``{"t": window start, "metric": "ttft_ms", "p50": .., "p90": .., "p99": .., "n": ..}``;
    ``fault_windows``: ``{"start": t, "end": t, "label": "kill decode-0"}``;
    ``timeline``: ``{"t": t, "source": "router", "kind": "worker_down", "detail": "..."}``;
    ``faults``: fault ledger records (``FaultRecord.to_dict()``);
    ``cluster_samples``: ``{"t": t, "kv_usage": 0.42, "degradation_level": 1, ...}`` sampled from the
    cluster's metrics while suites ran (docs/results-schema.md);
    ``machine``: the test machine's health while the cluster was up: ``{"interval_s", "cpus",
    "psi_note", "limits", "samples": [{"t", "psi_some_pct", "timer_lag_max_ms", ...}]}``.
    """

    run_id: str
    started: float
    finished: float | None = None
    exit_code: int | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    cluster: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    latency: list[dict[str, Any]] = field(default_factory=list)
    fault_windows: list[dict[str, Any]] = field(default_factory=list)
    cluster_samples: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    tests: list[dict[str, Any]] = field(default_factory=list)  # {"nodeid", "outcome", "duration_s", "message"}
    harness_errors: list[str] = field(default_factory=list)
    revert_failures: list[str] = field(default_factory=list)
    # what the cluster provides ({capability: {provided, why_not, provided_by}}) and which items
    # were judged ({"judged": {item: status}, "not_judged": {item: [reasons]}, "not_run": [item]})
    capabilities: dict[str, Any] = field(default_factory=dict)
    coverage: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    # a soak run (suites/test_soak.py): its schedule, fault outcomes, windows and leak series
    soak: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_meaning(self) -> str:
        return EXIT_MEANINGS.get(self.exit_code, "unknown") if self.exit_code is not None else "running"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdicts"] = [v.to_dict() for v in self.verdicts]
        data["exit_meaning"] = self.exit_meaning
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunResult":
        data = {k: v for k, v in data.items() if k != "exit_meaning"}
        data["verdicts"] = [Verdict.from_dict(v) for v in data.get("verdicts", [])]
        return cls(**data)


def new_run_id(now: float | None = None) -> str:
    """Sortable and unique enough for one machine: UTC time plus the pid."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{os.getpid()}"


def collect_environment() -> dict[str, Any]:
    """Where the run happened, for the report's environment section."""
    env: dict[str, Any] = {"harness": __version__, "python": sys.version.split()[0],
                           "platform": platform.platform(), "hostname": socket.gethostname(),
                           "cpus": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None:  # only if already imported: the report must not pay for a torch import
        env["torch"] = torch.__version__
        env["cuda"] = bool(torch.cuda.is_available())
    from harness.probes.gpu import gpu_inventory

    try:
        gpus = gpu_inventory()
    except Exception as exc:  # noqa: BLE001 -- a broken driver must not cost the report
        log.warning("GPU inventory failed: %s", exc)
        gpus = None
    if gpus is not None:
        env["gpus"] = gpus
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def write_reports(result: RunResult, report_dir: str | os.PathLike) -> Path:
    """Write ``report.html``, ``results.json`` and ``junit.xml`` to ``report_dir/<run-id>/`` and
    repoint ``report_dir/latest`` at it. Returns the run folder."""
    from harness.report.events import unique_events
    from harness.report.html import render_html
    from harness.report.jsonout import write_json
    from harness.report.junit import write_junit

    # each suite reads the engine's whole event log: an event a suite before it recorded is dropped
    result.timeline = unique_events(result.timeline)
    root = Path(report_dir)
    run_dir = root / result.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(result, run_dir / "results.json")
    write_junit(result, run_dir / "junit.xml")
    (run_dir / "report.html").write_text(render_html(result), encoding="utf-8")
    _point_latest(root, result.run_id)
    log.info("report written to %s", run_dir)
    return run_dir


def _point_latest(root: Path, run_id: str) -> None:
    # Build the new link beside the old one and rename over it, so `latest` is never missing.
    tmp = root / f".latest-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_id, target_is_directory=True)
    os.replace(tmp, root / "latest")
