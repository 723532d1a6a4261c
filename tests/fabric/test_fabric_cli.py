"""`python -m harness fabric status|down` on real namespaces (root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.fabric.builder import leftovers

from tests.fabric.conftest import require_fabric

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.root]
DEAD_SLOT_PREFIX = "pdh7-"  # the last slot: a bundled cluster takes it only when 0..6 are all busy


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "fabric", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_down_removes_what_a_dead_run_left_and_status_says_so():
    require_fabric()
    subprocess.run(["ip", "netns", "add", f"{DEAD_SLOT_PREFIX}h0"], check=True)
    try:
        status = harness("status")
        assert status.returncode == 0
        assert f"{DEAD_SLOT_PREFIX}h0" in status.stdout and "left behind (no live run)" in status.stdout
        down = harness("down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"{DEAD_SLOT_PREFIX}: removed" in down.stdout
        assert leftovers(prefix=DEAD_SLOT_PREFIX) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"{DEAD_SLOT_PREFIX}h0"], capture_output=True)
