"""`python -m harness compare` on two real runs of the 6.2 suite on the bundled cluster (real
subprocesses, real engine, the records the runs wrote): the candidate's engine prefills one prompt
token a step (`bundled.engine.max_prefill_tokens: 1`, a real engine setting: chunked prefill with
the smallest chunk; the cluster otherwise the same and named the same), so its first tokens come
several times later: TTFT regressed, exit 1, named in the table and the JSON. (`max_batch: 1` was
tried first and changed nothing under 4 users on 2 + 2 workers: TTFT 0.93 x.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(tmp_path: Path, name: str, cluster: str, *extra: str) -> Path:
    reports = tmp_path / name
    out = subprocess.run([sys.executable, "-m", "pytest", "suites/test_62_slo.py", "-p", "no:cacheprovider",
                          f"--cluster={cluster}", f"--report-dir={reports}", "--live=off", "--load-duration=8", *extra],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1, 2), out.stdout[-3000:] + out.stderr[-2000:]
    return reports / "latest"


def test_a_candidate_that_prefills_a_token_a_step_regresses_ttft_against_the_baseline(tmp_path):
    """Planted defect: the candidate compared as baseline (ratio inverted: TTFT 'improved'), or its
    records not read (no samples: inconclusive, exit 2), or the runs refused as not comparable for
    an engine setting (the very change a rollout tests), or --baseline judging other figures than
    the command does."""
    data = yaml.safe_load((ROOT / "clusters" / "local.yaml").read_text())
    data.setdefault("bundled", {}).setdefault("engine", {})["max_prefill_tokens"] = 1
    token_a_step = tmp_path / "local-candidate.yaml"
    token_a_step.write_text(yaml.safe_dump(data))   # still named "local": the same cluster, another build
    base = _run(tmp_path, "baseline", "local")
    cand = _run(tmp_path, "candidate", str(token_a_step), f"--baseline={base}")   # judged against it in the run
    out = subprocess.run([sys.executable, "-m", "harness", "compare", str(base), str(cand), "--json",
                          str(tmp_path / "compare.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    got = json.loads((tmp_path / "compare.json").read_text())
    by = {f["figure"]: f for f in got["figures"]}
    assert by["ttft_p50_ms"]["status"] == "regressed" and by["ttft_p50_ms"]["interval"]["lo"] > 1.1, by["ttft_p50_ms"]
    assert got["differences"] == [] and "ttft_p50_ms" in out.stdout and "exit 1" in out.stdout
    # the candidate's own run, given --baseline, judged the same figures the same way
    in_run = json.loads((cand / "results.json").read_text())["regression"]
    assert {f["figure"]: f["status"] for f in in_run["figures"]} == {f["figure"]: f["status"] for f in got["figures"]}
    assert in_run["exit_code"] == 1 and "regression.6.2.ttft" in (cand / "junit.xml").read_text()
