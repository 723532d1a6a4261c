"""Leak readings of an external cluster's workers (no admin API; docs/soak.md "On an external cluster").

Per worker, each tick of the soak's LeakSampler (harness/probes/workers/leaks.py):

* its **process**, found on its host as its ``process:`` entry says (harness/probes/workers/inventory.py
  ``locate_pid``: pid file, pgrep or systemd unit) and read from that host's /proc through the host's
  executor (locally, or over SSH): one command per host per tick for all its workers' pids, each
  command in the audit log. A pid is located again only when its process could not be read (killed,
  restarted under a new pid), so a steady cluster costs one command per host per tick;
* its **KV blocks in use** (and the pool's size) from its own ``metrics:`` page, read with the
  engine's metric profile (harness/probes/metrics/prometheus.py ``kv_blocks_used`` / ``kv_blocks_total``),
  None where the engine does not export them (the reason is kept: :attr:`kv_unmeasured`);
* its **health**: its health URL answering 200 from this machine.

Nothing here raises for a worker that cannot be read: a reading it could not take is None, and a
killed worker is exactly that for a tick or two.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import httpx

from harness.errors import HarnessError, ProbeError
from harness.hosts import Executor
from harness.probes.workers.inventory import COMMAND_TIMEOUT_S, health_url, is_healthy, locate_pid
from harness.probes.workers.leaks import ProcessReading, WorkerLeakReading
from harness.probes.metrics.prometheus import ENGINE_PROFILES, parse_metrics

log = logging.getLogger(__name__)

# one command per host: for each pid, a header line, its status lines of interest and its open fds
PROC_SCRIPT = ('for p in "$@"; do echo "@$p"; grep -E "^(VmRSS|Threads):" /proc/$p/status 2>/dev/null; '
               'echo "fds $(ls /proc/$p/fd 2>/dev/null | wc -l)"; done')
SCRAPE_TIMEOUT_S = 2.0


def parse_proc_output(text: str) -> dict[int, ProcessReading]:
    """:data:`PROC_SCRIPT`'s output -> pid -> reading; a pid without VmRSS (gone, a zombie) is left out."""
    out: dict[int, ProcessReading] = {}
    pid: int | None = None
    fields: dict[str, int] = {}

    def close() -> None:
        if pid is not None and "VmRSS" in fields and "Threads" in fields:
            out[pid] = ProcessReading(pid, fields["VmRSS"] * 1024, fields.get("fds", 0), fields["Threads"])

    for line in text.splitlines():
        line = line.strip()
        if line.startswith("@"):
            close()
            pid, fields = (int(line[1:]) if line[1:].isdigit() else None), {}
        elif line.startswith("fds "):
            fields["fds"] = int(line[4:]) if line[4:].strip().isdigit() else 0
        elif ":" in line:
            key, _, value = line.partition(":")
            number = value.split()[0] if value.split() else ""
            if number.isdigit():
                fields[key.strip()] = int(number)
    close()
    return out


def read_processes(ex: Executor, pids: Sequence[int]) -> dict[int, ProcessReading]:
    """The readings of ``pids`` on ``ex``'s host (one command); those it could not read are missing."""
    if not pids:
        return {}
    res = ex.run(["sh", "-c", PROC_SCRIPT, "sh", *(str(p) for p in pids)], timeout=COMMAND_TIMEOUT_S, check=False)
    if res.rc != 0:
        raise ProbeError(f"reading /proc on {ex.host} failed (rc {res.rc}): {res.stderr.strip()[:200]}",
                         fix="check the harness may run sh, grep and ls on the host (the executor's user)")
    return parse_proc_output(res.stdout)


def _total(text: str, family: str) -> int | None:
    """The sum of ``family``'s samples on a metrics page; None when the page does not export it."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(family))
    samples = [s for s in parse_metrics(lines) if s.name == family]
    return None if not samples else int(round(sum(s.value for s in samples)))


@dataclass
class ExternalLeakReader:
    """``reader()`` -> one WorkerLeakReading per inventory worker (see the module doc). ``workers``:
    the cluster file's ``workers:`` entries; ``executor_for``: host -> its executor (the fault runner's)."""

    workers: Sequence[Any]
    executor_for: Callable[[str | None], Executor]
    profile: str | None
    headers: Mapping[str, str] = field(default_factory=dict)
    _pids: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _absent: dict[str, str] = field(default_factory=dict, init=False, repr=False)   # worker -> why no KV figure
    _http: httpx.Client | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)   # sampler vs idle reads

    @property
    def kv_families(self) -> tuple[str | None, str | None]:
        quantities = ENGINE_PROFILES.get(self.profile or "", {})
        return quantities.get("kv_blocks_used"), quantities.get("kv_blocks_total")

    @property
    def kv_unmeasured(self) -> str | None:
        """Why KV blocks in use cannot be read on some worker (None: they could be read on every one
        scraped so far)."""
        if self.kv_families[0] is None:
            return (f"engine profile {self.profile!r} names no KV-blocks-in-use metric, so leaked KV blocks "
                    "cannot be measured on this cluster")
        if self._absent:
            wid, why = next(iter(sorted(self._absent.items())))
            return f"KV blocks in use could not be read on {', '.join(sorted(self._absent))} ({wid}: {why})"
        return None

    def __call__(self) -> list[WorkerLeakReading]:
        with self._lock:
            return self._read_all()

    def _read_all(self) -> list[WorkerLeakReading]:
        by_host: dict[str, list[Any]] = {}
        for w in self.workers:
            by_host.setdefault(str(w.host or "localhost"), []).append(w)
        processes: dict[str, ProcessReading] = {}
        for host, ws in by_host.items():
            ex = self.executor_for(host)
            for w in ws:
                if str(w.name) not in self._pids:
                    try:
                        self._pids[str(w.name)] = locate_pid(w, ex)
                    except HarnessError as exc:   # between a kill and the restart: no pid file yet
                        log.debug("leak reader: %s: %s", w.name, exc)
            mine = {str(w.name): self._pids[str(w.name)] for w in ws if str(w.name) in self._pids}
            try:   # one command for the host (two entries may name one process: read once)
                read = read_processes(ex, sorted(set(mine.values())))
            except HarnessError as exc:
                log.warning("leak reader: %s", exc)
                read = {}
            for name, pid in mine.items():
                if pid in read:
                    processes[name] = read[pid]
                else:   # gone (killed): find its new process at the next tick
                    self._pids.pop(name, None)
        return [self._reading(w, processes.get(str(w.name))) for w in self.workers]

    def kv_blocks(self) -> dict[str, int]:
        """Each worker's KV blocks in use now, for the workers whose engine exports the figure."""
        with self._lock:
            return {str(w.name): used for w in self.workers if (used := self._kv(w)[0]) is not None}

    def close(self) -> None:
        with self._lock:
            if self._http is not None:
                self._http.close()
                self._http = None

    def _reading(self, w: Any, proc: ProcessReading | None) -> WorkerLeakReading:
        used, total = self._kv(w)
        health = "healthy" if is_healthy(health_url(w), timeout_s=SCRAPE_TIMEOUT_S) else "unhealthy"
        return WorkerLeakReading(str(w.name), str(w.role), None if proc is None else proc.pid, health, used, total,
                                 None, None, proc)

    def _kv(self, w: Any) -> tuple[int | None, int | None]:
        used_family, total_family = self.kv_families
        name = str(w.name)
        if used_family is None:
            return None, None
        if not w.metrics:
            self._absent[name] = "no `metrics:` URL in the cluster file"
            return None, None
        if self._http is None:
            self._http = httpx.Client(timeout=SCRAPE_TIMEOUT_S, headers=dict(self.headers))
        try:
            resp = self._http.get(str(w.metrics))
            resp.raise_for_status()
        except httpx.HTTPError as exc:   # a killed or hung worker: no figure this tick
            log.debug("leak reader: %s metrics: %s", name, exc)
            return None, None
        used = _total(resp.text, used_family)
        if used is None:
            self._absent[name] = f"its metrics page {w.metrics} has no {used_family}"
        else:
            self._absent.pop(name, None)
        return used, None if total_family is None else _total(resp.text, total_family)


__all__ = ["ExternalLeakReader", "PROC_SCRIPT", "parse_proc_output", "read_processes"]
