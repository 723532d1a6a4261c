"""Acceptance of `pytest suites/` as users run it (a real subprocess, the real bundled cluster):
exit 0 when the cluster conforms, 1 when rescheduling is sabotaged through a cluster setting (and
the report says why), 3 for a malformed cluster file.

The conforming run uses the shipped rule as shipped: clusters/local.yaml and the checklist's 3 s
and three faults a kind, no override (a test machine too starved to time rescheduling may make
6.1.4 inconclusive, naming the machine: the one other outcome allowed). The other runs use the
shipped files with stated overrides, to keep CI short: one kill per role accepted as a distribution
(`min_faults_per_kind: 1`, with `--kills=1`), and for the router that keeps a worker out a 10 s
rescheduling threshold and a 20 s rejoin limit; the sabotaged run keeps the shipped 3 s and its 4 s
delay (docs/exit-codes.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


SUITE = "suites/test_item4_reschedule.py"
RELAXED = {"min_faults_per_kind": 1, "reschedule_p100_s": 10.0, "reschedule_p95_s": 10.0}


def short_cluster(tmp_path: Path, base: str, relaxed: dict = RELAXED) -> Path:
    data = yaml.safe_load((ROOT / "clusters" / f"{base}.yaml").read_text())
    data["name"] = f"{base}-short"
    data.setdefault("thresholds", {})["6.1.4"] = dict(relaxed)
    path = tmp_path / f"{base}-short.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_suites(tmp_path: Path, *args: str, target: str = SUITE, timeout: float = 560) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", target, "-p", "no:cacheprovider",
           f"--report-dir={tmp_path / 'reports'}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def verdicts(tmp_path: Path) -> dict[str, dict]:
    data = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    return {v["item"]: v for v in data["verdicts"]}


def starved_machine(verdict: dict) -> bool:
    """Inconclusive because the test machine was CPU-starved while it was measured (the machine
    gate, harness/checks/machine.py): the one outcome besides the deserved one a loaded box may give.
    Read from the gate's evidence, windows judged again, never from the reason's words alone
    (tests/harness/test_soak_e2e.py)."""
    from tests.harness.test_soak_e2e import starved_machine as by_the_gates_evidence

    return by_the_gates_evidence(verdict)


def check_shipped_rule_run(returncode: int, v: dict[str, dict], out: str) -> None:
    """What the bundled default deserves under the shipped 6.1.4 rule: pass within 3 s on three kills
    and three hangs per role (or inconclusive naming the starved machine), nothing lost, exit 0 (2)."""
    r = v["6.1.4"]
    assert r["status"] == "pass" or starved_machine(r), r["reason"]
    assert v["nothing-lost"]["status"] == "pass", v["nothing-lost"]["reason"]
    assert returncode == (0 if r["status"] == "pass" else 2), out
    assert len(r["evidence"]["samples"]) == 12, r["evidence"]["samples"]  # 3 kills + 3 hangs per role
    if r["status"] == "pass":
        assert r["measured"] <= 3.0, r["reason"]
    assert v["nothing-lost"]["evidence"]["token_exact"] > 0


def test_conforming_bundled_cluster_exits_0_under_the_shipped_3_s_rule(tmp_path):
    """The shipped 6.1.4 rule end to end on clusters/local.yaml, no override. Planted defect it
    catches: rescheduling delayed by 4 s (clusters/local.yaml with the router's `reschedule_delay_s:
    4`, as clusters/local-sabotaged.yaml), which passed the old 10 s override; run on it, this test's
    checks fail (checked: 6.1.4 fail, p100 4.86 s over 12 faults)."""
    proc = run_suites(tmp_path, "--cluster=local", timeout=900)
    check_shipped_rule_run(proc.returncode, verdicts(tmp_path), proc.stdout[-4000:] + proc.stderr[-2000:])
    assert (tmp_path / "reports" / "latest" / "report.html").is_file()


def test_sabotaged_rescheduling_exits_1_and_the_report_says_why(tmp_path):
    """clusters/local-sabotaged.yaml as shipped (the router waits 4 s before rescheduling) under the shipped
    3 s rule, one fault a kind: 6.1.4 fails, the report says what, against what and why. (Until
    2026-12-07 a 15 s delay against a 10 s override: 44 s more CI for the same finding, issue 34.)
    Planted defect it catches: the delay not applied (clusters/local.yaml: exit 0, checked)."""
    cluster = short_cluster(tmp_path, "local-sabotaged", relaxed={"min_faults_per_kind": 1})
    proc = run_suites(tmp_path, f"--cluster={cluster}", "--kills=1", "--load-duration=150")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    v = verdicts(tmp_path)["6.1.4"]
    assert v["status"] == "fail" and v["measured"] > 3.5
    assert "required <= 3 s" in v["reason"] and "stalled stream" in v["reason"]  # what, against what, why
    html = (tmp_path / "reports" / "latest" / "report.html").read_text()
    assert 'data-item="6.1.4" data-status="fail"' in html and "required &lt;= 3 s" in html


def test_a_router_that_keeps_a_restarted_worker_out_fails_6_1_4_with_the_finding(tmp_path):
    """vllm-router kept a restarted instance out for 100+ s after its /health answered 200; the old
    revert check read only the worker and went on to the next fault. A worker the router lists
    healthy but never serves through again is a finding under 6.1.4, and the plan stops there."""
    cluster = short_cluster(tmp_path, "local")
    data = yaml.safe_load(cluster.read_text())
    data["bundled"]["router"]["readmit_delay_s"] = 600.0
    data["thresholds"]["6.1.4"]["rejoin_limit_s"] = 20.0   # the checklist's 60 s, shortened: 40 s less CI
    cluster.write_text(yaml.safe_dump(data))
    proc = run_suites(tmp_path, f"--cluster={cluster}", "--kills=1")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    v = verdicts(tmp_path)["6.1.4"]
    assert v["status"] == "fail" and "the router kept prefill-" in v["reason"] and "required <= 20 s" in v["reason"]
    assert v["evidence"]["stopped"].startswith("the plan stopped after 1 of 4 faults")
    rejoin = v["evidence"]["rejoin"][0]
    assert rejoin["back"] is False and rejoin["kept_out_s"] > 20
    assert verdicts(tmp_path)["nothing-lost"]["status"] == "pass"


def test_malformed_cluster_file_exits_3_naming_file_field_and_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: bundled\nsafety: {production: true, allowed_faults: all}\n")
    proc = run_suites(tmp_path, f"--cluster={bad}", target="suites/", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert str(bad) in out and "`safety.allowed_faults`" in out and "fix:" in out


def test_dry_run_prints_every_plan_injects_nothing_and_exits_2(tmp_path):
    proc = run_suites(tmp_path, "--dry-run", "--kills=1")
    assert proc.returncode == 2, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count("[dry-run] process_kill") >= 2 and "[dry-run] process_hang" in proc.stdout
    data = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    assert data["faults"] and {f["status"] for f in data["faults"]} == {"dry_run"}
    assert data["verdicts"][0]["reason"].startswith("dry run: 4 faults planned")
