"""`pytest suites/ --baseline=PATH` (harness/baseline.py): the run's own 6.2 figures judged against a
stored baseline run at the end of the run, into its exit code, results, JUnit and HTML. Report
folders and records as runs write them (tests/test_compare.py's helpers); real verdicts of the
records from harness.checks.slo."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.baseline import judge_against_baseline
from harness.checklists import default_checklist
from harness.checks.slo import slo_verdicts
from harness.checks.verdict import ExitCode
from harness.probes.client.records import write_records
from harness.report.html import render_html
from harness.report.junit import junit_tree
from harness.report.result import RunResult
from tests.test_compare import LINK, report_folder, run_records

ROOT = Path(__file__).resolve().parents[2]


def _this_run(run_dir: Path, records, *, users: int = 16) -> RunResult:
    """A run in progress: its records on disk under run_dir, its verdicts in memory (no results.json yet)."""
    (run_dir / LINK).parent.mkdir(parents=True)
    write_records(run_dir / LINK, records)
    verdicts = list(slo_verdicts(records, default_checklist()))
    for v in verdicts:
        v.evidence["links"] = [LINK]
        v.evidence["load"] = {"mode": "closed", "users": users, "rate": None, "runs_s": [9.0], "max_tokens": 16,
                              "prompt_chars": [16, 96]}
    return RunResult(run_id=run_dir.name, started=0.0, verdicts=verdicts,
                     cluster={"name": "local", "kind": "bundled", "engine": "bundled", "model": "tiny",
                              "workers": [{"name": "decode-0", "role": "decode"}, {"name": "prefill-0", "role": "prefill"}]},
                     options={"load_users": users, "load_rate": None, "load_duration": None})


def test_a_regressed_figure_makes_a_conformant_run_exit_1_and_shows_in_junit_and_html(tmp_path):
    """Planted defects: the comparison kept out of the exit code (a conformant run that regressed
    40 % in TPOT exits 0 and rolls out); no JUnit case for it (CI dashboards miss it)."""
    base = report_folder(tmp_path / "base", run_records(3000, 1))
    result = _this_run(tmp_path / "reports" / "run1", run_records(3000, 3, tpot_ms=7.0))
    code = judge_against_baseline(result, str(base), tmp_path / "reports" / "run1", None, ExitCode.CONFORMANT)
    assert code == ExitCode.NOT_CONFORMANT
    by = {f["figure"]: f for f in result.regression["figures"]}
    assert by["tpot_p50_ms"]["status"] == "regressed" and result.regression["exit_code"] == 1
    cases = {(c.get("classname"), c.get("name")): c for c in junit_tree(result).getroot().iter("testcase")}
    assert cases[("regression.6.2.tpot", "tpot_p50_ms")].find("failure") is not None
    html = render_html(result)
    assert 'id="regression"' in html and 'data-figure="tpot_p50_ms" data-status="regressed"' in html


def test_an_undecided_comparison_makes_a_conformant_run_inconclusive_and_keeps_worse_codes(tmp_path):
    """Planted defect: an undecided comparison read as within tolerance (exit 0 on 200 requests, where
    no p99 has a bound), or overriding a failed revert's 4."""
    base = report_folder(tmp_path / "base", run_records(200, 1))
    result = _this_run(tmp_path / "reports" / "run1", run_records(200, 2))
    assert judge_against_baseline(result, str(base), tmp_path / "reports" / "run1", None,
                                  ExitCode.CONFORMANT) == ExitCode.INCONCLUSIVE
    assert judge_against_baseline(result, str(base), tmp_path / "reports" / "run1", None,
                                  ExitCode.REVERT_FAILED) == ExitCode.REVERT_FAILED


def test_a_baseline_of_another_load_is_a_harness_error_naming_the_difference(tmp_path):
    """Planted defect: the comparison made anyway (64 users' queueing read as the build's regression)."""
    base = report_folder(tmp_path / "base", run_records(400, 1), users=64)
    result = _this_run(tmp_path / "reports" / "run1", run_records(400, 2))
    code = judge_against_baseline(result, str(base), tmp_path / "reports" / "run1", None, ExitCode.CONFORMANT)
    assert code == ExitCode.HARNESS_ERROR and "not comparable" in result.regression["error"]
    assert any(e.startswith(f"--baseline {base}") and "load options" in e for e in result.harness_errors)


def test_a_baseline_that_is_not_there_stops_the_run_before_it_starts(tmp_path):
    """Planted defect: the path checked only at the end, after a whole run was spent (exit 3 then)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "suites/test_62_slo.py", "-p", "no:cacheprovider",
                          f"--baseline={tmp_path / 'nope'}", f"--report-dir={tmp_path / 'r'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--baseline" in out.stdout + out.stderr and "no results.json" in out.stdout + out.stderr
    assert not (tmp_path / "r").exists()
