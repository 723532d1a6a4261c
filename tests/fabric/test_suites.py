"""Acceptance of the fabric suites as users run them (a real `pytest suites/...` subprocess, the
bundled cluster on the emulated fabric): item 6.1.5 fails, with the reason, on the cluster whose
TCP traffic is deliberately put into the lossless class; the fabric is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fabric.builder import leftovers

from tests.fabric.conftest import require_fabric

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.root, pytest.mark.slow]


def test_pfc_storm_suite_fails_when_tcp_shares_the_lossless_class(tmp_path):
    require_fabric()
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/test_item5_pfc_isolation.py", "-p",
                           "no:cacheprovider", "--cluster=local-fabric-sabotaged",
                           f"--report-dir={tmp_path / 'reports'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
    (verdict,) = [v for v in results["verdicts"] if v["item"] == "6.1.5"]
    assert verdict["status"] == "fail"
    assert "during the storm" in verdict["reason"] and "x baseline" in verdict["reason"]
    assert verdict["evidence"]["storm"]["tcp_in_lossless"] is True
    fabric = results["cluster"]["fabric"]
    assert fabric["tcp_in_lossless"] is True
    assert leftovers(prefix=fabric["prefix"]) == []  # the cluster's fabric was torn down with it
