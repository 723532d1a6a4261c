"""The pattern loop the network faults run on their target host (harness/faults/network.py): a
shell loop that injects, waits, restores and waits again ``count`` times, logging each change on
the host and stopped through a stop file, so a harness that dies never leaves it half-way.
"""

from __future__ import annotations

import shlex
import threading
import time
from typing import Sequence

from harness.errors import FaultError
from harness.hosts import CommandResult, Executor

STATE_DIR = "/tmp/pdh-faults"   # on the target host: loop pid and stop files
COMMAND_TIMEOUT_S = 15.0


class HostLoop:
    """A pattern loop on the target host: ``count`` times (inject, sleep on_s, restore, sleep off_s);
    with ``group`` > 0, every ``group``-th wait is ``gap_s`` instead of ``off_s`` (bursts in groups
    with calm gaps between them)."""

    def __init__(self, fault_id: str, inject: Sequence[Sequence[str]], restore: Sequence[Sequence[str]],
                 count: int, on_s: float, off_s: float, *, group: int = 0, gap_s: float = 0.0) -> None:
        self.pid_file, self.stop_file = f"{STATE_DIR}/{fault_id}.pid", f"{STATE_DIR}/{fault_id}.stop"
        self.log_file = f"{STATE_DIR}/{fault_id}.log"
        self.inject, self.restore, self.count, self.on_s, self.off_s = inject, restore, count, on_s, off_s
        self.group, self.gap_s = group, gap_s
        self._thread: threading.Thread | None = None
        self.result: CommandResult | None = None

    def script(self) -> str:
        on = "; ".join(shlex.join(a) for a in self.inject)
        off = "; ".join(shlex.join(a) for a in self.restore)
        # Transitions go to a log file on the host, never to our pipe: if the harness dies, a write
        # to its closed pipe would kill the loop half-way (link left down). PIPE and HUP are ignored
        # for the same reason (an SSH session that drops); TERM and INT restore before exiting.
        return (f"mkdir -p {STATE_DIR}; echo $$ > {self.pid_file}; : > {self.log_file}; trap '' PIPE HUP; "
                f"trap '{off}; rm -f {self.pid_file}; exit 0' TERM INT; i=0; "
                f"while [ $i -lt {self.count} ] && [ ! -e {self.stop_file} ]; do "
                f"{on}; echo \"on $(date +%s.%N)\" >> {self.log_file}; sleep {self.on_s:g}; "
                f"{off}; echo \"off $(date +%s.%N)\" >> {self.log_file}; i=$((i+1)); "
                f"if [ $i -lt {self.count} ] && [ ! -e {self.stop_file} ]; then {self._wait()}; fi; "
                f"done; rm -f {self.pid_file}")

    def _wait(self) -> str:
        if self.group <= 0:
            return f"sleep {self.off_s:g}"
        return f"if [ $((i % {self.group})) -eq 0 ]; then sleep {self.gap_s:g}; else sleep {self.off_s:g}; fi"

    def argv(self) -> list[str]:
        return ["sh", "-c", self.script()]

    @property
    def duration_s(self) -> float:
        gaps = (self.count - 1) // self.group if self.group > 0 else 0
        return self.count * (self.on_s + self.off_s) + gaps * (self.gap_s - self.off_s)

    def start(self, ex: Executor) -> None:
        ex.run(["rm", "-f", self.stop_file], timeout=COMMAND_TIMEOUT_S, check=False)

        def run() -> None:
            self.result = ex.run(self.argv(), timeout=self.duration_s + 60, check=False)

        self._thread = threading.Thread(target=run, name=f"fault-loop-{self.pid_file}", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def transitions(self, ex: Executor) -> list[tuple[str, float]]:
        """("on" | "off", wall time) of each change the loop made, from its log on the host."""
        res = ex.run(["cat", self.log_file], timeout=COMMAND_TIMEOUT_S, check=False)
        return [(w, float(t)) for w, t in (line.split() for line in res.stdout.splitlines()
                                           if line.startswith(("on ", "off ")))]

    def alive(self, ex: Executor) -> bool:
        """The loop still runs: its pid file exists and names a live process (a SIGKILLed loop leaves the file)."""
        check = f'test -e {self.pid_file} && kill -0 "$(cat {self.pid_file})" 2>/dev/null'
        return ex.run(["sh", "-c", check], timeout=COMMAND_TIMEOUT_S, check=False).rc == 0

    def stop(self, ex: Executor, *, restore: bool = True) -> str:
        """Ask the loop to end, wait until it is gone (it may be a crashed run's), restore once more."""
        ex.run(["sh", "-c", f"mkdir -p {STATE_DIR} && touch {self.stop_file}"], timeout=COMMAND_TIMEOUT_S)
        limit = self.on_s + max(self.off_s, self.gap_s) + 10
        deadline = time.monotonic() + limit
        if self._thread is not None:
            self.wait(limit)
        while self.alive(ex):
            if time.monotonic() > deadline:
                raise FaultError(f"the fault loop ({self.pid_file}) did not stop within {limit:.0f} s",
                                 fix=f"kill the process in {self.pid_file} on the host, then revert again")
            time.sleep(0.1)  # the loop finishes its current sleep, then sees the stop file
        for argv in self.restore if restore else ():
            ex.run(list(argv), timeout=COMMAND_TIMEOUT_S)
        ex.run(["rm", "-f", self.stop_file, self.pid_file, self.log_file], timeout=COMMAND_TIMEOUT_S, check=False)
        return "loop stopped; restored" if restore else "loop stopped"


def remove_leftovers(ex: Executor, fault_id: str) -> str:
    """Remove what a dead run's fault helper left in :data:`STATE_DIR` on its host: the files of
    this fault only (``<fault_id>.*``: a loop's or a fill's log, its stop file, a stale pid file);
    the folder stays (live runs share it: removing it races a loop that is starting). Called by the recovery for ledger entries whose owner run
    is dead (harness/faults/recovery.py). A pid file that names a live process keeps every file of
    the fault (a helper still running is not a leftover): the line returned says so."""
    if not fault_id.isalnum():
        return f"fault id {fault_id!r}: not a plain id, nothing removed"
    files = f"{STATE_DIR}/{fault_id}.*"
    script = (f"for p in {files}; do case $p in *.pid) kill -0 \"$(cat \"$p\" 2>/dev/null)\" 2>/dev/null && "
              f"{{ echo \"$p\"; exit 3; }};; esac; done; n=0; for f in {files}; do [ -e \"$f\" ] && n=$((n+1)); "
              f"done; rm -f {files}; echo $n")
    res = ex.run(["sh", "-c", script], timeout=COMMAND_TIMEOUT_S, check=False)
    if res.rc == 3:
        return f"left {files}: {res.stdout.strip()} names a live process"
    if res.rc != 0:
        return f"could not remove {files}: {res.stderr.strip()[-300:]}"
    count = res.stdout.strip()
    return f"removed {count} leftover file(s) {files}" if count not in ("", "0") else ""

