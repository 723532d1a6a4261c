"""bench/bench_verdict_stability.py's reading and acceptance logic on results.json files written by
the report code (the main job itself is not run here: the bench is the measurement)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from harness.checks.machine import gate
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, judge
from harness.report import RunResult, write_reports

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_verdict_stability", ROOT / "bench" / "bench_verdict_stability.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # its dataclasses look their module up
_spec.loader.exec_module(bench)

CHECKLIST = Checklist.load()
QUIET = {"samples": 30, "psi_some_pct": 90.0, "watched_wait_per_run_ms": 1.0, "timer_lag_p99_ms": 20.0}
STARVED = {"samples": 30, "psi_some_pct": 100.0, "watched_wait_per_run_ms": 9.0, "timer_lag_p99_ms": 120.0}


def verdict(item: str, key: str, value: float, window: dict, test: str = "suites/test_x.py::test_x"):
    it = CHECKLIST.item(item)
    v = gate(judge(it, [Measurement(it.thresholds[key], value, key)]), [window])
    v.test = test
    return v


def write_run(root: Path, name: str, verdicts: list, exit_code: int) -> Path:
    """A run's report folder as the plugin writes it (``<dir>/<run-id>/`` and ``<dir>/latest``)."""
    folder = root / name
    write_reports(RunResult(run_id=f"20270101T000000Z-{name}", started=1.8e9, finished=1.8e9 + 60,
                            exit_code=exit_code, verdicts=verdicts), folder)
    return folder


def outcome(root: Path, kind: str, index: int, verdicts: list, exit_code: int):
    return bench.read_outcome(kind, index, exit_code, 60.0, write_run(root, f"{kind}-{index}", verdicts, exit_code))


def test_rows_carry_status_measured_interval_and_machine_figures(tmp_path):
    v = verdict("6.2.ttft", "ttft_p50_ms", 80.0, QUIET)
    v.evidence["interval"] = {"lo": 70.0, "hi": 90.0, "level": 0.95}
    o = outcome(tmp_path, "quiet", 1, [v], 0)
    [row] = o.rows
    assert (row.item, row.status, row.measured, row.unit) == ("6.2.ttft", "pass", 80.0, "ms")
    assert row.interval == {"lo": 70.0, "hi": 90.0, "level": 0.95} and row.machine["psi_some_pct"] == 90.0
    text = "\n".join(bench.describe(o))
    assert "quiet-1: exit 0" in text and "[70-90]" in text and "psi 90%" in text and "wait/run 1ms" in text


def test_stable_verdicts_and_a_named_starved_machine_pass_acceptance(tmp_path):
    runs = [outcome(tmp_path, "quiet", 1, [verdict("6.1.1", "line_rate_fraction", 0.9, QUIET)], 0),
            outcome(tmp_path, "burner", 1, [verdict("6.1.1", "line_rate_fraction", 0.7, STARVED)], 2),
            outcome(tmp_path, "burner", 2, [verdict("6.1.1", "line_rate_fraction", 0.85, STARVED)], 0)]
    assert runs[1].rows[0].status == "inconclusive" and "test machine" in runs[1].rows[0].reason
    assert bench.acceptance(runs) == []


def test_each_acceptance_check_names_what_broke(tmp_path):
    flip_fail = verdict("6.2.tpot", "tpot_p50_ms", 40.0, QUIET)  # a fail the machine does not excuse
    runs = [outcome(tmp_path, "quiet", 1, [verdict("6.2.tpot", "tpot_p50_ms", 5.0, QUIET)], 0),
            outcome(tmp_path, "burner", 1, [flip_fail], 1),
            outcome(tmp_path, "quiet", 2, [verdict("6.2.tpot", "tpot_p50_ms", 5.0, QUIET)], 4),
            bench.read_outcome("burner", 2, 3, 5.0, tmp_path / "nothing")]
    failed = bench.acceptance(runs)
    assert any("6.2.tpot (suites/test_x.py::test_x) passed in quiet-1, quiet-2 and failed in burner-1" in f
               for f in failed)
    assert any(f.startswith("burner-1: timing item 6.2.tpot was fail beside the burner") for f in failed)
    assert "quiet-2 exited 4 (revert failed)" in failed and "burner-2 exited 3 (harness error)" in failed
    assert "quiet-2 (quiet) exited 4, not 0" in failed
    assert any(f.startswith("burner-2: no readable results.json") for f in failed)


def test_an_inconclusive_timing_item_beside_the_burner_must_name_the_machine(tmp_path):
    it = CHECKLIST.item("6.1.4")
    thin = judge(it, [Measurement(it.thresholds["reschedule_p100_s"], None, "p100")])  # not measured
    thin.test = "t"
    failed = bench.acceptance([outcome(tmp_path, "burner", 1, [thin], 2)])
    assert failed and "timing item 6.1.4 was inconclusive beside the burner without naming" in failed[0]
    nothing_lost = verdict("nothing-lost", "wrong_completions", 0, STARVED)
    assert bench.acceptance([outcome(tmp_path, "burner", 2, [nothing_lost], 0)]) == []  # not a timing item


def test_the_burner_runs_and_is_reaped():
    with bench.Burner(1) as burner:
        pids = [p.pid for p in burner.procs]
        assert len(pids) == (bench.os.cpu_count() or 1) and all(p.poll() is None for p in burner.procs)
    assert burner.procs == [] and not any(Path(f"/proc/{pid}").exists() for pid in pids)


@pytest.mark.parametrize("args", [["--runs", "0"], ["--per-core", "0"]])
def test_bad_counts_are_usage_errors(args):
    out = subprocess.run([sys.executable, "bench/bench_verdict_stability.py", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "must be at least 1" in out.stderr
