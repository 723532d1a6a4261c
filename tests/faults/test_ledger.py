from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.errors import ConfigError, FaultError
from harness.faults import Ledger, LedgerStatus, state_dir

LOCAL = {"kind": "local"}


def test_entries_move_through_statuses_and_outstanding_is_lifo(tmp_path):
    ledger = Ledger.for_cluster("local", tmp_path)
    ids = [ledger.add({"kind": "process_hang", "fault_id": f"f{i}"}, LOCAL) for i in range(3)]
    assert [e["status"] for e in ledger.entries()] == ["pending"] * 3
    ledger.update(ids[0], LedgerStatus.ACTIVE)
    ledger.update(ids[1], LedgerStatus.REVERTED)
    ledger.update(ids[2], LedgerStatus.REVERT_FAILED, error="boom")
    # this process owns them and is alive: left to it unless asked
    assert ledger.outstanding() == []
    assert [e["id"] for e in ledger.outstanding(include_live_owners=True)] == [ids[2], ids[0]]
    assert ledger.entries()[2]["error"] == "boom"
    assert ledger.prune() == 1 and len(ledger.entries()) == 2
    with pytest.raises(FaultError, match="no entry"):
        ledger.update("000999-x", LedgerStatus.REVERTED)


def test_entries_of_a_dead_harness_are_outstanding(tmp_path):
    ledger = Ledger.for_cluster("local", tmp_path)
    entry_id = ledger.add({"kind": "process_hang"}, LOCAL)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    doc = json.loads(ledger.path.read_text())
    doc["entries"][0]["owner_pid"] = proc.pid  # as if that (now dead) process had written it
    ledger.path.write_text(json.dumps(doc))
    assert [e["id"] for e in ledger.outstanding()] == [entry_id]


def test_file_is_written_atomically_and_survives_reload(tmp_path):
    ledger = Ledger.for_cluster("prod-a", tmp_path)
    for i in range(20):
        ledger.add({"kind": "process_kill", "fault_id": str(i)}, LOCAL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["faults-prod-a.json", "faults-prod-a.json.lock"]
    reloaded = Ledger(ledger.path)
    assert [e["seq"] for e in reloaded.entries()] == list(range(1, 21))
    assert Ledger.all_in(tmp_path)[0].cluster == "prod-a"


def test_concurrent_writers_lose_nothing(tmp_path):
    code = ("import sys; from harness.faults.ledger import Ledger\n"
            "lg = Ledger.for_cluster('c', sys.argv[1])\n"
            "for i in range(25): lg.add({'kind': 'x', 'fault_id': sys.argv[2] + str(i)}, {'kind': 'local'})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), tag]) for tag in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    entries = Ledger.for_cluster("c", tmp_path).entries()
    assert len(entries) == 50 and len({e["seq"] for e in entries}) == 50


def test_unreadable_ledger_and_bad_cluster_name_are_clear_errors(tmp_path):
    ledger = Ledger.for_cluster("local", tmp_path)
    ledger.path.write_text("{ half a ledger")
    with pytest.raises(FaultError, match="unreadable") as err:
        ledger.entries()
    assert "by hand" in err.value.fix
    with pytest.raises(ConfigError, match="cannot name a ledger file"):
        Ledger.for_cluster("../etc/passwd", tmp_path)


def test_state_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HARNESS_STATE_DIR", raising=False)
    assert str(state_dir()) == "state"
    monkeypatch.setenv("HARNESS_STATE_DIR", str(tmp_path))
    assert state_dir() == tmp_path
    assert state_dir("explicit") != tmp_path
