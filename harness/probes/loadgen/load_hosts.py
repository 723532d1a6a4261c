"""The load hosts of a distributed load run as the runner reaches them (harness.probes.loadgen.load_distributed):
where each is and how (:class:`LoadHostTarget`, from the cluster file's ``load_hosts:``), the shell
scripts run there, one host's part of the run (:class:`LoadWorker`: signalling its worker, copying its
log, removing its run folder) and the stream of its records read back over SFTP (:class:`RecordStream`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Sequence

from harness.errors import ConfigError, ProbeError
from harness.hosts import CommandResult, SSHExecutor, SSHTarget
from harness.probes.client.records import RecordWriter, RequestRecord

log = logging.getLogger(__name__)

KILL_GRACE_S = 10            # SIGTERM to SIGKILL on a load host
CHUNK = 1 << 20              # bytes read over SFTP at a time

# run on the load host with its python: the folder of this run (never reused), and where the
# harness's locustfile is (the harness must be installed for that python)
PREFLIGHT = ("import importlib.util, json, os, sys\n"
             "import locust\n"
             "spec = importlib.util.find_spec('harness.probes.loadgen.locustfile')\n"
             "os.makedirs(sys.argv[1], mode=0o700)\n"
             "print(json.dumps({'locustfile': spec.origin, 'locust': locust.__version__}))\n")
# the worker's SSH session: note its pid (to stop it), read the API key from a 0600 file (never in
# argv, so never in the audit log or ps), then become the worker itself
WORKER_SCRIPT = ('d=$1; shift\n'
                 'if [ -f "$d/api_key" ]; then HARNESS_LOAD_API_KEY=$(cat "$d/api_key"); '
                 'export HARNESS_LOAD_API_KEY; rm -f "$d/api_key"; fi\n'
                 'echo $$ > "$d/worker.pid"\n'
                 # the SSH session's process: when it goes (connection lost), the worker stops itself
                 'HARNESS_LOAD_PARENT_PID=$PPID; export HARNESS_LOAD_PARENT_PID\n'
                 'exec "$@"\n')
# signal the run's worker (the pid file's process, only while its command line names this run's log);
# TERM waits and escalates to KILL; exits 1 only when the process is still there at the end
SIGNAL_SCRIPT = ('d=$1; sig=$2; grace=$3\n'
                 'p=$(cat "$d/worker.pid" 2>/dev/null) || exit 0\n'
                 'alive() { tr "\\0" "\\n" < "/proc/$p/cmdline" 2>/dev/null | grep -qxF -- "$d/locust.log"; }\n'
                 'alive || { echo gone; exit 0; }\n'
                 'kill -s "$sig" "$p" 2>/dev/null\n'
                 '[ "$sig" = TERM ] || exit 0\n'
                 'n=0; while alive && [ $n -lt $((grace * 10)) ]; do sleep 0.1; n=$((n + 1)); done\n'
                 'alive || { echo stopped; exit 0; }\n'
                 'kill -s KILL "$p" 2>/dev/null\n'
                 'n=0; while alive && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done\n'
                 'alive && { echo "pid $p is still running after SIGKILL" >&2; exit 1; }\n'
                 'echo killed\n')


@dataclass(frozen=True)
class LoadHostTarget:
    """A load host as the runner reaches it: its name (records carry it), SSH, interpreter, folder."""

    name: str
    ssh: SSHTarget
    python: str = "python3"
    work_dir: str = "/tmp/harness-load"


def load_host_targets(spec: Any, *, dry_run: bool = False) -> list[LoadHostTarget]:
    """The cluster file's ``load_hosts:`` resolved (a bare name takes its host's address and SSH)."""
    from harness.clusterfile.load_hosts import resolved

    out = []
    for lh in spec.load_hosts:
        address, ssh = resolved(lh, spec.hosts)
        out.append(LoadHostTarget(lh.name, SSHTarget(
            host=address, user=ssh.user, key_filename=str(Path(ssh.key_file).expanduser()),
            known_hosts_file=str(Path(ssh.known_hosts).expanduser()), port=ssh.port,
            connect_timeout_s=ssh.connect_timeout_s, require_files=not dry_run), lh.python, lh.work_dir))
    return out


def master_bind_address(hosts: Sequence[LoadHostTarget]) -> str:
    """This machine's source address on the route to every load host (no packet is sent); the
    master listens there only. Hosts routed from different addresses need ``load_master.bind``."""
    sources: dict[str, str] = {}
    for h in hosts:
        try:
            family, _, _, _, addr = socket.getaddrinfo(h.ssh.host, h.ssh.port, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                sources[h.name] = s.getsockname()[0]
        except OSError as exc:
            raise ConfigError(f"no route from this machine to load host {h.name} ({h.ssh.host}): {exc}",
                              fix="check the load host's address, or set load_master.bind") from exc
    if len(set(sources.values())) != 1:
        raise ConfigError(f"the load hosts are reached from different addresses of this machine: {sources}",
                          fix="set load_master.bind to an address of this machine that every load host reaches")
    return next(iter(sources.values()))


class RecordStream:
    """Appends the complete lines that one load host's record files gained since the last pull to
    the run's records (``writer``), each naming that host. A line is taken only once it ends with a
    newline: the worker may be writing it right now."""

    def __init__(self, host: str, writer: RecordWriter) -> None:
        self.host = host
        self.writer = writer
        self.offsets: dict[str, int] = {}
        self.count = 0

    def pull(self, names: Iterable[str], open_file: Callable[[str], IO[bytes]], *, final: bool = False) -> int:
        """Read every file in ``names`` from where the last pull stopped; returns the records added.
        ``final``: the worker has exited, so a last line without its newline is a torn write (skipped)."""
        added = 0
        for name in sorted(names):
            start = self.offsets.get(name, 0)
            with open_file(name) as fh:
                fh.seek(start)
                pending = b""
                while True:
                    chunk = fh.read(CHUNK)
                    if not chunk:
                        break
                    pending += chunk
                    cut = pending.rfind(b"\n") + 1
                    for line in pending[:cut].splitlines():
                        added += self._add(name, line)
                    start += cut
                    pending = pending[cut:]
            self.offsets[name] = start
            if final and pending.strip():
                log.warning("load host %s: skipping the torn last line of %s", self.host, name)
        self.count += added
        return added

    def _add(self, name: str, line: bytes) -> int:
        if not line.strip():
            return 0
        try:
            record = RequestRecord.from_dict(json.loads(line))
        except (ValueError, TypeError, ProbeError) as exc:
            raise ProbeError(f"load host {self.host}: {name} holds a line that is not a request record: {exc}",
                             fix="the load host must run the same harness version as this machine") from exc
        self.writer.write(dataclasses.replace(record, load_host=self.host))
        return 1


@dataclass
class LoadWorker:
    """One load host's part of the run, and what is done on its host alone."""

    target: LoadHostTarget
    remote_dir: str
    control: SSHExecutor                 # preflight, signals, SFTP, clean-up
    session: SSHExecutor                 # holds the worker process for the run (its own connection)
    locustfile: str = ""
    thread: threading.Thread | None = None
    result: CommandResult | None = None
    error: str | None = None
    signalled: bool = False              # the harness sent it SIGTERM/SIGKILL (its exit code is ours)
    made: bool = False                   # its run folder exists on the host
    sftp: Any = None
    stream: RecordStream | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.target.name

    def tail(self, n: int = 800) -> str:
        if self.error:
            return self.error[-n:]
        if self.result is None:
            return ""
        return (self.result.stderr or self.result.stdout).strip()[-n:]

    def signal(self, sig: str) -> str:
        """Signal the run's worker on its host; TERM: until it is gone. ``gone``, ``stopped`` or ``killed``."""
        res = self.control.run(["sh", "-c", SIGNAL_SCRIPT, "sh", self.remote_dir, sig, str(KILL_GRACE_S)],
                               timeout=KILL_GRACE_S + 20, check=False)
        self.signalled |= res.stdout.strip() in ("stopped", "killed")  # then its exit code is ours, not a failure
        if res.rc != 0:
            raise ProbeError(f"load host {self.name}: the run's Locust worker is still running: "
                             f"{(res.stderr or res.stdout).strip()}",
                             fix=f"end it by hand on {self.name} (its pid is in {self.remote_dir}/worker.pid)")
        return res.stdout.strip()

    def copy_log(self, local: Path) -> None:
        """The worker's log, then what its SSH session said, into ``local``."""
        with open(local, "wb") as out:
            if self.sftp is not None:
                try:
                    with self.sftp.open(f"{self.remote_dir}/locust.log", "rb") as fh:
                        shutil.copyfileobj(fh, out)
                except OSError:
                    pass  # the worker never started logging: its session output below says why
            tail = "\n".join(p for p in (self.error, self.result and self.result.stdout,
                                         self.result and self.result.stderr, *self.notes) if p)
            if tail:
                out.write(f"\n--- SSH session ---\n{tail}\n".encode())

    def remove_folder(self) -> None:
        if self.made:
            self.control.run(["rm", "-rf", "--", self.remote_dir], timeout=30)
