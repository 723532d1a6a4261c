"""Parse /proc/PID/stat: the process state letter and its start time, which with the pid
identifies a process for good (a pid can be reused; pid + start time cannot)."""

from __future__ import annotations

from dataclasses import dataclass

DEAD_STATES = frozenset({"Z", "X"})  # exited, only waiting for the parent to reap it


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str        # R, S, D, T (stopped by signal), t (traced), Z, X, ...
    start_time: int   # clock ticks since boot (field 22)

    @property
    def alive(self) -> bool:
        return self.state not in DEAD_STATES


def parse_proc_stat(text: str) -> ProcStat:
    """Parse one /proc/PID/stat line. comm (field 2) may hold spaces and ')', so split at the last ')'."""
    head, sep, tail = text.rpartition(")")
    fields = tail.split()
    if not sep or len(fields) < 20 or "(" not in head:
        raise ValueError(f"not a /proc/PID/stat line: {text[:200]!r}")
    return ProcStat(pid=int(head.split("(", 1)[0]), state=fields[0], start_time=int(fields[19]))


def read_local(pid: int) -> ProcStat | None:
    """The local process's stat, or None when no such pid exists."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            return parse_proc_stat(fh.read())
    except (FileNotFoundError, ProcessLookupError):
        return None
