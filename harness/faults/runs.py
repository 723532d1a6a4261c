"""Run records: what one harness run started, so that a later run (or ``python -m harness revert``)
can end what a dead run left behind before it starts anything itself.

A run that brings up a bundled cluster writes ``runs/<run-id>.json`` in the state dir first (owner
pid + start time, cluster, the router, the fabric slot) and exports ``HARNESS_RUN_ID=<run-id>``, so
every process it starts (router, workers, Locust and its forks) carries the id in its environment.
A leftover is identified safely: it is a process whose environment holds that exact id and that
started after the run did, while the run's owner is gone (pid + start time). Nothing else is ever
signalled. A clean exit removes the record.

- :func:`target_gone` says whether a ledger entry's bundled cluster is gone (its owner is dead and
  no process of its run remains): the fault died with it, and the entry is closed ``target_gone``.
- :func:`clean_dead_runs` ends a dead run's processes (SIGCONT first: a SIGSTOPped worker keeps its
  ports until it can handle SIGTERM), verifies them gone, and removes the run's fabric namespaces
  when no live run holds that slot's flock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from harness.faults.ledger import state_dir
from harness.faults.procstat import read_local

log = logging.getLogger(__name__)

RUN_ENV = "HARNESS_RUN_ID"
RUNS_SUBDIR = "runs"
TERM_GRACE_S = 5.0    # a leftover gets this long to exit on SIGTERM before SIGKILL
KILL_GRACE_S = 5.0


def _start_time(pid: int) -> int | None:
    stat = read_local(pid)
    return stat.start_time if stat is not None and stat.alive else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class RunRecord:
    """This process's run: written before anything is started, removed after a clean teardown."""

    def __init__(self, cluster: str, kind: str, state_dir_path: str | os.PathLike[str] | None = None) -> None:
        pid = os.getpid()
        self.directory = state_dir(state_dir_path).absolute() / RUNS_SUBDIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.run_id = f"{pid}-{uuid.uuid4().hex[:10]}"
        self.path = self.directory / f"{self.run_id}.json"
        self.data: dict[str, Any] = {"run_id": self.run_id, "owner_pid": pid, "owner_start": _start_time(pid),
                                     "cluster": cluster, "kind": kind, "created": time.time(),
                                     "router": None, "fabric": None}
        self._previous_env = os.environ.get(RUN_ENV)
        _write_json(self.path, self.data)
        os.environ[RUN_ENV] = self.run_id  # inherited by every process this run starts

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        _write_json(self.path, self.data)

    def set_router(self, pid: int | None, api_url: str | None = None) -> None:
        if pid:
            self.update(router={"pid": pid, "start": _start_time(pid), "api_url": api_url})

    def set_fabric(self, prefix: str) -> None:
        self.update(fabric={"prefix": prefix})

    def context(self) -> dict[str, Any]:
        """What a ledger entry stores about the cluster its fault is in (see :func:`target_gone`)."""
        return {"run_id": self.run_id, "owner_pid": self.data["owner_pid"], "owner_start": self.data["owner_start"],
                "cluster": self.data["cluster"], "kind": self.data["kind"], "router": self.data["router"]}

    def close(self) -> None:
        """The run tore down what it built: forget it."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._previous_env is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = self._previous_env


def _owner_alive(record: dict[str, Any]) -> bool:
    pid, start = record.get("owner_pid"), record.get("owner_start")
    return pid is not None and start is not None and _start_time(int(pid)) == start


def run_processes(record: dict[str, Any]) -> list[tuple[int, int]]:
    """(pid, start time) of every live process of the run: its id in the environment, started after
    the run's owner. Processes this user may not read are not ours and are skipped."""
    token = f"{RUN_ENV}={record['run_id']}".encode()
    floor = int(record.get("owner_start") or 0)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if token not in fh.read().split(b"\0"):
                    continue
        except OSError:
            continue
        start = _start_time(pid)
        if start is not None and start >= floor:
            found.append((pid, start))
    return found


def target_gone(context: dict[str, Any] | None) -> str | None:
    """Why the bundled cluster a ledger entry belongs to is gone (so the fault went with it), or
    None when it may still exist (or the entry names no bundled run: external clusters outlive us)."""
    if not context or context.get("kind") != "bundled" or not context.get("run_id"):
        return None
    if _owner_alive(context):
        return None
    router = context.get("router") or {}
    if router.get("pid") and _start_time(int(router["pid"])) == router.get("start"):
        return None
    left = run_processes(context)
    if left:
        return None
    what = f"router pid {router['pid']}" if router.get("pid") else "its processes"
    return (f"the bundled cluster {context.get('cluster')!r} of run {context['run_id']} is gone "
            f"(harness pid {context.get('owner_pid')} and {what} no longer run; no process of the run remains)")


def dead_runs(state_dir_path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    directory = state_dir(state_dir_path) / RUNS_SUBDIR
    out = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.warning("unreadable run record %s; ignored", path)
            continue
        if not _owner_alive(record):
            out.append({**record, "_path": str(path)})
    return out


def _signal(pid: int, start: int, sig: int) -> None:
    if _start_time(pid) == start:  # never a reused pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _wait_gone(procs: list[tuple[int, int]], timeout_s: float) -> list[tuple[int, int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = [(p, s) for p, s in procs if _start_time(p) == s]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)  # waiting for the kernel to end the processes


def end_processes(procs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """SIGCONT + SIGTERM, then SIGKILL: returns those still alive (none, unless unkillable)."""
    for pid, start in procs:
        _signal(pid, start, signal.SIGCONT)  # a stopped process handles SIGTERM only once resumed
        _signal(pid, start, signal.SIGTERM)
    left = _wait_gone(procs, TERM_GRACE_S)
    for pid, start in left:
        _signal(pid, start, signal.SIGKILL)
    return _wait_gone(left, KILL_GRACE_S)


def clean_dead_runs(state_dir_path: str | os.PathLike[str] | None = None, *, dry_run: bool = False,
                    say: Callable[[str], None] = log.warning) -> list[str]:
    """End every dead run's leftovers and namespaces; returns the problems (empty: all clean)."""
    problems: list[str] = []
    for record in dead_runs(state_dir_path):
        run = f"run {record['run_id']} (cluster {record.get('cluster')}, harness pid {record.get('owner_pid')})"
        procs = run_processes(record)
        if procs:
            say(f"{run}: {'would end' if dry_run else 'ending'} {len(procs)} leftover process(es): "
                f"{', '.join(str(p) for p, _ in procs)}")
            left = [] if dry_run else end_processes(procs)
            if left:
                problems.append(f"{run}: process(es) {', '.join(str(p) for p, _ in left)} survive SIGKILL")
        problems += _remove_fabric(record, run, dry_run, say)
        if not dry_run and not problems:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(record["_path"])
    return problems


def _remove_fabric(record: dict[str, Any], run: str, dry_run: bool, say: Callable[[str], None]) -> list[str]:
    prefix = (record.get("fabric") or {}).get("prefix")
    if not prefix:
        return []
    from harness.fabric.builder import fabric_unavailable_reason, leftovers, remove_prefixed
    from harness.fabric.cli import slot_held, slot_of

    if fabric_unavailable_reason():
        return []
    if slot_held(slot_of(prefix)):
        say(f"{run}: fabric slot {prefix} is held by a live run now; its namespaces are left to it")
        return []
    found = leftovers(prefix=prefix)
    if not found:
        return []
    say(f"{run}: {'would remove' if dry_run else 'removing'} {', '.join(found)}")
    if dry_run:
        return []
    from harness.hosts import LocalExecutor

    remove_prefixed(LocalExecutor(), prefix)
    still = leftovers(prefix=prefix)
    return [f"{run}: {', '.join(still)} could not be removed"] if still else []


__all__ = ["RUN_ENV", "RunRecord", "clean_dead_runs", "dead_runs", "end_processes", "run_processes", "target_gone"]
