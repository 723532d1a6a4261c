"""Start a real vLLM cluster on this machine, as the harness's proof target (docs/vllm.md).

    python -m clusters.vllm.launch agg     # two aggregated vLLMs behind vllm-router, supervised
    python -m clusters.vllm.launch pd      # one prefill + one decode vLLM (file KV connector), router PD mode

Standard library only: run it with any Python 3.10+ (the project's or the vLLM venv's). It makes the
model when missing (``clusters.vllm.make_model``), starts every process with ``subprocess.Popen``, waits
until each answers ``/health``, prints the URLs and stays in the foreground as a supervisor: an instance
whose API server exits, for any reason and with any exit code (vLLM's API server exits 0 when its
EngineCore is killed), has what is left of its process group killed and is started again on the same
port. Ctrl-C or SIGTERM stops and reaps everything. The fixed ports match clusters/vllm-agg.yaml and
clusters/vllm-pd.yaml.

Process structure of one vLLM 0.32 CPU instance: API server (``python -m vllm...api_server``) ->
EngineCore (``<name>::EngineCore``, the scheduler loop) -> Worker (``<name>::Worker``, the model).
``VLLM_PROCESS_NAME_PREFIX=<name>`` gives each instance's processes their own titles, so
``pgrep -f '^vllm-0::EngineCore'`` finds exactly one instance's engine; the supervisor also writes
``<run-dir>/<name>.pid`` (API server) and ``<name>.engine.pid`` (EngineCore) after every (re)start.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny-llama"
# Fixed ports (the cluster files name them): router, per-instance API ports, router Prometheus port.
PORTS = {
    "agg": {"router": 8100, "instances": {"vllm-0": 8101, "vllm-1": 8102}, "router_metrics": 8109},
    "pd": {"router": 8200, "instances": {"prefill-0": 8201, "decode-0": 8202}, "router_metrics": 8209},
}
# VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM's "auto" binding pins every instance's engine to the same
# core (core 0 on a 2-core machine, through GOMP_CPU_AFFINITY, which the spawned EngineCore inherits).
# A restarted instance then starts on the core the other instance's busy Worker holds under load and
# got 0.4 % of it: its restart took over 10 minutes (6.1.4 reverts timed out). Unbound, the kernel
# spreads them.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
PR_SET_CHILD_SUBREAPER = 36
MAX_MODEL_LEN = 2048
KV_BLOCK_SIZE = 32  # tokens per KV block whenever the launcher sets the block size (pd mode, --kv-cache-tokens)


def log(msg: str) -> None:
    print(f"[vllm-launch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def ensure_model(python: Path, model_dir: Path, preset: str) -> None:
    if (model_dir / "made-by.json").exists():
        return
    log(f"making the {preset} model in {model_dir}")
    subprocess.run([str(python), "-m", "clusters.vllm.make_model", str(model_dir), "--preset", preset],
                   cwd=REPO, check=True)


def vllm_argv(python: Path, model_dir: Path, port: int, extra: list[str]) -> list[str]:
    # --dtype float32: in bfloat16 on a CPU with AMX, vLLM's CPU attention runs AMX tile instructions
    # without asking Linux for the AMX state first (arch_prctl ARCH_REQ_XCOMP_PERM), and the kernel
    # kills its worker with SIGILL ("Fatal Python error: Illegal instruction" in
    # cpu_attention_with_kv_cache, seen on the first request whose KV the decode instance loaded with
    # a 576-token prompt). vLLM takes AMX only for bfloat16; the tiny model's weights are random.
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--enforce-eager",
            "--dtype", "float32", "--disable-uvicorn-access-log", *extra]


def kv_pool_args(kv_cache_tokens: int | None) -> list[str]:
    """vLLM arguments for a KV pool of ``kv_cache_tokens`` tokens per instance (None: vLLM's own size, from
    VLLM_CPU_KVCACHE_SPACE=1 GiB, about a million tokens of the tiny model, which load never fills).
    A small pool fills in seconds under a few long-prompt streams (the 6.1.3 suite's load drive)."""
    if kv_cache_tokens is None:
        return []
    if kv_cache_tokens < MAX_MODEL_LEN:
        raise LaunchError(f"--kv-cache-tokens {kv_cache_tokens} is below --max-model-len {MAX_MODEL_LEN}: vLLM "
                          f"refuses a pool that cannot hold one whole request; pass at least {MAX_MODEL_LEN}")
    blocks = -(-kv_cache_tokens // KV_BLOCK_SIZE)
    return ["--block-size", str(KV_BLOCK_SIZE), "--num-gpu-blocks-override", str(blocks)]


def build(mode: str, venv: Path, model_dir: Path, run_dir: Path,
          kv_cache_tokens: int | None = None) -> tuple[list[Instance], Instance]:
    python, router_bin = venv / "bin" / "python", venv / "bin" / "vllm-router"
    for need in (python, router_bin):
        if not need.exists():
            raise LaunchError(f"{need} is missing: make the vLLM venv first with clusters/vllm/setup.sh {venv}")
    ports = PORTS[mode]
    instances = []
    pool = kv_pool_args(kv_cache_tokens)
    for name, port in ports["instances"].items():
        extra: list[str] = list(pool)
        if mode == "pd":
            kv_dir = run_dir / "kv-store"
            extra = (pool or ["--block-size", str(KV_BLOCK_SIZE)]) + ["--kv-transfer-config", json.dumps({
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}})]
        env = {**os.environ, **ENGINE_ENV, "VLLM_PROCESS_NAME_PREFIX": name}
        instances.append(Instance(name, vllm_argv(python, model_dir, port, extra), env,
                                  run_dir / f"{name}.log", f"http://127.0.0.1:{port}/health", run_dir))
    urls = [f"http://127.0.0.1:{p}" for p in ports["instances"].values()]
    if mode == "agg":
        topology = ["--worker-urls", *urls, "--policy", "round_robin"]
    else:
        topology = ["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
    router_argv = [str(router_bin), "--host", "127.0.0.1", "--port", str(ports["router"]), *topology,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["router_metrics"]),
                   "--worker-startup-timeout-secs", "600"]
    router = Instance("router", router_argv, {**os.environ}, run_dir / "router.log",
                      f"http://127.0.0.1:{ports['router']}/health", run_dir)
    return instances, router


class Supervisor:
    def __init__(self, instances: list[Instance], router: Instance, startup_timeout_s: float) -> None:
        self.instances, self.router, self.startup_timeout_s = instances, router, startup_timeout_s
        self.stopping = False

    def everyone(self) -> list[Instance]:
        return [*self.instances, self.router]

    def wait_healthy(self, procs: list[Instance]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(procs)
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise LaunchError(f"{p.name} exited with code {p.popen.returncode} while starting: "
                                      f"see {p.log_path}")
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
        for inst in [self.router, *self.instances]:
            if inst.popen is not None:
                inst.stop_group(grace_s=15.0)
                log(f"stopped {inst.name}")
        reap_orphans(set())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusters.vllm.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=sorted(PORTS), help="agg: 2 aggregated + router; pd: 1P1D + router")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="made by clusters/vllm/setup.sh")
    parser.add_argument("--model-preset", choices=("tiny", "slow"), default="tiny",
                        help="tiny: ~2 ms per token; slow: ~30 ms per token, so streams are in flight when "
                             "a worker dies (clusters/vllm/make_model.py); both are served as " + SERVED_NAME)
    parser.add_argument("--model-dir", type=Path, help="default .vllm-model/PRESET-llama (made when missing)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="pid files, logs, KV store (default /tmp/harness-vllm-MODE, as the cluster files say)")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per start (default 600)")
    parser.add_argument("--ready-file", type=Path, help="written (JSON with URLs and pids) once all are healthy")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, metavar="N",
                        help=f"KV pool of each instance in tokens (at least {MAX_MODEL_LEN}; blocks of "
                             f"{KV_BLOCK_SIZE}, --num-gpu-blocks-override), so load fills it in seconds "
                             "(suites/test_item3_degradation.py); default: vLLM's own, about a million tokens")
    args = parser.parse_args(argv)
    run_dir = (args.run_dir or Path(f"/tmp/harness-vllm-{args.mode}")).resolve()
    venv = args.venv.absolute()
    model_dir = (args.model_dir or REPO / ".vllm-model" / f"{args.model_preset}-llama").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    # One launcher per run dir (and so per set of fixed ports): a second one would take over the first's
    # ports as they come up and delete its pid files. Held until this process exits.
    lock = open(run_dir / "launcher.lock", "a+")  # noqa: SIM115
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        log(f"error: another launcher (pid {lock.read().strip() or '?'}) already runs in {run_dir}: stop it "
            f"first (its ports are {PORTS[args.mode]}), or give this one another --run-dir and ports")
        return 3
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    shutil.rmtree(run_dir / "kv-store", ignore_errors=True)
    for stale in [*run_dir.glob("*.pid"), *(args.ready_file and [args.ready_file] or [])]:
        stale.unlink(missing_ok=True)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        log("could not become child subreaper: orphaned vLLM workers are reaped by init instead")

    supervisor: Supervisor | None = None

    def on_signal(signum, _frame):
        if supervisor is not None:
            supervisor.stopping = True
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # even when started with SIGINT ignored (a background job)
    try:
        instances, router = build(args.mode, venv, model_dir, run_dir, args.kv_cache_tokens)
        ports = PORTS[args.mode]
        check_ports_free({"router": ports["router"], "router metrics": ports["router_metrics"],
                          **ports["instances"]})
        ensure_model(venv / "bin" / "python", model_dir, args.model_preset)
        supervisor = Supervisor(instances, router, args.startup_timeout)
        supervisor.start()
        ready = {"mode": args.mode, "model": SERVED_NAME, "api": f"http://127.0.0.1:{PORTS[args.mode]['router']}",
                 "router_metrics": f"http://127.0.0.1:{PORTS[args.mode]['router_metrics']}/metrics",
                 "run_dir": str(run_dir),
                 "instances": {i.name: {"api": i.health_url.rsplit("/", 1)[0], "pid": i.popen.pid,
                                        "engine_pid": i.engine_pid} for i in instances}}
        log("READY " + json.dumps(ready))
        if args.ready_file:
            args.ready_file.write_text(json.dumps(ready) + "\n")
        while True:
            supervisor.tick()
            time.sleep(0.5)
    except KeyboardInterrupt:
        log("stopping")
        return 0
    except (LaunchError, subprocess.CalledProcessError) as exc:
        log(f"error: {exc}")
        return 3
    finally:
        if supervisor is not None:
            for sig in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            supervisor.stop()
        shutil.rmtree(run_dir / "kv-store", ignore_errors=True)  # the file connector's KV: ~1 KB per token
        for pid_file in run_dir.glob("*.pid"):  # stale pids could name unrelated processes later
            pid_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
