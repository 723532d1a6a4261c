"""``pytest suites/ --baseline=PATH``: a run judged against the checklist's thresholds and, in the
same run, against a stored baseline run (harness/compare.py, docs/compare.md).

At the end of the run, before its report is written, the run's figures (6.2, 6.1.1, 6.1.2, 6.1.4,
6.1.5, lost requests) are compared with the baseline's on the checklist's ``regression:`` tolerances
(with the cluster file's overrides); the comparison goes into the results
(``regression``), the report, the terminal summary and the JUnit file, and into the exit code: a
regression beyond tolerance is not conformant (1), an undecided one inconclusive (2), a harness
error or a failed revert keep their codes (3, 4). A baseline that cannot be read or compared
(another cluster shape or load, a run without 6.2 records) is a harness error naming why.
"""

from __future__ import annotations

import logging
from pathlib import Path

from harness.checklists import Checklist, default_checklist
from harness.checks.verdict import ExitCode
from harness.compare import compare_runs, load_run, run_of
from harness.errors import HarnessError
from harness.report.result import RunResult

log = logging.getLogger(__name__)


def judge_against_baseline(result: RunResult, baseline: str, run_dir: Path, checklist: Checklist | None,
                           code: ExitCode) -> ExitCode:
    """Compare ``result`` (its records under ``run_dir``) with the run at ``baseline``; store the
    comparison in ``result.regression``; return the exit code the two judgments give together."""
    try:
        comparison = compare_runs(load_run(baseline), run_of(result.to_dict(), run_dir / "results.json"),
                                  checklist or default_checklist())
    except HarnessError as exc:
        result.harness_errors.append(f"--baseline {baseline}: {exc}")
        result.regression = {"baseline": baseline, "error": str(exc)}
        return code if code == ExitCode.REVERT_FAILED else ExitCode.HARNESS_ERROR
    result.regression = comparison.to_dict()
    log.info("against the baseline %s: exit %d", baseline, comparison.exit_code)
    if comparison.exit_code == 1 and code in (ExitCode.CONFORMANT, ExitCode.INCONCLUSIVE):
        return ExitCode.NOT_CONFORMANT
    if comparison.exit_code == 2 and code == ExitCode.CONFORMANT:
        return ExitCode.INCONCLUSIVE
    return code
