"""Readings of this machine's /proc for the machine-health sampler (harness/probes/machine_health/machine.py):
CPU pressure (PSI), the load average, and per process its CPU use, its run-queue wait and its
descendants. Every reader tolerates a process that exits between listing and reading (None),
because the engine's workers come and go while the harness kills and restarts them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from harness.errors import ProbeError

PSI_CPU = Path("/proc/pressure/cpu")
PSI_ABSENT = ("no /proc/pressure/cpu on this kernel: CPU pressure is not measured (PSI needs Linux 4.20+ "
              "built with CONFIG_PSI, and psi=1 on the kernel command line where it is off by default)")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Psi:
    """One reading of /proc/pressure/cpu. ``*_total_us`` are cumulative stall microseconds since
    boot, so two readings give a window's exact stall share; avg10 is the kernel's own 10 s average."""

    some_total_us: int
    some_avg10: float
    full_total_us: int | None = None  # the "full" line exists for CPU since Linux 5.13
    full_avg10: float | None = None


def parse_psi(text: str, source: str = str(PSI_CPU)) -> Psi:
    """Parse the text of a PSI file (``some avg10=.. avg60=.. avg300=.. total=..`` and optionally a
    ``full`` line). Raises ProbeError naming the file when the ``some`` line is missing or malformed."""
    lines: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        kind, _, rest = line.strip().partition(" ")
        if kind in ("some", "full"):
            try:
                lines[kind] = dict(field.split("=", 1) for field in rest.split())
            except ValueError:
                raise ProbeError(f"{source}: malformed PSI line {line.strip()!r}",
                                 fix="expected `some avg10=N avg60=N avg300=N total=N`") from None
    try:
        some = lines["some"]
        full = lines.get("full")
        return Psi(some_total_us=int(some["total"]), some_avg10=float(some["avg10"]),
                   full_total_us=int(full["total"]) if full else None,
                   full_avg10=float(full["avg10"]) if full else None)
    except (KeyError, ValueError) as exc:
        raise ProbeError(f"{source}: no readable `some` line with avg10= and total= ({exc!r}) in {text[:120]!r}",
                         fix="expected the format of Documentation/accounting/psi.rst") from None


def read_psi(path: Path = PSI_CPU) -> Psi | None:
    """The machine's CPU pressure, or None when the kernel has no PSI (see :data:`PSI_ABSENT`)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:  # EOPNOTSUPP when built in but disabled (psi=0)
        raise ProbeError(f"{path}: cannot be read: {exc}", fix="boot with psi=1 to measure CPU pressure") from None
    return parse_psi(text, str(path))


def read_loadavg() -> tuple[float, int] | None:
    """(1-minute load average, tasks runnable right now): /proc/loadavg's 1st field and the
    numerator of its 4th (``running/total``), less the reading thread itself."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
        return float(fields[0]), max(0, int(fields[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return None


def read_steal_seconds() -> float | None:
    """CPU seconds the hypervisor ran something else while this (virtual) machine's CPUs had work,
    summed over all CPUs since boot: the 8th value of /proc/stat's ``cpu`` line. Invisible to PSI
    and to run-queue waits (the guest does not see its vCPU descheduled); 0 on bare metal."""
    try:
        with open("/proc/stat", "rb") as fh:
            fields = fh.readline().split()
        return int(fields[8]) / TICKS_PER_S if fields[0] == b"cpu" and len(fields) > 8 else None
    except (OSError, ValueError):
        return None


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (after comm, which may hold spaces and ')'), or None if gone.
    Read as bytes: this runs for every process of the machine at each descendants() scan."""
    try:
        with open(f"/proc/{pid}/stat", "rb", buffering=0) as fh:
            data = fh.read(4096)
    except OSError:
        return None
    return data.rpartition(b")")[2].split() or None


def cpu_and_start_seconds(pid: int) -> tuple[float, float] | None:
    """utime + stime of the whole process (all its threads) and its start time (seconds since
    boot, as ``time.clock_gettime(time.CLOCK_BOOTTIME)``); None when it is gone."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S, int(fields[19]) / TICKS_PER_S


def schedstat(pid: int) -> tuple[float, float, int] | None:
    """(seconds the process's threads ran on a CPU, seconds they were runnable but waited for one,
    times they were put on a CPU): /proc/PID/task/TID/schedstat summed over threads (a waiting
    thread is a waiting process). wait / dispatches is the mean delay the scheduler added each
    time the process woke; wait / (run + wait) the share of its runnable time without a CPU.
    None when the process is gone."""
    totals, seen = [0, 0, 0], False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            totals = [t + int(f) for t, f in zip(totals, fields[:3])]
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    if not seen:  # no task list readable: the process-level line (its main thread on old kernels)
        try:
            totals = [int(f) for f in Path(f"/proc/{pid}/schedstat").read_text().split()[:3]]
        except (OSError, ValueError):
            return None
        if len(totals) < 3:
            return None
    return totals[0] / 1e9, totals[1] / 1e9, totals[2]


def cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (children, their children, ...), by each process's ppid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out
