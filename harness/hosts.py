"""Run commands on a host: locally (subprocess, no shell) or over SSH (paramiko, strict host keys).

Every command, dry run included, appends one JSON line to the audit log. A dry-run executor prints
and logs what it would run and runs nothing. ``executor_from_spec`` rebuilds an executor from the
spec stored in the fault ledger, so a later ``python -m harness revert`` reaches the same host the
same way without a cluster file.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TextIO

from harness.errors import ConfigError, ExecutorError

log = logging.getLogger(__name__)

LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})
EOF_GRACE_S = 2.0  # how long an SSH command's output may still come after its exit status
STATE_DIR_ENV = "HARNESS_STATE_DIR"


def state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state dir: ``explicit`` (``--state-dir``), else ``$HARNESS_STATE_DIR``, else ``state/`` in the
    cwd. The audit log (``audit.jsonl``) lives there beside the fault ledgers (harness.faults.ledger);
    here, in a leaf, so a probe that runs commands on hosts finds it without the fault package."""
    return Path(explicit or os.environ.get(STATE_DIR_ENV) or "state")


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str
    duration: float  # seconds


class AuditLog:
    """Append-only JSON-lines file; safe across threads and processes (one locked append per line)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, **entry: Any) -> None:
        line = json.dumps({"time": time.time(), "pid": os.getpid(), **entry}, sort_keys=True) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            fh.write(line)
            fh.flush()

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]


def describe_command(host: str, argv: list[str]) -> str:
    """How a command is shown in plans, dry runs and errors: ``host$ quoted argv``."""
    return f"{host}$ {shlex.join(argv)}"


def _check_argv(argv: list[str]) -> list[str]:
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise ExecutorError(f"a command must be a non-empty list of strings, got {argv!r}",
                            fix="pass argv as a list, e.g. ['kill', '-s', 'STOP', '1234']; no shell strings")
    return list(argv)


class Executor(ABC):
    """Runs one argv on one host. ``run`` raises ExecutorError on failure to run, or on rc != 0 when check."""

    host: str

    def __init__(self, *, audit: AuditLog | None = None, dry_run: bool = False, out: TextIO | None = None) -> None:
        self.audit = audit
        self.dry_run = dry_run
        self._out = out

    def describe(self, argv: list[str]) -> str:
        """The line a dry run prints for argv; faults build their plan() from it so both agree."""
        return describe_command(self.host, argv)

    def run(self, argv: list[str], *, timeout: float, check: bool = True) -> CommandResult:
        argv = _check_argv(argv)
        if timeout <= 0:
            raise ExecutorError(f"timeout must be > 0 seconds, got {timeout}", fix="pass a positive timeout")
        if self.dry_run:
            print(f"[dry-run] {self.describe(argv)}", file=self._out or sys.stdout, flush=True)
            self._audit(argv, rc=None, duration=0.0, dry_run=True)
            return CommandResult(0, "", "", 0.0)
        t0 = time.monotonic()
        try:
            result = self._run(argv, timeout)
        except ExecutorError as exc:
            self._audit(argv, rc=None, duration=time.monotonic() - t0, dry_run=False, error=str(exc))
            raise
        self._audit(argv, rc=result.rc, duration=result.duration, dry_run=False)
        log.debug("%s rc=%s in %.3fs", self.describe(argv), result.rc, result.duration)
        if check and result.rc != 0:
            raise ExecutorError(f"command failed on {self.host} with rc={result.rc}: {shlex.join(argv)}: "
                                f"{(result.stderr or result.stdout).strip()[:500]}")
        return result

    def _audit(self, argv: list[str], *, rc: int | None, duration: float, dry_run: bool,
               error: str | None = None) -> None:
        if self.audit is not None:
            self.audit.write(host=self.host, argv=argv, rc=rc, duration=round(duration, 6),
                             dry_run=dry_run, error=error)

    @abstractmethod
    def _run(self, argv: list[str], timeout: float) -> CommandResult: ...

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """JSON-able description from which executor_from_spec rebuilds an equivalent executor."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalExecutor(Executor):
    host = "localhost"

    def _run(self, argv: list[str], timeout: float) -> CommandResult:
        t0 = time.monotonic()
        try:
            # subprocess.run kills and reaps the child on timeout
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            raise ExecutorError(f"command not found on localhost: {argv[0]!r}",
                                fix=f"install {argv[0]!r} or put it on PATH") from exc
        except subprocess.TimeoutExpired as exc:
            raise ExecutorError(f"command timed out after {timeout}s on localhost: {shlex.join(argv)}",
                                fix="raise the timeout or check why the command hangs") from exc
        return CommandResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)

    def spec(self) -> dict[str, Any]:
        return {"kind": "local"}


@dataclass(frozen=True)
class SSHTarget:
    """How to reach a host over SSH. Key authentication and a known_hosts file are both required."""

    host: str
    user: str
    key_filename: str
    known_hosts_file: str
    port: int = 22
    connect_timeout_s: float = 10.0
    # False for a dry run's targets: printed in its plan, never connected, so the files need not exist
    require_files: bool = True

    def __post_init__(self) -> None:
        if not self.host or not self.user:
            raise ConfigError(f"SSH target needs host and user, got host={self.host!r} user={self.user!r}",
                              fix="set host and user for every SSH host in the cluster file")
        if not 0 < int(self.port) < 65536:
            raise ConfigError(f"SSH port {self.port} for {self.host} is out of range", fix="use a port in 1..65535")
        for name in ("key_filename", "known_hosts_file") if self.require_files else ():
            path = getattr(self, name)
            if not path or not Path(path).is_file():
                raise ConfigError(f"SSH {name} for {self.host} is not a readable file: {path!r}",
                                  fix=f"point {name} at an existing file (host keys are never accepted blindly)")
            # absolute: the ledger stores it, and `harness revert` may run from another directory
            object.__setattr__(self, name, str(Path(path).expanduser().absolute()))


class SSHExecutor(Executor):
    """Runs argv on a remote host; unknown or changed host keys are rejected, never learned."""

    def __init__(self, target: SSHTarget, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target
        self.host = target.host if target.port == 22 else f"{target.host}:{target.port}"
        self._client: Any = None
        self._connect_lock = threading.Lock()

    def _connect(self) -> Any:
        import paramiko  # imported here so local-only runs never pay for it

        with self._connect_lock:
            if self._client is not None and self._client.get_transport() and self._client.get_transport().is_active():
                return self._client
            t = self.target
            client = paramiko.SSHClient()
            client.load_host_keys(t.known_hosts_file)  # our file only: never the user's, never written back
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
            entry = t.host if t.port == 22 else f"[{t.host}]:{t.port}"
            try:
                client.connect(t.host, port=t.port, username=t.user, key_filename=t.key_filename,
                               look_for_keys=False, allow_agent=False, timeout=t.connect_timeout_s,
                               banner_timeout=t.connect_timeout_s, auth_timeout=t.connect_timeout_s)
            except paramiko.BadHostKeyException as exc:
                client.close()
                raise ExecutorError(
                    f"host key of {entry} CHANGED: it does not match {t.known_hosts_file} (possible man-in-the-middle"
                    f"; the server offered {exc.key.get_name()} {exc.key.fingerprint})",
                    fix=f"if the host was legitimately re-keyed, remove the old entry with "
                        f"`ssh-keygen -R '{entry}' -f {t.known_hosts_file}` and add the verified new key") from exc
            except paramiko.AuthenticationException as exc:
                client.close()
                raise ExecutorError(f"SSH key authentication as {t.user!r} to {entry} failed: {exc}",
                                    fix=f"add the public key of {t.key_filename} to ~{t.user}/.ssh/authorized_keys "
                                        f"on {t.host}") from exc
            except paramiko.SSHException as exc:
                client.close()
                if "not found in known_hosts" in str(exc):
                    raise ExecutorError(f"host key of {entry} is unknown: no entry in {t.known_hosts_file}",
                                        fix=f"verify the host's key and add it, e.g. `ssh-keyscan -p {t.port} "
                                            f"{t.host} >> {t.known_hosts_file}` after checking its fingerprint") from exc
                raise ExecutorError(f"SSH connection to {entry} failed: {exc}",
                                    fix="check that sshd runs there and accepts key authentication") from exc
            except OSError as exc:  # refused, unreachable, timed out
                client.close()
                raise ExecutorError(f"cannot reach {entry} over SSH: {exc}",
                                    fix="check host, port and that sshd is running") from exc
            self._client = client
            return client

    def _run(self, argv: list[str], timeout: float) -> CommandResult:
        client = self._connect()
        command = shlex.join(argv)  # the remote shell sees each argument as one literal word
        t0 = time.monotonic()
        deadline = t0 + timeout

        def timed_out(chan: Any) -> ExecutorError:
            chan.close()
            return ExecutorError(f"command timed out after {timeout}s on {self.host}: {command}",
                                 fix="raise the timeout or check why the command hangs")

        try:
            chan = client.get_transport().open_session(timeout=timeout)
            chan.exec_command(command)
            chan.settimeout(0.02)  # a read waits at most this long, so both streams drain as they come
            out, err = bytearray(), bytearray()
            eof, status_at = False, None
            # read until the channel's EOF, not only until the exit status: the status can be handled
            # before the last output is (a command's last line was lost), and a chatty stderr must not
            # stall stdout (shared window). A server that never sends EOF gets EOF_GRACE_S after it.
            while not eof:
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                try:
                    chunk = chan.recv(65536)
                except socket.timeout:
                    chunk = None
                if chunk == b"":
                    eof = True
                elif chunk:
                    out += chunk
                now = time.monotonic()
                if status_at is None and chan.exit_status_ready():
                    status_at = now
                if status_at is not None and now - status_at > EOF_GRACE_S:
                    break
                if now >= deadline:
                    raise timed_out(chan)
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            remaining = deadline - time.monotonic()
            if not chan.status_event.wait(max(remaining, 0)):  # EOF came; the status follows it
                raise timed_out(chan)
            rc = chan.recv_exit_status()
            chan.close()
        except ExecutorError:
            raise
        except Exception as exc:  # paramiko raises several unrelated types for a dropped link
            self.close()
            raise ExecutorError(f"SSH command on {self.host} failed: {exc}: {command}",
                                fix="check the SSH link; the command may or may not have run") from exc
        return CommandResult(rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - t0)

    def sftp(self) -> Any:
        """An SFTP session over this host's connection (paramiko.SFTPClient; the caller closes it):
        files are read back through it in pieces, never whole into memory as a command's output is."""
        if self.dry_run:
            raise ExecutorError(f"a dry run opens no SFTP session to {self.host}", fix="read files only in a real run")
        return self._connect().open_sftp()

    def spec(self) -> dict[str, Any]:
        t = self.target
        return {"kind": "ssh", "host": t.host, "port": t.port, "user": t.user,
                "key_filename": t.key_filename, "known_hosts_file": t.known_hosts_file}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def executor_from_spec(spec: Mapping[str, Any], *, audit: AuditLog | None = None, dry_run: bool = False,
                       out: TextIO | None = None) -> Executor:
    kind = spec.get("kind")
    if kind == "local":
        return LocalExecutor(audit=audit, dry_run=dry_run, out=out)
    if kind == "ssh":
        target = SSHTarget(host=spec["host"], port=int(spec.get("port", 22)), user=spec["user"],
                           key_filename=spec["key_filename"], known_hosts_file=spec["known_hosts_file"])
        return SSHExecutor(target, audit=audit, dry_run=dry_run, out=out)
    raise ConfigError(f"unknown executor kind {kind!r} in {dict(spec)!r}", fix="use 'local' or 'ssh'")


class ExecutorPool:
    """``pool(host) -> Executor``: local for localhost, SSH for hosts listed in ``ssh``; one per host, reused."""

    def __init__(self, ssh: Mapping[str, SSHTarget] | None = None, *, audit: AuditLog | None = None,
                 dry_run: bool = False, out: TextIO | None = None, local: Iterable[str] = ()) -> None:
        self.ssh = dict(ssh or {})
        self.local = set(local)   # more names of this machine (a cluster file's hosts without ``ssh:``)
        self.audit, self.dry_run, self.out = audit, dry_run, out
        self._executors: dict[str, Executor] = {}
        self._lock = threading.Lock()

    def __call__(self, host: str | None) -> Executor:
        key = host or "localhost"
        with self._lock:
            if key not in self._executors:
                if key in self.ssh:
                    self._executors[key] = SSHExecutor(self.ssh[key], audit=self.audit, dry_run=self.dry_run,
                                                       out=self.out)
                elif key in LOCAL_HOSTS or key in self.local:
                    self._executors[key] = LocalExecutor(audit=self.audit, dry_run=self.dry_run, out=self.out)
                else:
                    raise ConfigError(f"no SSH settings for host {key!r} (known: {sorted(self.ssh) or 'none'}; "
                                      f"this machine: {sorted(LOCAL_HOSTS - {''} | self.local)})",
                                      fix=f"list {key!r} under the cluster file's hosts: with `ssh: {{user, key_file, "
                                          "known_hosts}` for another machine, or without `ssh:` when it is this one")
            return self._executors[key]

    def use_audit(self, audit: AuditLog) -> None:
        """Audit through ``audit`` from now on, executors already handed out included."""
        with self._lock:
            self.audit = audit
            for ex in self._executors.values():
                ex.audit = audit

    def close(self) -> None:
        with self._lock:
            for ex in self._executors.values():
                ex.close()
            self._executors.clear()


ExecutorFactory = Callable[[str | None], Executor]
