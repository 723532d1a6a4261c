"""The persistent fault ledger: what was (or may have been) injected, so it can always be reverted.

One JSON file per cluster under the state dir (``--state-dir``, else ``$HARNESS_STATE_DIR``, else
``state/`` in the cwd). Every change is read-modify-write under an fcntl lock on a sidecar lock file
and lands with tmp + fsync + rename, so a SIGKILL at any instant leaves the old or the new file,
never a torn one. An entry is written as ``pending`` BEFORE its fault is injected.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from harness.errors import ConfigError, FaultError
from harness.faults.procstat import read_local
# the state dir is shared with the audit log (harness.hosts); re-exported: callers import it from here too
from harness.hosts import STATE_DIR_ENV, state_dir  # noqa: F401

log = logging.getLogger(__name__)

LEDGER_VERSION = 1
KEEP_REVERTED = 500  # history kept for reports; older reverted entries are dropped on add
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class LedgerStatus(str, enum.Enum):
    PENDING = "pending"              # written, injection may or may not have happened
    ACTIVE = "active"                # injected (and verified, or being verified)
    REVERTED = "reverted"            # revert ran and its effect was verified
    REVERT_FAILED = "revert_failed"  # the cluster may be dirty; retried by the next recovery
    TARGET_GONE = "target_gone"      # the cluster the fault was in is gone (checked): nothing left to revert


OUTSTANDING = frozenset({LedgerStatus.PENDING, LedgerStatus.ACTIVE, LedgerStatus.REVERT_FAILED})
_CLOSED = frozenset({LedgerStatus.REVERTED.value, LedgerStatus.TARGET_GONE.value})


class Ledger:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()  # stored paths must work from any directory
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.path.with_name(self.path.name + ".lock")

    @classmethod
    def for_cluster(cls, cluster: str, state_dir_path: str | os.PathLike[str] | None = None) -> Ledger:
        if not _NAME_RE.match(cluster):
            raise ConfigError(f"cluster name {cluster!r} cannot name a ledger file",
                              fix="use letters, digits, '.', '_' and '-' only")
        return cls(state_dir(state_dir_path) / f"faults-{cluster}.json")

    @staticmethod
    def all_in(state_dir_path: str | os.PathLike[str] | None = None) -> list[Ledger]:
        d = state_dir(state_dir_path)
        return [Ledger(p) for p in sorted(d.glob("faults-*.json"))] if d.is_dir() else []

    @property
    def cluster(self) -> str:
        name = self.path.name
        return name[len("faults-"):-len(".json")] if name.startswith("faults-") else self.path.stem

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Lock, load, let the caller mutate the document, write it back atomically."""
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            doc = self._load()
            before = json.dumps(doc, sort_keys=True)
            yield doc
            if json.dumps(doc, sort_keys=True) != before:
                self._write(doc)

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"version": LEDGER_VERSION, "cluster": self.cluster, "next_seq": 1, "entries": []}
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
            if doc.get("version") != LEDGER_VERSION or not isinstance(doc.get("entries"), list):
                raise ValueError(f"unsupported ledger version {doc.get('version')!r}")
        except ValueError as exc:
            raise FaultError(f"fault ledger {self.path} is unreadable: {exc}",
                             fix="inspect it, revert what it lists by hand, then move it aside") from exc
        return doc

    def _write(self, doc: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dfd = os.open(self.path.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def add(self, fault: dict[str, Any], executor: dict[str, Any], context: dict[str, Any] | None = None) -> str:
        """Record a fault as pending before it is injected; returns the entry id. ``context`` says
        what the target belongs to (a bundled cluster's run: see harness.faults.runs)."""
        now = time.time()
        with self._locked() as doc:
            seq = doc["next_seq"]
            doc["next_seq"] = seq + 1
            entry_id = f"{seq:06d}-{fault.get('fault_id', '')}"
            doc["entries"].append({
                "id": entry_id, "seq": seq, "status": LedgerStatus.PENDING.value, "fault": fault,
                "executor": executor, "owner_pid": os.getpid(), "owner_start": _start_time(os.getpid()),
                "created": now, "updated": now, "error": None, "context": context or None,
            })
            reverted = [e for e in doc["entries"] if e["status"] in _CLOSED]
            if len(reverted) > KEEP_REVERTED:
                drop = {e["id"] for e in reverted[:len(reverted) - KEEP_REVERTED]}
                doc["entries"] = [e for e in doc["entries"] if e["id"] not in drop]
        log.debug("ledger %s: %s pending", self.path, entry_id)
        return entry_id

    def update(self, entry_id: str, status: LedgerStatus, error: str | None = None) -> None:
        with self._locked() as doc:
            for entry in doc["entries"]:
                if entry["id"] == entry_id:
                    entry.update(status=LedgerStatus(status).value, updated=time.time(), error=error)
                    return
        raise FaultError(f"fault ledger {self.path} has no entry {entry_id!r}",
                         fix="another process may have pruned it; check the ledger file")

    def entries(self) -> list[dict[str, Any]]:
        with self._locked() as doc:
            return [dict(e) for e in doc["entries"]]

    def outstanding(self, *, include_live_owners: bool = False) -> list[dict[str, Any]]:
        """Entries still to revert, newest first (LIFO). Entries whose owning harness still runs are
        left to it unless include_live_owners."""
        out = [e for e in self.entries() if LedgerStatus(e["status"]) in OUTSTANDING]
        if not include_live_owners:
            out = [e for e in out if not _owner_alive(e)]
        return sorted(out, key=lambda e: e["seq"], reverse=True)

    def prune(self) -> int:
        """Drop reverted entries; returns how many were dropped."""
        with self._locked() as doc:
            keep = [e for e in doc["entries"] if e["status"] not in _CLOSED]
            dropped = len(doc["entries"]) - len(keep)
            doc["entries"] = keep
        return dropped


def _start_time(pid: int) -> int | None:
    stat = read_local(pid)
    return stat.start_time if stat is not None and stat.alive else None


def _owner_alive(entry: dict[str, Any]) -> bool:
    """True while the harness process that wrote the entry still runs (pid reuse ruled out)."""
    pid, start = entry.get("owner_pid"), entry.get("owner_start")
    return pid is not None and start is not None and _start_time(int(pid)) == start
