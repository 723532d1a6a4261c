"""The soak suite as users run it, without a cluster: skipped unless --soak is given, and the
same seed prints and stores the same schedule (dry runs; a real subprocess of pytest each).
The real 2-minute soaks (honest and planted-leak) are tests/harness/test_soak_e2e.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = "suites/test_soak.py"
SOAK = ["--soak=3m", "--soak-seed=11", "--live=plain"]


def run(tmp_path: Path, name: str, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    reports = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "pytest", SUITE, "-p", "no:cacheprovider", f"--report-dir={reports}",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    path = reports / "latest" / "results.json"
    assert path.is_file(), proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc, json.loads(path.read_text())


def test_without_soak_the_suite_is_not_run(tmp_path):
    proc, data = run(tmp_path, "none", "--dry-run", "-rs")
    assert "skipped" in proc.stdout and "--soak=DURATION" in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert {"soak.faults", "soak.slo", "soak.leaks"} <= set(data["coverage"]["not_run"])
    assert data["soak"] == {}


@pytest.mark.slow
def test_two_dry_runs_of_one_seed_print_and_store_the_same_schedule(tmp_path):
    runs = [("dry1", *SOAK), ("dry2", *SOAK), ("dry3", "--soak=3m", "--soak-seed=12")]
    with ThreadPoolExecutor(len(runs)) as pool:   # three processes at once: each mostly imports
        (p1, d1), (p2, d2), (_, d3) = pool.map(lambda r: run(tmp_path, r[0], "--dry-run", *r[1:]), runs)
    assert p1.returncode == p2.returncode == 2, p1.stdout[-3000:]
    s1, s2 = d1["soak"]["schedule"], d2["soak"]["schedule"]
    assert s1 == s2 and s1["seed"] == 11 and len(s1["faults"]) >= 6
    assert "[soak] soak schedule (seed 11)" in p1.stdout
    assert all(v["status"] == "inconclusive" and "none injected" in v["reason"] for v in d1["verdicts"])
    assert d3["soak"]["schedule"]["faults"] != s1["faults"]
