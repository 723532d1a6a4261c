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
from pathlib import Path
from typing import Any

from harness import __version__
from harness.report.result import EXIT_MEANINGS, RunResult

log = logging.getLogger(__name__)

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
    from harness.probes.workers.gpu import gpu_inventory

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
    from harness.report.trend import past_runs

    # each suite reads the engine's whole event log: an event a suite before it recorded is dropped
    result.timeline = unique_events(result.timeline)
    root = Path(report_dir)
    run_dir = root / result.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(result, run_dir / "results.json")
    write_junit(result, run_dir / "junit.xml")
    past = past_runs(root, result.cluster.get("name"), result.run_id)   # the trend: earlier runs written here
    (run_dir / "report.html").write_text(render_html(result, past), encoding="utf-8")
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
