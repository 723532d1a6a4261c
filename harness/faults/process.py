"""Process faults: kill a worker (SIGKILL/SIGTERM) or hang it (SIGSTOP, reverted by SIGCONT).

Targets come from the worker list the engine's admin API returns (``{"id", "role", "pid", "host"}``)
through :func:`select_targets`. Signals and /proc reads go through the executor of the worker's
host (``kill -s STOP PID``, ``cat /proc/PID/stat``), so the same fault works locally and over SSH.
A target is pid AND start time: nothing is ever signalled once its pid has been reused.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

from harness.errors import ConfigError, ExecutorError, FaultError
from harness.faults.base import Fault, no_ledger
from harness.ids import new_fault_id
from harness.hosts import Executor, describe_command
from harness.faults.procstat import ProcStat, parse_proc_stat

log = logging.getLogger(__name__)

ROLE_ANY = "any"
SELECTION_MODES = ("one", "n", "percent")
COMMAND_TIMEOUT_S = 15.0


def select_targets(workers: Sequence[Mapping[str, Any]], role: str, mode: str = "one",
                   value: float | None = None, seed: int | None = None) -> list[dict[str, Any]]:
    """Pick workers of ``role`` (or ``"any"``): ``one``; ``n`` (value workers); ``percent`` (value % of
    them, at least one). Deterministic for a given seed; only workers with a pid are candidates."""
    if mode not in SELECTION_MODES:
        raise ConfigError(f"unknown target selection mode {mode!r}", fix=f"use one of {', '.join(SELECTION_MODES)}")
    candidates = sorted((dict(w) for w in workers if w.get("pid") and role in (ROLE_ANY, w.get("role"))),
                        key=lambda w: str(w.get("id")))
    if not candidates:
        roles = sorted({str(w.get("role")) for w in workers})
        raise FaultError(f"no running worker has role {role!r} (roles present: {roles or 'none'})",
                         fix="choose a role the cluster has, or 'any'")
    if mode == "one":
        if value not in (None, 1):
            raise ConfigError(f"mode 'one' takes no value (got {value!r})", fix="use mode 'n' to pick several")
        count = 1
    elif mode == "n":
        if value is None or int(value) != value or not 1 <= value <= len(candidates):
            raise ConfigError(f"mode 'n' needs a whole number of workers in 1..{len(candidates)} "
                              f"({len(candidates)} {role} workers), got {value!r}", fix="pass a valid count")
        count = int(value)
    else:
        if value is None or not 0 < value <= 100:
            raise ConfigError(f"mode 'percent' needs a value in (0, 100], got {value!r}", fix="pass e.g. 50")
        count = max(1, math.ceil(len(candidates) * value / 100))
    return random.Random(seed).sample(candidates, count)


@dataclass
class ProcessFault(Fault):
    """Shared identity and /proc polling of the two process faults (not a fault kind itself)."""

    pid: int
    host: str = "localhost"
    worker_id: str | None = None
    role: str | None = None
    start_time: int | None = None   # clock ticks since boot; filled by prepare() before the ledger entry
    timeout_s: float = 10.0         # how long verify and verify_reverted wait for the effect
    fault_id: str = field(default_factory=new_fault_id)

    def __post_init__(self) -> None:
        if not isinstance(self.pid, int) or self.pid <= 1:
            raise ConfigError(f"{self.kind}: pid must be an integer > 1, got {self.pid!r}",
                              fix="target a worker process, never init")
        if self.timeout_s <= 0:
            raise ConfigError(f"{self.kind}: timeout_s must be > 0, got {self.timeout_s}", fix="pass a positive timeout")
        self.host = self.host or "localhost"

    @classmethod
    def _worker_fields(cls, worker: Mapping[str, Any]) -> dict[str, Any]:
        if not worker.get("pid"):
            raise FaultError(f"worker {worker.get('id')!r} has no pid", fix="target a running worker")
        return {"pid": int(worker["pid"]), "host": worker.get("host") or "localhost",
                "worker_id": None if worker.get("id") is None else str(worker["id"]),
                "role": worker.get("role"), "start_time": worker.get("start_time")}

    @property
    def target(self) -> str:
        name = f"{self.worker_id} " if self.worker_id else ""
        return f"{name}pid {self.pid} @ {self.host}"

    def _stat_argv(self) -> list[str]:
        return ["cat", f"/proc/{self.pid}/stat"]

    def _signal_argv(self, sig: str) -> list[str]:
        return ["kill", "-s", sig, str(self.pid)]

    def _read(self, ex: Executor) -> ProcStat | None:
        res = ex.run(self._stat_argv(), timeout=COMMAND_TIMEOUT_S, check=False)
        if res.rc != 0:
            if "No such file" in res.stderr:
                return None
            raise ExecutorError(f"cannot read /proc/{self.pid}/stat on {self.host}: {res.stderr.strip()}",
                                fix="check that the host is Linux and the user may read /proc")
        return parse_proc_stat(res.stdout)

    def _ours(self, ex: Executor) -> ProcStat | None:
        """The target's stat while it is alive and still the same process, else None."""
        stat = self._read(ex)
        if stat is None or not stat.alive or stat.start_time != self.start_time:
            return None
        return stat

    def _wait_for(self, ex: Executor, done: Callable[[ProcStat | None], bool]) -> ProcStat | None:
        deadline, pause = time.monotonic() + self.timeout_s, 0.02
        while True:
            stat = self._ours(ex)
            if done(stat) or time.monotonic() >= deadline:
                return stat
            time.sleep(pause)  # waiting for the kernel to deliver the signal, not standing in for work
            pause = min(pause * 2, 0.25)

    def prepare(self, ex: Executor) -> str:
        stat = self._read(ex)
        if stat is None or not stat.alive:
            raise FaultError(f"{self.kind}: {self.target} is not running", fix="refresh the worker list and retarget")
        if self.start_time is not None and stat.start_time != self.start_time:
            raise FaultError(f"{self.kind}: pid {self.pid} on {self.host} is a different process now "
                             f"(start time {stat.start_time}, expected {self.start_time})",
                             fix="refresh the worker list and retarget")
        self.start_time = stat.start_time
        return f"pid {self.pid} start time {stat.start_time} (state {stat.state})"

    def _plan_line(self, phase: str, argv: list[str], note: str = "") -> str:
        return f"{phase}: {describe_command(self.host, argv)}" + (f"  # {note}" if note else "")


@dataclass
class ProcessHang(ProcessFault):
    """SIGSTOP the target; verified by /proc state 'T'; reverted by SIGCONT."""

    kind: ClassVar[str] = "process_hang"

    @classmethod
    def from_worker(cls, worker: Mapping[str, Any], **kwargs: Any) -> ProcessHang:
        return cls(**cls._worker_fields(worker), **kwargs)

    def inject(self, ex: Executor) -> str:
        if self._ours(ex) is None:
            raise FaultError(f"{self.kind}: {self.target} exited before it could be stopped",
                             fix="refresh the worker list and retarget")
        ex.run(self._signal_argv("STOP"), timeout=COMMAND_TIMEOUT_S)
        return f"sent SIGSTOP to {self.target}"

    def verify(self, ex: Executor) -> str:
        stat = self._wait_for(ex, lambda s: s is None or s.state == "T")
        if stat is None:
            raise FaultError(f"{self.kind}: {self.target} exited instead of stopping")
        if stat.state != "T":
            raise FaultError(f"{self.kind}: {self.target} is in state {stat.state!r}, not stopped ('T'), "
                             f"{self.timeout_s}s after SIGSTOP", fix="check that nothing resumes or traces it")
        return f"{self.target} is stopped (state T)"

    def revert(self, ex: Executor) -> str:
        if self._ours(ex) is None:
            return f"{self.target} is gone; nothing to resume"
        ex.run(self._signal_argv("CONT"), timeout=COMMAND_TIMEOUT_S)
        return f"sent SIGCONT to {self.target}"

    def verify_reverted(self, ex: Executor) -> str:
        stat = self._wait_for(ex, lambda s: s is None or s.state != "T")
        if stat is None:
            return f"{self.target} is gone; not stopped"
        if stat.state == "T":
            raise FaultError(f"{self.kind}: {self.target} is still stopped {self.timeout_s}s after SIGCONT",
                             fix=f"resume it by hand: kill -s CONT {self.pid} on {self.host}")
        return f"{self.target} is running again (state {stat.state})"

    def plan(self) -> list[str]:
        return [
            self._plan_line("prepare", self._stat_argv(), "record the start time; refuse if not running"),
            self._plan_line("inject", self._signal_argv("STOP")),
            self._plan_line("verify", self._stat_argv(), f"poll until state is T, up to {self.timeout_s}s"),
            self._plan_line("revert", self._signal_argv("CONT"), "only if the pid still has its start time"),
            self._plan_line("verify_reverted", self._stat_argv(), f"poll until state is not T, up to {self.timeout_s}s"),
        ]


KILL_SIGNALS = ("KILL", "TERM")
HookCallable = Callable[[str], Any]


@dataclass
class ProcessKill(ProcessFault):
    """SIGKILL or SIGTERM the target; verified by the pid being gone. Revert restarts the worker
    through the cluster's restart hook (a callable taking the worker id, or a command run on the
    worker's host) and waits for the healthy hook; without hooks the revert is a recorded no-op.
    Restart hooks should be idempotent: after a crash mid-revert the next recovery runs it again.

    ``rejoined`` (optional, a callable taking the worker id and returning one line): called once the
    worker is healthy, it waits, within its own limit, until the cluster serves through the worker
    again (harness/probes/workers/rejoin.py) and says whether and when it did. A cluster that keeps a healthy
    worker out is the cluster's doing, judged as a finding: the hook reports it and never raises, so
    it never reads as a failed revert."""

    kind: ClassVar[str] = "process_kill"

    signal: str = "KILL"
    restart_cmd: list[str] | None = None    # run on self.host; stored in the ledger
    healthy_cmd: list[str] | None = None    # rc 0 means healthy; polled
    healthy_url: str | None = None          # GET from this machine answers 200 when healthy; polled
    supervised: bool = False                # a service manager restarts the process by itself
    healthy_timeout_s: float = 60.0
    restart_hook_name: str | None = None    # a callable's name, so a recovery can say what it cannot call
    restart: HookCallable | None = no_ledger(default=None)
    healthy: Callable[[str], bool] | None = no_ledger(default=None)
    rejoined: HookCallable | None = no_ledger(default=None)
    _restarted: bool = no_ledger(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.signal = self.signal.upper().removeprefix("SIG")
        if self.signal not in KILL_SIGNALS:
            raise ConfigError(f"process_kill signal must be one of {KILL_SIGNALS}, got {self.signal!r}",
                              fix="use KILL (crash) or TERM (graceful stop); use process_hang for STOP")
        if self.restart is not None:
            self.restart_hook_name = _hook_name(self.restart)
        if (self.restart or self.restart_cmd or self.supervised) and \
                (self.healthy or self.healthy_cmd or self.healthy_url) is None:
            log.warning("%s: restart hook without healthy hook; verify_reverted cannot prove recovery", self.target)

    @classmethod
    def from_worker(cls, worker: Mapping[str, Any], *, restart_cmd: Sequence[str] | None = None,
                    healthy_cmd: Sequence[str] | None = None, **kwargs: Any) -> ProcessKill:
        """Commands may use {id}, {role}, {pid}, {host}; they are filled in now so the ledger holds them."""
        fields = cls._worker_fields(worker)
        values = {"id": fields["worker_id"], "role": fields["role"], "pid": fields["pid"], "host": fields["host"]}

        def fill(cmd: Sequence[str] | None) -> list[str] | None:
            try:
                return None if cmd is None else [str(a).format(**values) for a in cmd]
            except (KeyError, IndexError) as exc:
                raise ConfigError(f"hook command {list(cmd)!r} uses an unknown placeholder {exc}",
                                  fix="use only {id}, {role}, {pid}, {host}") from exc

        return cls(**fields, restart_cmd=fill(restart_cmd), healthy_cmd=fill(healthy_cmd), **kwargs)

    def inject(self, ex: Executor) -> str:
        if self._ours(ex) is None:
            raise FaultError(f"{self.kind}: {self.target} is not running", fix="refresh the worker list and retarget")
        ex.run(self._signal_argv(self.signal), timeout=COMMAND_TIMEOUT_S)
        return f"sent SIG{self.signal} to {self.target}"

    def verify(self, ex: Executor) -> str:
        stat = self._wait_for(ex, lambda s: s is None)
        if stat is not None:
            raise FaultError(f"{self.kind}: {self.target} still runs (state {stat.state}) {self.timeout_s}s "
                             f"after SIG{self.signal}", fix="it may ignore SIGTERM; use signal KILL")
        return f"{self.target} is gone"

    def revert(self, ex: Executor) -> str:
        if self._restarted:
            return f"{self.target} was already restarted"
        if self._ours(ex) is not None:
            return f"{self.target} still runs; nothing to restore"
        if self.restart is not None:
            self.restart(self.worker_id or str(self.pid))
        elif self.restart_cmd:
            ex.run(self.restart_cmd, timeout=self.healthy_timeout_s)
        elif self.supervised:
            self._restarted = True  # nothing to run: verify_reverted waits for the service manager's restart
            return f"{self.worker_id or self.target} is supervised: its service manager restarts it"
        elif self.restart_hook_name:
            return (f"cannot restart {self.target}: its restart hook {self.restart_hook_name} lived in the harness "
                    "process that died; restart the worker through the cluster")
        else:
            return f"nothing to restore: no restart hook for {self.target}; the worker stays down"
        self._restarted = True
        return f"restarted {self.worker_id or self.target}"

    def verify_reverted(self, ex: Executor) -> str:
        if not self._restarted:
            return "nothing was restarted; nothing to check"
        if self.healthy is None and not self.healthy_cmd and not self.healthy_url:
            return "restarted; no healthy hook to confirm it"
        deadline, pause = time.monotonic() + self.healthy_timeout_s, 0.05
        while True:
            if self.healthy is not None:
                ok = bool(self.healthy(self.worker_id or str(self.pid)))
            elif self.healthy_url:
                ok = _http_ok(self.healthy_url)
            else:
                ok = ex.run(self.healthy_cmd, timeout=COMMAND_TIMEOUT_S, check=False).rc == 0  # type: ignore[arg-type]
            if ok:
                healthy = f"{self.worker_id or self.target} is healthy again"
                if self.rejoined is None:
                    return healthy
                return f"{healthy}; {self.rejoined(self.worker_id or str(self.pid))}"
            if time.monotonic() >= deadline:
                raise FaultError(f"{self.kind}: {self.worker_id or self.target} not healthy "
                                 f"{self.healthy_timeout_s}s after restart", fix="check the worker's logs")
            time.sleep(pause)  # waiting for the worker to come up
            pause = min(pause * 2, 1.0)

    def plan(self) -> list[str]:
        lines = [
            self._plan_line("prepare", self._stat_argv(), "record the start time; refuse if not running"),
            self._plan_line("inject", self._signal_argv(self.signal)),
            self._plan_line("verify", self._stat_argv(), f"poll until the pid is gone, up to {self.timeout_s}s"),
        ]
        if self.restart is not None:
            lines.append(f"revert: call restart hook {_hook_name(self.restart)}"
                         f"({self.worker_id or self.pid!r})")
        elif self.restart_cmd:
            lines.append(self._plan_line("revert", self.restart_cmd, "only if the pid is gone"))
        elif self.supervised:
            lines.append("revert: nothing to run (supervised: the service manager restarts it)")
        elif self.restart_hook_name:
            lines.append(f"revert: nothing (restart hook {self.restart_hook_name} was in the harness that died)")
        else:
            lines.append("revert: nothing (no restart hook; the worker stays down)")
        if self.healthy is not None:
            lines.append(f"verify_reverted: poll healthy hook {_hook_name(self.healthy)}"
                         f"({self.worker_id or self.pid!r}) up to {self.healthy_timeout_s}s")
        elif self.healthy_url:
            lines.append(f"verify_reverted: poll GET {self.healthy_url} from this machine until 200, up to "
                         f"{self.healthy_timeout_s}s")
        elif self.healthy_cmd:
            lines.append(self._plan_line("verify_reverted", self.healthy_cmd,
                                         f"poll until rc 0, up to {self.healthy_timeout_s}s"))
        else:
            lines.append("verify_reverted: nothing to check")
        if self.rejoined is not None:
            lines.append(f"verify_reverted: then call rejoin hook {_hook_name(self.rejoined)}"
                         f"({self.worker_id or self.pid!r}): wait until the cluster serves through it (reported, "
                         "never a failed revert)")
        return lines


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _hook_name(hook: Callable[..., Any]) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)
