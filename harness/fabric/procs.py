"""Child processes placed in fabric hosts: started behind a host's exec prefix, read line by line
with a deadline, and always stopped and reaped (the machine's pid 1 reaps nothing)."""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import shlex
import time
from typing import Any, Sequence

from harness.errors import ProbeError

log = logging.getLogger(__name__)


def remote_command(argv: Sequence[str]) -> str:
    """One shell command line for ``ssh HOST --``: runs argv (each word quoted) and kills it when
    the SSH channel's stdin closes (our stop(), or the harness dying), so nothing outlives us there.
    sh gives a background job /dev/null as stdin, hence the copy of the real one on fd 3."""
    return (f"exec 3<&0; {shlex.join(argv)} 3<&- & p=$!; "
            "(cat <&3 >/dev/null 2>&1; kill $p 2>/dev/null) >/dev/null 2>&1 & w=$!; exec 3<&-; "
            "wait $p; r=$?; kill $w 2>/dev/null; exit $r")


class HostProcess:
    """One child with line-based stdin/stdout (stderr kept for error messages). A context manager."""

    def __init__(self, prefix: Sequence[str], argv: Sequence[str], *, name: str) -> None:
        self.name = name
        self.argv = [*prefix, *argv]
        self.popen = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, bufsize=0)
        self._stderr = ""
        self._buf = b""

    @classmethod
    def on(cls, station: Any, argv: Sequence[str], *, name: str) -> HostProcess:
        """``argv`` on a probe station (harness.fabric.bandwidth.Station): behind its namespace
        prefix, or over SSH as one remote shell command (audited) that ends when our stdin
        closes, so stopping this child also ends the remote process."""
        if not station.remote:
            return cls(station.prefix, argv, name=name)
        if station.audit is not None:  # a script passed with -c is named, not copied, into the log
            logged = [a if "\n" not in a else f"<script: {a.splitlines()[0][:70]}... ({len(a)} chars)>" for a in argv]
            host = next((w.split("@", 1)[1] for w in reversed(station.prefix) if "@" in w), station.name)
            station.audit.write(host=host, argv=logged, rc=None, duration=0.0, dry_run=False, error=None,
                                via=f"ssh streaming child on {station.name}")
        return cls(station.prefix, [remote_command(argv)], name=name)

    @classmethod
    def python(cls, prefix: Sequence[str], module: str, *args: str, name: str) -> HostProcess:
        return cls(prefix, [sys.executable, "-m", module, *args], name=name)

    def __enter__(self) -> HostProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read_more(self, deadline: float, timeout_s: float) -> bool:
        """Append what stdout has to our buffer (waiting until ``deadline``); False at end of file.
        Our own buffer over the raw fd: a buffered reader would hide lines already read from select()."""
        fd = self.popen.stdout.fileno()  # type: ignore[union-attr]
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProbeError(f"{self.name} gave no output for {timeout_s:.0f} s: {self.stderr_tail()}",
                                 fix="check the fabric hosts and the process's stderr above")
            ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            if ready:
                chunk = os.read(fd, 65536)
                self._buf += chunk
                return bool(chunk)

    def readline(self, timeout_s: float) -> str:
        """The next stdout line (without newline); ProbeError if the child exits or stays silent."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            if not self._read_more(deadline, timeout_s):
                self.popen.wait(timeout=5)
                raise ProbeError(f"{self.name} exited with code {self.popen.returncode}: "
                                 f"{self.stderr_tail()}", fix="read the error above")
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def read_rest(self, timeout_s: float) -> str:
        """Everything the child still writes to stdout until it closes it and exits."""
        deadline = time.monotonic() + timeout_s
        while self._read_more(deadline, timeout_s):
            pass
        self.wait(max(1.0, deadline - time.monotonic()))
        data, self._buf = self._buf, b""
        return data.decode(errors="replace")

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((line + "\n").encode())
        self.popen.stdin.flush()

    def end_input(self) -> None:
        """Close the child's stdin: the probe ends take it as "stop now" (over SSH the remote end
        gets SIGTERM), then they print what they measured."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            try:
                self.popen.stdin.close()
            except OSError:
                pass

    def stderr_tail(self, chars: int = 1500) -> str:
        if self.popen.poll() is None:
            return "(still running)"
        if not self._stderr and self.popen.stderr is not None and not self.popen.stderr.closed:
            self._stderr = (self.popen.stderr.read() or b"").decode(errors="replace")
        return self._stderr[-chars:].strip() or "(no stderr)"

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ProbeError(f"{self.name} did not finish within {timeout_s:.0f} s",
                             fix="check the fabric link between the hosts") from None

    def stop(self) -> None:
        """Close stdin (a polite EOF), then SIGTERM, then SIGKILL; always reaps."""
        p = self.popen
        if p.stdin is not None and not p.stdin.closed:
            try:
                p.stdin.close()
            except OSError:
                pass
        if p.poll() is None:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) ignored SIGTERM; killing it", self.name, p.pid)
                    p.kill()
                    p.wait()
        for stream in (p.stdout, p.stderr):
            if stream is not None and not stream.closed:
                if stream is p.stderr and not self._stderr:
                    try:
                        os.set_blocking(stream.fileno(), False)
                        self._stderr = (stream.read() or b"").decode(errors="replace")
                    except (OSError, ValueError, TypeError):
                        pass
                stream.close()
