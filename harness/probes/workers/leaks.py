"""Leak readings over a soak run: per worker its KV blocks in use (the admin API) and, for a local
cluster, its process's memory, file descriptors and threads (/proc); the harness's own as well.

A leak of a few KV blocks or a few MB per fault only shows over hours, so the sampler must run that
long without becoming a leak itself: each sample is appended to a JSON-lines file as soon as it is
taken and only a small running summary stays in memory; :func:`read_samples` streams the file back
for the check (harness/checks/leaks.py). A process is a worker id plus a pid: a restarted worker is
a new process whose figures start afresh. Every reader tolerates a process that exits between the
worker table and /proc (its reading is None), because the soak kills and restarts workers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from harness.engine.admin.models import AdminWorker
from harness.errors import ProbeError
from harness.probes.machine_health import selfmem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessReading:
    """One process's figures at one moment: resident memory (VmRSS), open file descriptors, threads."""

    pid: int
    rss_bytes: int
    fds: int
    threads: int

    @property
    def rss_mb(self) -> float:
        """Resident memory in MB of 2**20 bytes (the unit of soak.leaks' rss_growth_mb_per_h)."""
        return self.rss_bytes / (1 << 20)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessReading:
        return cls(int(data["pid"]), int(data["rss_bytes"]), int(data["fds"]), int(data["threads"]))


def read_process(pid: int, proc: Path | str = "/proc") -> ProcessReading | None:
    """``pid``'s reading from ``proc``/PID/status (VmRSS, Threads) and the entries of its fd folder;
    None when it is gone, a zombie (no VmRSS), or not readable by this user (another user's fds)."""
    base = Path(proc) / str(pid)
    try:
        status = (base / "status").read_text()
        fds = len(os.listdir(base / "fd"))
    except OSError:   # gone (ENOENT, ESRCH) or not ours (EACCES)
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        rss_kb = int(fields["VmRSS"].split()[0])
        threads = int(fields["Threads"].split()[0])
    except (KeyError, ValueError, IndexError):   # a zombie has no VmRSS
        return None
    return ProcessReading(pid, rss_kb * 1024, fds, threads)


@dataclass(frozen=True)
class WorkerLeakReading:
    """One worker at one sample: its admin API row's figures (an external cluster's: its engine's
    metrics, None where the engine exports no such figure), and its process's reading when the process
    could be read (else None)."""

    id: str
    role: str
    pid: int | None
    health: str
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    num_running: int | None
    active_requests: int | None
    process: ProcessReading | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerLeakReading:
        proc = data.get("process")

        def count(key: str) -> int | None:
            return None if data.get(key) is None else int(data[key])

        return cls(str(data["id"]), str(data["role"]), data.get("pid"), str(data["health"]),
                   count("kv_blocks_used"), count("kv_blocks_total"), count("num_running"),
                   count("active_requests"), None if proc is None else ProcessReading.from_dict(proc))


@dataclass(frozen=True)
class LeakSample:
    """Everything one tick read: wall time ``t`` (time.time()), the harness's own process, the workers,
    and the harness's live Python memory blocks (harness/probes/machine_health/selfmem.py; None in older files)."""

    t: float
    harness: ProcessReading | None
    workers: tuple[WorkerLeakReading, ...]
    harness_py_blocks: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeakSample:
        harness = data.get("harness")
        blocks = data.get("harness_py_blocks")
        return cls(float(data["t"]), None if harness is None else ProcessReading.from_dict(harness),
                   tuple(WorkerLeakReading.from_dict(w) for w in data.get("workers") or ()),
                   None if blocks is None else int(blocks))


def take_sample(workers: Sequence[AdminWorker | WorkerLeakReading], *, local: bool,
                proc: Path | str = "/proc") -> LeakSample:
    """One sample of ``workers`` now: rows of the admin API's table (/proc is read only when ``local``),
    or readings an external cluster's reader already took (harness/probes/workers/external_leaks.py), kept as they are."""
    return LeakSample(time.time(), read_process(os.getpid(), proc), tuple(
        w if isinstance(w, WorkerLeakReading) else
        WorkerLeakReading(w.id, w.role, w.pid, w.health, w.kv_blocks_used, w.kv_blocks_total, w.num_running,
                          w.active_requests,
                          read_process(w.pid, proc) if local and w.pid is not None else None)
        for w in workers), selfmem.python_blocks())


def read_samples(path: Path | str) -> Iterator[LeakSample]:
    """The samples of a sampler's file, in order, one at a time. A last line cut short (the run was
    killed mid-write) is skipped with a warning; a bad line before it is a ProbeError."""
    path = Path(path)
    try:
        fh = path.open(encoding="utf-8")
    except OSError as exc:
        raise ProbeError(f"cannot read leak samples {path}: {exc}",
                         fix="pass the file the LeakSampler of this run wrote") from None
    with fh:
        pending: tuple[int, str] | None = None
        for number, line in enumerate(fh, 1):
            if pending is not None:
                yield _parse(path, *pending)
            pending = (number, line) if line.strip() else None
        if pending is not None:
            try:
                yield _parse(path, *pending)
            except ProbeError as exc:
                log.warning("skipped the last leak sample of %s, cut short: %s", path, exc.message)


def _parse(path: Path, number: int, line: str) -> LeakSample:
    try:
        return LeakSample.from_dict(json.loads(line))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProbeError(f"{path}:{number}: not a leak sample ({exc!r}): {line[:120]!r}",
                         fix="pass a file written by LeakSampler, unedited") from None


class LeakSampler:
    """Every ``interval_s`` in a thread until :meth:`stop` (always joined): calls ``workers`` (the
    admin API's worker table, whose pids it reads in /proc when ``local``; or an external cluster's
    readings, harness/probes/workers/external_leaks.py), and appends one JSON
    line per sample to ``path``. A tick whose ``workers`` call raises is logged and skipped (the
    router may be restarting); the sampler never takes the run down. Memory: the summary only."""

    def __init__(self, workers: Callable[[], Sequence[AdminWorker | WorkerLeakReading]], path: Path | str, *,
                 interval_s: float = 2.0, local: bool = True, proc: Path | str = "/proc") -> None:
        if not 0.01 <= interval_s <= 3600:
            raise ProbeError(f"leak sampling interval {interval_s!r} s is out of range",
                             fix="use 0.01 to 3600 s (2 s by default)")
        self.workers = workers
        self.path = Path(path)
        self.interval_s = interval_s
        self.local = local
        self._proc = proc
        self._lock = threading.Lock()     # one writer at a time: the thread, or a caller's sample_now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: Any = None
        self._count = 0
        self.skipped = 0                  # ticks whose worker table could not be read
        self.last_error: str | None = None
        self._warned: set[str] = set()
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.kv_blocks_used: dict[str, int] = {}   # worker id -> at the latest sample

    @property
    def count(self) -> int:
        """Samples written so far."""
        return self._count

    def summary(self) -> dict[str, Any]:
        """What the sampler knows without reading its file back: counts, span, latest KV figures."""
        with self._lock:
            return {"path": str(self.path), "samples": self._count, "skipped_ticks": self.skipped,
                    "interval_s": self.interval_s, "local": self.local, "first_t": self.first_t,
                    "last_t": self.last_t, "last_error": self.last_error,
                    "kv_blocks_used": dict(self.kv_blocks_used)}

    # -- lifecycle --
    def start(self) -> LeakSampler:
        if self._thread is not None:
            raise ProbeError("this leak sampler was already started", fix="create one sampler per run")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ProbeError(f"cannot write leak samples to {self.path}: {exc}",
                             fix="pass a path in a writable folder (the run's output folder)") from None
        self._thread = threading.Thread(target=self._run, name="leak-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling, join the thread and close the file. Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> LeakSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        due = time.monotonic()   # the first sample at once: the run's starting figures
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            self.sample_now()
            due += self.interval_s
            if due < time.monotonic():   # fell behind (a starved machine): no burst of late samples
                due = time.monotonic() + self.interval_s

    def sample_now(self) -> LeakSample | None:
        """Take and append one sample now (also from another thread than the sampler's); None when
        the tick was skipped. Only after :meth:`start`."""
        try:
            table = list(self.workers())
        except Exception as exc:  # noqa: BLE001 -- a sampler must never take the run down
            self._skip("the worker table could not be read", exc)
            return None
        selfmem.trim()   # the harness's RSS as what it holds, not what its allocator kept (selfmem.py)
        try:
            sample = take_sample(table, local=self.local, proc=self._proc)
            line = sample.to_json() + "\n"
        except Exception as exc:  # noqa: BLE001 -- e.g. a row without the fields a sample needs
            self._skip("a sample could not be taken", exc)
            return None
        with self._lock:
            if self._file is None:
                raise ProbeError("the leak sampler is not running", fix="call start() first (or use `with`)")
            self._file.write(line)
            self._file.flush()   # a killed run keeps every sample taken
            self._count += 1
            self.first_t = sample.t if self.first_t is None else self.first_t
            self.last_t = sample.t
            self.kv_blocks_used = {w.id: w.kv_blocks_used for w in sample.workers}
        return sample

    def _skip(self, what: str, exc: Exception) -> None:
        message = f"leak sampler: {what}, tick skipped: {exc!r}"
        with self._lock:
            self.skipped += 1
            self.last_error = message
        key = f"{what}: {type(exc).__name__}"
        if key not in self._warned:   # a router down for a minute: one warning, not thirty
            self._warned.add(key)
            log.warning("%s", message)
        else:
            log.debug("%s", message)


__all__ = ["LeakSample", "LeakSampler", "ProcessReading", "WorkerLeakReading", "read_process", "read_samples",
           "take_sample"]
