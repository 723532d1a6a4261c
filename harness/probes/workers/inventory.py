"""The worker inventory of a foreign cluster (the cluster file's ``workers:``), made concrete:
which process on which host is each worker right now, is it healthy, and how does it come back.

A foreign engine has no admin API listing its processes, so the process faults of item 6.1.4
(kill, hang) find their target the way an operator would, on the worker's host, through that
host's executor (locally or over SSH; every command lands in the audit log):

* ``pgrep: PATTERN`` -> ``pgrep -f PATTERN`` (exactly one match required: a pattern that
  matches several processes could kill the wrong one);
* ``pid_file: PATH`` -> ``cat PATH``;
* ``systemd_unit: NAME`` -> ``systemctl show -p MainPID --value NAME`` (0 means not running).

Health is the worker's ``health`` URL answering 200 (else its ``api`` + ``/health``), read from
this machine: what a client or a load balancer sees.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import httpx

from harness.errors import ConfigError, ExecutorError, FaultError
from harness.hosts import Executor
from harness.waiting import wait_until

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class InventoryWorker:
    """One entry of ``workers:`` with its process resolved (``pid``) on ``host``."""

    id: str
    role: str
    host: str
    pid: int
    api: str
    health_url: str
    supervised: bool = False
    restart_cmd: tuple[str, ...] | None = None

    def as_target(self) -> dict[str, Any]:
        """The worker dict the process faults take (``ProcessKill.from_worker``)."""
        return {"id": self.id, "role": self.role, "pid": self.pid, "host": self.host}


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def locate_pid(worker: Any, ex: Executor, *, which: str = "process") -> int:
    """The pid of ``worker``'s process on its host, found as its ``process:`` entry says
    (``which="hang_process"``: the process a hang stops, that entry when given, else ``process:``)."""
    name = _field(worker, "name")
    proc = (_field(worker, "hang_process") if which == "hang_process" else None) or _field(worker, "process")
    if proc is None:
        raise ConfigError(f"worker {name!r} has no `process:` entry, so its process cannot be found",
                          fix=f"add `process: {{pgrep: PATTERN}}` (or pid_file / systemd_unit) to worker {name!r}")
    pattern, pid_file, unit = _field(proc, "pgrep"), _field(proc, "pid_file"), _field(proc, "systemd_unit")
    if pattern:
        res = ex.run(["pgrep", "-f", "--", str(pattern)], timeout=COMMAND_TIMEOUT_S, check=False)
        pids = [int(p) for p in res.stdout.split() if p.strip().isdigit()]
        if res.rc not in (0, 1):
            raise ExecutorError(f"pgrep failed on {ex.host} (rc {res.rc}): {res.stderr.strip()[:300]}",
                                fix="check that pgrep (procps) is installed on the host")
        if len(pids) != 1:
            raise FaultError(f"worker {name!r}: `pgrep -f {pattern}` on {ex.host} matched "
                             f"{len(pids)} processes {pids[:10]}" + (" (is it running?)" if not pids else ""),
                             fix=f"make worker {name!r}'s pgrep pattern match exactly its one process")
        return pids[0]
    if pid_file:
        res = ex.run(["cat", str(pid_file)], timeout=COMMAND_TIMEOUT_S, check=False)
        text = res.stdout.strip()
        if res.rc != 0 or not text.isdigit() or int(text) <= 1:
            raise FaultError(f"worker {name!r}: pid file {pid_file} on {ex.host} holds no pid "
                             f"({(res.stderr or text).strip()[:200] or 'empty'})",
                             fix="check the worker is running and writes its pid there")
        return int(text)
    if unit:
        res = ex.run(["systemctl", "show", "-p", "MainPID", "--value", str(unit)], timeout=COMMAND_TIMEOUT_S,
                     check=False)
        text = res.stdout.strip()
        if res.rc != 0 or not text.isdigit() or int(text) <= 1:
            raise FaultError(f"worker {name!r}: systemd unit {unit} on {ex.host} has no main process "
                             f"(MainPID {text or '?'}; {res.stderr.strip()[:200]})",
                             fix=f"start {unit}, or name the unit that runs the worker")
        return int(text)
    raise ConfigError(f"worker {name!r}: `process:` names no way to find it",
                      fix="give one of pgrep, pid_file or systemd_unit")


def health_url(worker: Any) -> str:
    url = _field(worker, "health")
    return str(url) if url else str(_field(worker, "api")).rstrip("/") + "/health"


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def resolve(workers: Iterable[Any], executor_for: Callable[[str | None], Executor], *,
            which: str = "process") -> list[InventoryWorker]:
    """Every inventory worker with its current pid (raises naming the worker that cannot be found);
    ``which="hang_process"``: the pid a hang stops."""
    out = []
    for w in workers:
        host = str(_field(w, "host") or "localhost")
        restart = _field(w, "restart")
        command = _field(restart, "command") if restart is not None else None
        out.append(InventoryWorker(
            id=str(_field(w, "name")), role=str(_field(w, "role")), host=host,
            pid=locate_pid(w, executor_for(host), which=which), api=str(_field(w, "api")), health_url=health_url(w),
            supervised=bool(_field(w, "supervised", False)),
            restart_cmd=("sh", "-c", str(command)) if command else None))
    return out


def wait_healthy(url: str, timeout_s: float) -> float | None:
    """Seconds until ``url`` answers 200, or None when it did not within ``timeout_s``."""
    t0 = time.monotonic()
    if wait_until(lambda: is_healthy(url), timeout_s, 0.05, max_interval_s=1.0, what=f"{url} to answer 200",
                  on_timeout="return"):
        return time.monotonic() - t0
    return None


__all__ = ["InventoryWorker", "health_url", "is_healthy", "locate_pid", "resolve", "wait_healthy"]
