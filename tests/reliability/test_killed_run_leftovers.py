"""What a SIGKILLed run leaves is cleaned (issue 34 item 3): a real harness run (the kill-point
test's cycle suite, harness/faults/network.py's nic_flap on the bundled cluster's fabric) is
SIGKILLed while its flap loop runs, with every process of its run (a CI job cancelled, an OOM kill
of the session: the flap loop dies too, its pid file stale, and the cluster goes with it, so its
ledger entry is closed ``target_gone`` and no revert runs the loop's own cleanup). The loop's files
in the fault helpers' folder on the host (``/tmp/pdh-faults/<fault id>.log``, ``.pid``) are then
removed by ``python -m harness revert``, and, after a second such kill, by the next run before it
brings its cluster up. Only the dead run's files: each fault's own, named by its ledger entry.

Planted defect it catches: the recovery before this change (no helper-file step; run on that tree
with this test) leaves the log and the stale pid file."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from harness.fabric.builder import fabric_unavailable_reason
from harness.faults import Ledger
from harness.faults.host_loop import STATE_DIR

from .machine import marked_processes
from .test_kill_points import CLUSTER, Point, harness_revert, reap_orphans, start_harness, wait_for

pytestmark = pytest.mark.slow


def helper_files(state: Path) -> list[str]:
    """Files in the helpers' folder that belong to a fault of this state dir's ledgers."""
    ids = {e["fault"].get("fault_id") for ledger in Ledger.all_in(state) for e in ledger.entries()}
    folder = Path(STATE_DIR)
    return sorted(p.name for p in folder.iterdir() if p.name.split(".")[0] in ids) if folder.is_dir() else []


def killed_during_a_flap(tmp_path: Path, state: Path, tag: str) -> list[str]:
    marker = uuid.uuid4().hex
    proc, phases, log = start_harness(tmp_path, state, ["nic_flap"], tag, marker, 7)
    try:
        reached = wait_for(Point(0, "nic_flap", "active", "SIGKILL", 0.0), proc, phases, state)
        proc.kill()
        proc.wait(timeout=60)
        for _ in range(50):  # then every process of the run, as a cancelled CI job's tree is
            left = marked_processes("KP_MARK", marker)
            if not left:
                break
            for line in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split()[1]), signal.SIGKILL)
            time.sleep(0.1)
            reap_orphans()
    finally:
        log.close()
    reap_orphans()
    assert reached, (tmp_path / f"harness-{tag}.log").read_text()[-3000:]
    return helper_files(state)


@pytest.mark.timeout(900)
def test_revert_and_the_next_run_remove_what_a_killed_run_s_fault_helper_left(tmp_path):
    if (reason := fabric_unavailable_reason()) is not None:
        pytest.skip(f"nic_flap needs the fabric: {reason}")
    (tmp_path / "killpoint.yaml").write_text(CLUSTER.format(fabric="true", decode=1))
    (tmp_path / "test_cycle.py").write_text((Path(__file__).with_name("cycle_suite.py")).read_text())
    state = tmp_path / "state"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the killed harness's orphans are reaped here
    try:
        left = killed_during_a_flap(tmp_path, state, "kill-1")
        assert any(n.endswith(".log") for n in left) and any(n.endswith(".pid") for n in left), left  # log, stale pid
        revert = harness_revert(state)
        reap_orphans()
        assert revert.returncode == 0, revert.stdout[-2000:] + revert.stderr[-2000:]
        assert helper_files(state) == [], (left, revert.stdout[-2000:])

        left = killed_during_a_flap(tmp_path, state, "kill-2")
        assert left
        proc, _phases, log = start_harness(tmp_path, state, [], "next", uuid.uuid4().hex, 7)  # no fault of its own
        try:
            rc = proc.wait(timeout=400)
        finally:
            log.close()
        reap_orphans()
        assert rc == 0, (tmp_path / "harness-next.log").read_text()[-3000:]
        assert helper_files(state) == [], left
    finally:
        libc.prctl(36, 0, 0, 0, 0)
