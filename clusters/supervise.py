"""Supervision shared by the proof clusters' launchers (clusters/vllm/launch.py, clusters/dynamo/launch.py).

Standard library only. An :class:`Instance` is one supervised server process in its own session (so a
restart can kill what its last incarnation left behind); a :class:`Supervisor` starts the instances,
then the router (or frontend) in front of them, waits until each answers its health URL, and on every
``tick()`` restarts whatever exited and keeps the pid files current. The launcher that uses it becomes
a child subreaper and reaps the orphans its servers leave.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
PR_SET_CHILD_SUBREAPER = 36
LOG_PREFIX = ["launch"]  # the launcher's name in its log lines; a launcher sets LOG_PREFIX[0] once


def log(msg: str) -> None:
    print(f"[{LOG_PREFIX[0]} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class LaunchError(RuntimeError):
    """A process did not come up; the message says which and where its log is."""


@dataclass
class Instance:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: str | None  # None: no health endpoint (the router's metrics port)
    run_dir: Path
    popen: subprocess.Popen | None = None
    restarts: int = 0
    engine_pid: int | None = None
    started_at: float = 0.0
    exits: list[int] = field(default_factory=list)
    announced: bool = False  # "healthy again" logged for this incarnation

    def start(self) -> None:
        with open(self.log_path, "ab") as out:
            out.write(f"\n==== start {time.strftime('%F %T')} restarts={self.restarts}\n".encode())
            out.flush()
            # Own session/process group: a restart can kill what the last incarnation left behind.
            self.popen = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
        self.engine_pid, self.started_at, self.announced = None, time.monotonic(), False
        _write_pid(self.run_dir / f"{self.name}.pid", self.popen.pid)
        (self.run_dir / f"{self.name}.engine.pid").unlink(missing_ok=True)
        log(f"started {self.name} pid {self.popen.pid} (log {self.log_path})")

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def find_engine(self) -> int | None:
        """The EngineCore pid (a vLLM instance's child titled ``<name>::EngineCore``), recorded once found."""
        if self.engine_pid is None and self.alive():
            for pid in _children(self.popen.pid):
                if _cmdline(pid).startswith(f"{self.name}::EngineCore"):
                    self.engine_pid = pid
                    _write_pid(self.run_dir / f"{self.name}.engine.pid", pid)
        return self.engine_pid

    def stop_group(self, grace_s: float) -> None:
        """SIGCONT + SIGTERM the whole process group, SIGKILL it after ``grace_s``; reap the leader."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the leader's pid is the group id
        for sig in (signal.SIGCONT, signal.SIGTERM, signal.SIGCONT):
            _killpg(pgid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (self.popen.poll() is None or _group_alive(pgid)):
            time.sleep(0.2)
        _killpg(pgid, signal.SIGKILL)
        self.popen.wait()


def _write_pid(path: Path, pid: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{pid}\n")
    tmp.replace(path)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def unpin_groups(pgids: set[int]) -> list[str]:
    """Give every CPU this process may use back to each thread of the process groups ``pgids`` that
    runs on fewer (``os.sched_setaffinity`` per thread id). Returns one line per thread changed:
    its group, name, id and the CPUs it had. vLLM's NIXL worker on CPU pins its model thread to the
    last core of each NUMA node (clusters/vllm/nixl_hosts.py says why that starves a small machine)."""
    allowed = os.sched_getaffinity(0)
    changed = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) not in pgids:
                continue
            tasks = list((stat.parent / "task").iterdir())
        except (OSError, IndexError, ValueError):
            continue
        for task in tasks:
            try:
                tid = int(task.name)
                cpus = os.sched_getaffinity(tid)
                if cpus < allowed:
                    os.sched_setaffinity(tid, allowed)
                    name = (task / "comm").read_text().strip()
                    changed.append(f"group {fields[2]}: {name} (thread {tid}) had CPUs "
                                   f"{','.join(map(str, sorted(cpus)))}")
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    return changed


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap_orphans(tracked: set[int]) -> None:
    """As child subreaper we inherit orphaned vLLM workers; wait() for every child we did not Popen."""
    for pid in _children(os.getpid()):
        if pid not in tracked:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001  (any failure means "not healthy yet")
        return False


def check_ports_free(ports: dict[str, int]) -> None:
    """Fail fast (not after a minute of vLLM start-up) when a fixed port is taken, e.g. by another launcher."""
    for what, port in ports.items():
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is fine
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                raise LaunchError(f"port {port} ({what}) is not free ({exc.strerror}): is a launcher already "
                                  f"running? Stop it, or find the owner with: ss -ltnp 'sport = :{port}'") from None



class Supervisor:
    def __init__(self, instances: list[Instance], router: Instance, startup_timeout_s: float) -> None:
        self.instances, self.router, self.startup_timeout_s = instances, router, startup_timeout_s
        self.stopping = False

    def everyone(self) -> list[Instance]:
        return [*self.instances, self.router]

    def starting_failure(self, p: Instance) -> str | None:
        """A failure that starting instance ``p``'s log already shows, as the launcher's one error, or
        None (here none; clusters/vllm/nixl_hosts.py's HostedSupervisor reads NIXL's and UCX's)."""
        return None

    def exit_detail(self, p: Instance) -> str:
        """What to add to "exited while starting" about ``p`` (e.g. its log's last error line)."""
        return ""

    def wait_healthy(self, procs: list[Instance]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(procs)
        while pending:
            for p in list(pending):
                alive = p.alive()
                if named := self.starting_failure(p):
                    raise LaunchError(named)
                if not alive:
                    raise LaunchError(f"{p.name} exited with code {p.popen.returncode} while starting"
                                      f"{self.exit_detail(p)}: see {p.log_path}")
                if healthy(p.health_url):
                    log(f"{p.name} healthy after {time.monotonic() - p.started_at:.0f} s")
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise LaunchError(f"{', '.join(p.name for p in pending)} not healthy after "
                                  f"{self.startup_timeout_s:.0f} s: see their logs in {pending[0].log_path.parent}")
            if self.stopping:
                raise KeyboardInterrupt
            time.sleep(1.0)

    def start(self) -> None:
        for inst in self.instances:
            inst.start()
        self.wait_healthy(self.instances)
        for inst in self.instances:
            inst.find_engine()
        self.router.start()
        self.wait_healthy([self.router])

    def tick(self) -> None:
        """One supervision step: restart whatever exited, record new engine pids, reap orphans."""
        for inst in self.everyone():
            inst.find_engine()
            if inst.alive():
                if inst.restarts and not inst.announced and healthy(inst.health_url, timeout_s=0.5):
                    inst.announced = True
                    log(f"{inst.name} healthy again after {time.monotonic() - inst.started_at:.0f} s "
                        f"(restart {inst.restarts}, engine pid {inst.engine_pid})")
                continue
            code = inst.popen.returncode
            inst.exits.append(code)
            log(f"{inst.name} (pid {inst.popen.pid}) exited with code {code}; restarting it")
            inst.stop_group(grace_s=2.0)  # kill what it left behind (its Worker outlives a dead EngineCore)
            inst.restarts += 1
            inst.start()
        reap_orphans({i.popen.pid for i in self.everyone() if i.popen})

    def stop(self) -> None:
        procs = [i for i in [self.router, *self.instances] if i.popen is not None]
        for inst in procs:  # all asked at once: many processes exit in the time of one
            for sig in (signal.SIGCONT, signal.SIGTERM):
                _killpg(inst.popen.pid, sig)
        for inst in procs:
            if inst.popen is not None:
                inst.stop_group(grace_s=15.0)
                log(f"stopped {inst.name}")
        reap_orphans(set())


def lock_run_dir(run_dir: Path, ports: object) -> IO[str] | None:
    """Hold ``run_dir/launcher.lock`` until this process exits (None, logged: another launcher holds it).
    Two launchers on the same fixed ports would take over each other's ports and delete each other's
    pid files."""
    lock = open(run_dir / "launcher.lock", "a+")  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        log(f"error: another launcher (pid {lock.read().strip() or '?'}) already runs in {run_dir}: stop it "
            f"first (its ports are {ports}), or give this one another --run-dir and ports")
        lock.close()
        return None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def become_subreaper() -> None:
    """Orphans of our servers' process trees come to us (reaped by :func:`reap_orphans`), not to init."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log("could not become child subreaper: orphaned server processes are reaped by init instead")


def serve(run_dir: Path, ports: object, ready_file: Path | None, scratch: Path | Sequence[Path],
          bring_up: Callable[[Callable[["Supervisor"], None]], dict]) -> int:
    """A launcher's whole life in the foreground; returns its exit code (0 stopped by a signal, 3 error).

    Lock ``run_dir`` (a second launcher there is refused), remove stale pid files, the ready file and
    ``scratch`` (a directory of the last run's state, or several), become child subreaper; then
    ``bring_up(register)`` builds the Supervisor, passes it to ``register`` before starting it (so a
    signal during start-up stops it) and returns the READY description, printed and written to
    ``ready_file``; supervise until SIGINT or SIGTERM; stop and reap everything, remove the pid files
    and ``scratch`` again."""
    lock = lock_run_dir(run_dir, ports)  # held until this process exits
    if lock is None:
        return 3
    scratches = [scratch] if isinstance(scratch, Path) else list(scratch)
    for folder in scratches:
        shutil.rmtree(folder, ignore_errors=True)
    for stale in [*run_dir.glob("*.pid"), *([ready_file] if ready_file else [])]:
        stale.unlink(missing_ok=True)
    become_subreaper()
    held: list[Supervisor] = []

    def on_signal(signum, _frame):
        if held:
            held[0].stopping = True
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # even when started with SIGINT ignored (a background job)
    try:
        ready = bring_up(held.append)
        log("READY " + json.dumps(ready))
        if ready_file:
            ready_file.write_text(json.dumps(ready) + "\n")
        while True:
            held[0].tick()
            time.sleep(0.5)
    except KeyboardInterrupt:
        log("stopping")
        return 0
    except (LaunchError, subprocess.CalledProcessError) as exc:
        log(f"error: {exc}")
        return 3
    finally:
        if held:
            for sig in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            held[0].stop()
        for folder in scratches:
            shutil.rmtree(folder, ignore_errors=True)
        for pid_file in run_dir.glob("*.pid"):  # stale pids could name unrelated processes later
            pid_file.unlink(missing_ok=True)
