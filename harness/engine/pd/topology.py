"""A PD topology as real processes: one router plus N prefill and M decode workers.

Python API (the harness's cluster fixture uses it)::

    with Topology(prefill=1, decode=2, preset="tiny") as topo:
        topo.api_url, topo.admin_url, topo.workers(), topo.kill("decode-0"), topo.restart("decode-0")

and the ``up`` subcommand: ``python -m harness up --prefill N --decode M --port P``. Every child is
started with ``subprocess.Popen`` (optionally behind a per-worker command prefix such as
``ip netns exec HOST``) and reaped on every exit path; children also exit by themselves when
this process disappears (``--parent-pid``), so none outlives a SIGKILLed harness.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from harness.engine.pd.router_config import RouterConfig
from harness.engine import DEFAULT_PRESET
from harness.errors import ConfigError, EngineError, ProbeError
from harness.engine.admin.client import AdminClient
from harness.engine.admin.models import AdminWorker, EngineEvent
from harness.waiting import WaitTimeoutError, wait_until
from harness.states import PD_ROLES, WorkerHealth, WorkerRole

log = logging.getLogger(__name__)

ROLES = PD_ROLES


@dataclass
class _Proc:
    id: str
    role: str  # "router" | "prefill" | "decode"
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None
    kv_host: str = "127.0.0.1"
    control_host: str = "127.0.0.1"
    stopped: bool = False  # SIGSTOPped by us

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class WorkerAddress:
    """Where a worker binds: its KV/fabric address (primary KV path) and its control address."""

    kv: str = "127.0.0.1"
    control: str = "127.0.0.1"
    kv_port: int = 0  # 0: any free port; the emulated fabric fixes it to classify KV traffic by port


class Topology:
    def __init__(self, prefill: int = 1, decode: int = 1, preset: str = DEFAULT_PRESET, host: str = "127.0.0.1",
                 port: int = 0, router_config: RouterConfig | dict | None = None,
                 engine_config: dict | None = None,
                 worker_cmd_prefix: Callable[[str], Sequence[str]] | dict[str, Sequence[str]] | None = None,
                 worker_addresses: dict[str, WorkerAddress] | None = None, control_host: str | None = None,
                 startup_timeout_s: float = 180.0, stop_timeout_s: float = 10.0, log_dir: Path | None = None,
                 verbose: bool = False) -> None:
        if prefill < 1 or decode < 1:
            raise ConfigError(f"a topology needs at least one prefill and one decode worker, got {prefill}/{decode}",
                              fix="pass prefill >= 1 and decode >= 1")
        if not 0 <= port <= 65535:
            raise ConfigError(f"port {port} is not a TCP port", fix="use 0 (any free port) to 65535")
        self.preset, self.host, self.port = preset, host, port
        self.router_config = (router_config if isinstance(router_config, RouterConfig)
                              else RouterConfig.from_dict(router_config))
        self.engine_config = dict(engine_config or {})
        self._prefix = worker_cmd_prefix
        self._addresses = dict(worker_addresses or {})
        self.control_host = control_host or host
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="harness-pd-")
        self.log_dir = Path(log_dir or self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.verbose = verbose
        self._initial = {WorkerRole.PREFILL: prefill, WorkerRole.DECODE: decode}
        self._procs: dict[str, _Proc] = {}
        self._next = {WorkerRole.PREFILL: 0, WorkerRole.DECODE: 0}
        self._router: _Proc | None = None
        self._api: tuple[str, int] | None = None
        self._control: tuple[str, int] | None = None

    # -- lifecycle
    def __enter__(self) -> "Topology":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        try:
            self._start_router()
            ids = [self._spawn_worker(role) for role in ROLES for _ in range(self._initial[role])]
            self.wait_healthy(ids)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM everything (SIGCONT the stopped), wait, SIGKILL leftovers; always reaps. Idempotent."""
        procs = [p for p in self._procs.values() if p.popen] + ([self._router] if self._router and
                                                                 self._router.popen else [])
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
                p.popen.send_signal(signal.SIGCONT)  # a SIGSTOPped child only handles SIGTERM once resumed
        wait_until(lambda: all(p.popen.poll() is not None for p in procs), self.stop_timeout_s, 0.05,
                   what="the topology's processes to exit", on_timeout="return")  # leftovers are killed below
        for p in procs:
            if p.popen.poll() is None:
                log.warning("%s pid %d ignored SIGTERM for %.0f s; killing it", p.id, p.pid, self.stop_timeout_s)
                p.popen.kill()
            p.popen.wait()

    # -- addresses
    @property
    def api_url(self) -> str:
        if self._api is None:
            raise EngineError("the topology is not running", fix="call start() or use it as a context manager")
        return "http://%s:%d" % self._api

    @property
    def base_url(self) -> str:
        return f"{self.api_url}/v1"

    @property
    def admin_url(self) -> str:
        return f"{self.api_url}/admin"

    @property
    def router_pid(self) -> int | None:
        return self._router.pid if self._router else None

    # -- queries
    def workers(self) -> list[AdminWorker]:
        """``GET /admin/workers``: id, role, pid, health, addresses, queue depth, KV blocks."""
        with AdminClient(self.admin_url, timeout_s=10) as admin:
            return admin.workers()

    def events(self, since: int = 0) -> list[EngineEvent]:
        with AdminClient(self.admin_url, timeout_s=10) as admin:
            return admin.events(since=since)

    def pid(self, worker_id: str) -> int:
        return self._proc(worker_id).pid

    def worker_ids(self, role: str | None = None) -> list[str]:
        return [p.id for p in self._procs.values() if role in (None, p.role)]

    def exited_workers(self) -> dict[str, int]:
        """Workers whose process has exited (and is now reaped): id -> exit code."""
        return {p.id: p.popen.returncode for p in self._procs.values()
                if p.popen is not None and p.popen.poll() is not None}

    def child_pids(self) -> set[int]:
        """The pids of the processes this topology started (router and workers), running or not."""
        procs = list(self._procs.values()) + ([self._router] if self._router is not None else [])
        return {p.popen.pid for p in procs if p.popen is not None}

    def log_tail(self, proc_id: str, lines: int = 30) -> str:
        p = self._router if proc_id == "router" else self._proc(proc_id)
        return "\n".join(p.log_path.read_text(errors="replace").splitlines()[-lines:])

    # -- faults and membership
    def kill(self, worker_id: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to a worker; a fatal signal is followed by reaping. Returns the pid."""
        p = self._proc(worker_id)
        if not p.alive():
            raise EngineError(f"worker {worker_id} is not running", fix="restart() it first")
        p.popen.send_signal(sig)
        p.stopped = sig == signal.SIGSTOP or (p.stopped and sig != signal.SIGCONT)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            if p.stopped:
                p.popen.send_signal(signal.SIGCONT)
            p.popen.wait(self.stop_timeout_s)
        return p.pid

    def restart(self, worker_id: str, wait: bool = True) -> int:
        """(Re)start a worker under the same id; the router keeps running. Returns the new pid."""
        p = self._proc(worker_id)
        if p.alive():
            self.kill(worker_id, signal.SIGKILL)
        self._launch(p)
        if wait:
            self.wait_healthy([worker_id], new_pid=p.pid)
        return p.pid

    def add_worker(self, role: str, wait: bool = True) -> str:
        if role not in ROLES:
            raise ConfigError(f"worker role {role!r} is unknown", fix=f"use one of {[str(r) for r in ROLES]}")
        wid = self._spawn_worker(role)
        if wait:
            self.wait_healthy([wid])
        return wid

    def wait_healthy(self, ids: Sequence[str], new_pid: int | None = None, timeout_s: float | None = None) -> None:
        pending = set(ids)

        def registered() -> bool:
            for wid in pending:
                if not self._proc(wid).alive():
                    raise EngineError(f"worker {wid} exited with code {self._proc(wid).popen.returncode} while "
                                      f"starting:\n{self.log_tail(wid)}", fix="read the worker log above")
            try:
                table = {w.id: w for w in self.workers()}
            except ProbeError:  # the router is busy or restarting: ask again
                table = {}
            pending.difference_update([wid for wid in pending if wid in table and table[wid].healthy
                                       and table[wid].pid == self.pid(wid)])
            return not pending

        try:  # polling interval 0.1 s while workers import torch and build their model
            wait_until(registered, timeout_s or self.startup_timeout_s, 0.1, what="the workers to register")
        except WaitTimeoutError as exc:
            raise EngineError(f"workers {sorted(pending)} did not register within the startup timeout",
                              fix="raise startup_timeout_s on a loaded machine; see log_tail(worker_id)") from exc

    def wait_health(self, worker_id: str, health: WorkerHealth, timeout_s: float = 10.0) -> AdminWorker:
        """Wait until the router reports ``worker_id`` with ``health``."""
        try:
            return wait_until(lambda: next((w for w in self.workers() if w.id == worker_id), None), timeout_s, 0.05,
                              what=f"worker {worker_id} to be {health}",
                              accept=lambda row: row is not None and row.health == health)
        except WaitTimeoutError as exc:
            raise EngineError(f"worker {worker_id} is not {health} after {timeout_s:.0f} s: {exc.last_value}",
                              fix="check the router log (log_tail('router'))") from exc

    # -- internals
    def _proc(self, worker_id: str) -> _Proc:
        if worker_id not in self._procs:
            raise ConfigError(f"no worker {worker_id!r} in this topology", fix=f"use one of {sorted(self._procs)}")
        return self._procs[worker_id]

    def _start_router(self) -> None:
        ready = self.log_dir / "router.ready"
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "harness.engine.pd.router_server", "--preset", self.preset, "--host", self.host,
                "--port", str(self.port), "--control-host", self.control_host, "--control-port", "0",
                "--config-json", json.dumps(self.router_config.__dict__), "--ready-file", str(ready),
                "--parent-pid", str(os.getpid())] + (["-v"] if self.verbose else [])
        if self.engine_config.get("max_model_len"):
            argv += ["--max-model-len", str(self.engine_config["max_model_len"])]
        self._router = _Proc("router", "router", argv, self.log_dir / "router.log")
        self._launch(self._router)
        router = self._router

        def listening() -> bool:
            if ready.exists():
                return True
            if not router.alive():
                raise EngineError(f"router exited with code {router.popen.returncode}:\n"
                                  f"{self.log_tail('router')}", fix="read the router log above")
            return False

        try:  # polling interval 50 ms while the router imports its modules
            wait_until(listening, self.startup_timeout_s, 0.05, what="the router to listen")
        except WaitTimeoutError as exc:
            raise EngineError("router did not start listening in time", fix="raise startup_timeout_s") from exc
        info = json.loads(ready.read_text())
        self._api, self._control = tuple(info["api"]), tuple(info["control"])

    def _spawn_worker(self, role: str) -> str:
        wid = f"{role}-{self._next[role]}"
        self._next[role] += 1
        addr = self._addresses.get(wid, WorkerAddress())
        prefix = self._prefix(wid) if callable(self._prefix) else (self._prefix or {}).get(wid, ())
        argv = [*prefix, sys.executable, "-m", "harness.engine.pd.worker", "--role", role, "--id", wid,
                "--router", "%s:%d" % self._control, "--preset", self.preset,
                "--engine-json", json.dumps(self.engine_config), "--kv-host", addr.kv, "--kv-port", str(addr.kv_port),
                "--control-host", addr.control, "--parent-pid", str(os.getpid())] + (["-v"] if self.verbose else [])
        proc = _Proc(wid, role, argv, self.log_dir / f"{wid}.log", kv_host=addr.kv, control_host=addr.control)
        self._procs[wid] = proc
        self._launch(proc)
        return wid

    def _launch(self, p: _Proc) -> None:
        with open(p.log_path, "ab") as out:
            p.popen = subprocess.Popen(p.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        p.stopped = False
        log.info("started %s pid %d", p.id, p.pid)


# ---------------------------------------------------------------- `python -m harness up`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help=f"model preset (python -m harness presets); default {DEFAULT_PRESET}")
    parser.add_argument("--host", default="127.0.0.1", help="API address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="API port; 0 = any free port (default 8000)")
    parser.add_argument("--kv-budget-mb", type=int, default=None, help="KV pool per worker in MiB")
    parser.add_argument("--router-config", default=None,
                        help="RouterConfig as JSON or a path to a JSON/YAML file (see docs/pd.md)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where process logs go (default: a temp dir)")
    parser.add_argument("--pid-dir", type=Path, default=None,
                        help="write each worker's pid to DIR/<id>.pid (rewritten at every restart), for a cluster "
                             "file's `process: {pid_file: ...}`")
    parser.add_argument("--supervise", action="store_true",
                        help="restart a worker whose process exits (as a service manager would): the cluster "
                             "can then be attached as a foreign cluster with `supervised: true` workers "
                             "(clusters/up-foreign.yaml)")


def _router_config(text: str | None) -> RouterConfig:
    if not text:
        return RouterConfig()
    if Path(text).is_file():
        import yaml
        data = yaml.safe_load(Path(text).read_text())
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--router-config is neither a file nor JSON: {exc}",
                              fix='pass e.g. \'{"heartbeat_timeout_s": 2}\' or a YAML file path') from None
    if not isinstance(data, dict):
        raise ConfigError("--router-config must be a mapping", fix="pass a JSON object or a YAML mapping")
    return RouterConfig.from_dict(data)


def _supervise(topo: Topology, pid_dir: Path | None) -> None:
    """Restart every worker whose process exited; the restarted worker re-registers by itself."""
    for wid, code in topo.exited_workers().items():
        pid = topo.restart(wid, wait=False)
        _write_pid(pid_dir, wid, pid)
        print(f"supervisor: {wid} exited with code {code}; restarted as pid {pid}", flush=True)


def _write_pid(pid_dir: Path | None, wid: str, pid: int) -> None:
    if pid_dir is not None:
        tmp = pid_dir / f".{wid}.pid.tmp"
        tmp.write_text(f"{pid}\n")
        tmp.replace(pid_dir / f"{wid}.pid")  # atomic: a reader never sees a half-written pid


def run(args: argparse.Namespace) -> int:
    engine = {"kv_budget_bytes": args.kv_budget_mb << 20} if args.kv_budget_mb else {}
    topo = Topology(prefill=args.prefill, decode=args.decode, preset=args.preset, host=args.host, port=args.port,
                    router_config=_router_config(args.router_config), engine_config=engine, log_dir=args.log_dir)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C stops everything even where SIGINT arrived ignored (a shell starts background jobs
    # with SIGINT ignored, and Python then installs no KeyboardInterrupt handler).
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        topo.start()
        print(f"router   pid {topo.router_pid:<7} api {topo.base_url}  admin {topo.admin_url}", flush=True)
        for w in topo.workers():
            where = (f"kv {w['addresses']['kv']}  control {w['addresses']['control']}" if w["role"] == WorkerRole.DECODE
                     else "sends KV, listens on nothing")
            print(f"{w['id']:<8} pid {w['pid']:<7} {where}", flush=True)
        if args.pid_dir is not None:
            args.pid_dir.mkdir(parents=True, exist_ok=True)
            for wid in topo.worker_ids():
                _write_pid(args.pid_dir, wid, topo.pid(wid))
        print(f"logs in {topo.log_dir}; Ctrl-C stops everything"
              + ("; exited workers are restarted" if args.supervise else ""), flush=True)
        while topo._router.alive():
            time.sleep(0.2 if args.supervise else 0.5)
            if args.supervise:
                _supervise(topo, args.pid_dir)
        print(f"router exited with code {topo._router.popen.returncode}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 0
    finally:
        topo.stop()
        if args.pid_dir is not None:
            for wid in topo.worker_ids():
                (args.pid_dir / f"{wid}.pid").unlink(missing_ok=True)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
