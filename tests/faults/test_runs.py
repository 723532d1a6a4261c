"""Run records and recovery before bring-up: a dead run's stopped leftover is ended (and only it),
an entry whose bundled cluster died with its run is closed ``target_gone`` (audited), a revert that
truly cannot be done still fails (exit 4), stored paths are absolute. (Signals: test_signals.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.errors import RevertError
from harness.faults import FaultRunner, HbmFill, Ledger
from harness.hosts import SSHTarget
from harness.faults.procstat import read_local
from harness.faults.runs import RUN_ENV, RunRecord, clean_dead_runs, target_gone

from .conftest import harness_revert, proc_state


def dead_process() -> tuple[int, int]:
    """(pid, start time) of a process that existed and is gone now."""
    proc = subprocess.Popen(["sleep", "30"])
    start = read_local(proc.pid).start_time
    proc.kill()
    proc.wait()
    return proc.pid, start


def dead_run_context(cluster: str = "local") -> dict:
    owner, owner_start = dead_process()
    router, router_start = dead_process()
    return {"run_id": f"{owner}-deadbeef00", "owner_pid": owner, "owner_start": owner_start, "cluster": cluster,
            "kind": "bundled", "router": {"pid": router, "start": router_start, "api_url": "http://127.0.0.1:9"}}


def write_dead_run(state: Path, context: dict, fabric: dict | None = None) -> Path:
    runs = state / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / f"{context['run_id']}.json"
    path.write_text(json.dumps({**context, "created": time.time(), "fabric": fabric}))
    return path


def add_hbm_entry(ledger: Ledger, context: dict | None) -> str:
    fault = HbmFill(admin_url="http://127.0.0.1:9", worker_id="decode-0", share=0.5)
    entry = ledger.add(fault.to_ledger(), {"kind": "local"}, context)
    ledger.update(entry, "active")
    return entry


def test_an_entry_whose_bundled_cluster_is_gone_is_closed_target_gone(tmp_path):
    ledger = Ledger.for_cluster("local", tmp_path)
    context = dead_run_context()
    entry = add_hbm_entry(ledger, context)
    assert "is gone" in target_gone(context)
    runner = FaultRunner(ledger, recover_on_enter=False, handle_signals=False)
    (record,) = runner.recover(include_live_owners=True)
    assert record.output.startswith("target gone:") and record.status.value == "succeeded"
    (stored,) = ledger.entries()
    assert stored["id"] == entry and stored["status"] == "target_gone" and "is gone" in stored["error"]
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert any(a.get("status") == "target_gone" and a.get("fault_id") == stored["fault"]["fault_id"] for a in audit)
    assert ledger.outstanding(include_live_owners=True) == []


def test_a_revert_that_cannot_be_done_still_exits_4(tmp_path):
    ledger = Ledger.for_cluster("ext", tmp_path)
    add_hbm_entry(ledger, None)  # an external cluster: its admin API does not answer, nothing proves it gone
    with pytest.raises(RevertError):
        FaultRunner(ledger, recover_on_enter=False, handle_signals=False).recover(include_live_owners=True)
    assert ledger.entries()[0]["status"] == "revert_failed"
    proc = harness_revert("--state-dir", str(tmp_path), "--force")
    assert proc.returncode == 4, proc.stdout + proc.stderr


def test_a_live_router_is_not_gone(tmp_path):
    context = dead_run_context()
    live = subprocess.Popen(["sleep", "30"])
    try:
        context["router"] = {"pid": live.pid, "start": read_local(live.pid).start_time}
        assert target_gone(context) is None
        assert target_gone(None) is None and target_gone({**context, "kind": "external"}) is None
    finally:
        live.kill()
        live.wait()


def test_a_dead_runs_stopped_leftover_is_ended_and_nothing_else(tmp_path):
    context = dead_run_context()
    write_dead_run(tmp_path, context)
    leftover = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_ENV: context["run_id"]})
    bystander = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_ENV: "someone-else"})
    try:
        os.kill(leftover.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(leftover.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc_state(leftover.pid) == "T"
        said: list[str] = []
        assert clean_dead_runs(tmp_path, dry_run=True, say=said.append) == [] and proc_state(leftover.pid) == "T"
        assert any(f"would end 1 leftover process(es): {leftover.pid}" in s for s in said), said
        assert clean_dead_runs(tmp_path, say=said.append) == []
        assert leftover.wait(timeout=10) == -signal.SIGTERM  # resumed, then ended by SIGTERM
        assert bystander.poll() is None, "a process of another run must never be touched"
        assert not list((tmp_path / "runs").glob("*.json")), "a cleaned run's record is removed"
    finally:
        for p in (leftover, bystander):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()


def test_a_live_runs_record_and_processes_are_left_alone(tmp_path):
    record = RunRecord("local", "bundled", tmp_path)
    child = subprocess.Popen(["sleep", "60"])  # carries HARNESS_RUN_ID: this (live) run's own
    try:
        assert clean_dead_runs(tmp_path) == []
        assert child.poll() is None and record.path.exists()
        assert record.context()["owner_pid"] == os.getpid() and target_gone(record.context()) is None
    finally:
        child.kill()
        child.wait()
        record.close()
    assert not record.path.exists() and os.environ.get(RUN_ENV) is None


def test_ssh_paths_are_stored_absolute(tmp_path, monkeypatch):
    (tmp_path / "key").write_text("k")
    (tmp_path / "known").write_text("")
    monkeypatch.chdir(tmp_path)
    target = SSHTarget(host="h", user="u", key_filename="key", known_hosts_file="known")
    assert target.key_filename == str(tmp_path / "key") and target.known_hosts_file == str(tmp_path / "known")
    assert Ledger.for_cluster("x", "rel-state").path == tmp_path / "rel-state" / "faults-x.json"


def test_harness_revert_ends_a_dead_runs_leftover_without_any_ledger(tmp_path):
    context = dead_run_context()
    write_dead_run(tmp_path, context)
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env={**os.environ, RUN_ENV: context["run_id"]})
    try:
        proc = harness_revert("--state-dir", str(tmp_path))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "ending 1 leftover process(es)" in proc.stdout
        assert leftover.wait(timeout=10) == -signal.SIGTERM
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()
