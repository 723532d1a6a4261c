"""Start a real vLLM cluster on this machine, as the harness's proof target (docs/vllm.md).

    python -m clusters.vllm.launch agg     # two aggregated vLLMs behind vllm-router, supervised
    python -m clusters.vllm.launch pd      # one prefill + one decode vLLM (file KV connector), router PD mode
    python -m clusters.vllm.launch pd-nixl # prefill and decode on two emulated hosts, KV over NIXL (root;
                                           # the project's Python: clusters/vllm/nixl_hosts.py)

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
import getpass
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from clusters import supervise
from clusters.supervise import (  # noqa: F401  (PR_SET_CHILD_SUBREAPER, reap_orphans: re-exported for tests)
    PR_SET_CHILD_SUBREAPER, REPO, Instance, LaunchError, Supervisor, check_ports_free, log, reap_orphans, serve)

SERVED_NAME = "tiny-llama"
# Fixed ports (the cluster files name them): router, per-instance API ports, router Prometheus port.
PORTS = {
    "agg": {"router": 8100, "instances": {"vllm-0": 8101, "vllm-1": 8102}, "router_metrics": 8109},
    "pd": {"router": 8200, "instances": {"prefill-0": 8201, "decode-0": 8202}, "router_metrics": 8209},
    # the instances listen on their hosts' control addresses (clusters/vllm/nixl_hosts.py), the router on loopback
    "pd-nixl": {"router": 8400, "instances": {"prefill-0": 8401, "decode-0": 8402}, "router_metrics": 8409},
}
# VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM's "auto" binding pins every instance's engine to the same
# core (core 0 on a 2-core machine, through GOMP_CPU_AFFINITY, which the spawned EngineCore inherits).
# A restarted instance then starts on the core the other instance's busy Worker holds under load and
# got 0.4 % of it: its restart took over 10 minutes (6.1.4 reverts timed out). Unbound, the kernel
# spreads them.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
MAX_MODEL_LEN = 2048
KV_BLOCK_SIZE = 32  # tokens per KV block whenever the launcher sets the block size (pd mode, --kv-cache-tokens)
MAX_NUM_SEQS = 16   # sequences each instance schedules at once (--max-num-seqs); more wait in its queue


def ensure_model(python: Path, model_dir: Path, preset: str) -> None:
    if (model_dir / "made-by.json").exists():
        return
    log(f"making the {preset} model in {model_dir}")
    subprocess.run([str(python), "-m", "clusters.vllm.make_model", str(model_dir), "--preset", preset],
                   cwd=REPO, check=True)


def vllm_argv(python: Path, model_dir: Path, port: int, extra: list[str], host: str = "127.0.0.1",
              max_num_seqs: int = MAX_NUM_SEQS) -> list[str]:
    # --dtype float32: in bfloat16 on a CPU with AMX, vLLM's CPU attention runs AMX tile instructions
    # without asking Linux for the AMX state first (arch_prctl ARCH_REQ_XCOMP_PERM), and the kernel
    # kills its worker with SIGILL ("Fatal Python error: Illegal instruction" in
    # cpu_attention_with_kv_cache, seen on the first request whose KV the decode instance loaded with
    # a 576-token prompt). vLLM takes AMX only for bfloat16; the tiny model's weights are random.
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", host, "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(max_num_seqs), "--enforce-eager",
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


def rpc_dir(run_dir: Path) -> Path:
    """The instances' temp folder (``TMPDIR``, and ``VLLM_RPC_BASE_PATH`` for their ZMQ IPC
    sockets): vLLM's default is the temp folder itself, and an instance killed by 6.1.4 leaves its
    sockets and its ``vllm_dist_*`` rendezvous file there for good (about 800 sockets and 40 files
    were found in /tmp after a day of CI). One folder per run folder, short (a socket path holds at
    most 107 bytes), removed at start and stop with the run's scratch. Torch's compile cache stays
    where it was (``TORCHINDUCTOR_CACHE_DIR``), kept between runs."""
    return Path(tempfile.gettempdir()) / f"harness-vllm-rpc-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:10]}"


def build(mode: str, venv: Path, model_dir: Path, run_dir: Path,
          kv_cache_tokens: int | None = None, hosts: object = None,
          ucx_tls: str | None = None, max_num_seqs: int = MAX_NUM_SEQS) -> tuple[list[Instance], Instance]:
    """The instances and the router of ``mode``; pd-nixl places each instance on one of ``hosts``
    (clusters/vllm/nixl_hosts.py ``Hosts``: prefill-0 on the first, decode-0 on the second)."""
    python, router_bin = venv / "bin" / "python", venv / "bin" / "vllm-router"
    for need in (python, router_bin):
        if not need.exists():
            raise LaunchError(f"{need} is missing: make the vLLM venv first with clusters/vllm/setup.sh {venv}")
    ports = PORTS[mode]
    instances, urls = [], []
    pool = kv_pool_args(kv_cache_tokens)
    for i, (name, port) in enumerate(ports["instances"].items()):
        extra: list[str] = list(pool)
        prefix: list[str] = []
        host, placed = "127.0.0.1", {}
        if mode == "pd":
            kv_dir = run_dir / "kv-store"
            extra = (pool or ["--block-size", str(KV_BLOCK_SIZE)]) + ["--kv-transfer-config", json.dumps({
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}})]
        elif mode == "pd-nixl":
            from clusters.vllm.nixl_hosts import UCX_TLS, kv_transfer_config, ucx_env

            h = hosts.hosts[i]  # type: ignore[attr-defined]
            prefix, host, placed = h.exec_prefix(), h.control_ip, ucx_env(h.fabric_ip, name, ucx_tls or UCX_TLS)
            extra = (pool or ["--block-size", str(KV_BLOCK_SIZE)]) + [
                "--kv-transfer-config", json.dumps(kv_transfer_config(name))]
        rpc_dir(run_dir).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **ENGINE_ENV, "VLLM_PROCESS_NAME_PREFIX": name, "VLLM_RPC_BASE_PATH": str(rpc_dir(run_dir)),
               "TMPDIR": str(rpc_dir(run_dir)), "TORCHINDUCTOR_CACHE_DIR": os.environ.get(
                   "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")),
               **placed}
        argv = [*prefix, *vllm_argv(python, model_dir, port, extra, host, max_num_seqs)]
        instances.append(Instance(name, argv, env,
                                  run_dir / f"{name}.log", f"http://{host}:{port}/health", run_dir))
        urls.append(f"http://{host}:{port}")
    if mode == "agg":
        topology = ["--worker-urls", *urls, "--policy", "round_robin"]
    else:
        topology = ["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
        if mode == "pd-nixl":
            topology += ["--kv-connector", "nixl"]
    router_argv = [str(router_bin), "--host", "127.0.0.1", "--port", str(ports["router"]), *topology,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports["router_metrics"]),
                   "--worker-startup-timeout-secs", "600"]
    router = Instance("router", router_argv, {**os.environ}, run_dir / "router.log",
                      f"http://127.0.0.1:{ports['router']}/health", run_dir)
    return instances, router


def positive_int(text: str) -> int:
    """argparse type of --max-num-seqs: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: pass a positive integer such as "
                                         f"{MAX_NUM_SEQS}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive: vLLM needs at least 1 sequence per step; "
                                         f"pass a positive integer such as {MAX_NUM_SEQS}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusters.vllm.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=sorted(PORTS), help="agg: 2 aggregated + router; pd: 1P1D + router; "
                        "pd-nixl: 1P1D on two emulated hosts, KV over NIXL (root)")
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
    parser.add_argument("--ucx-tls", default=None, metavar="LIST",
                        help="pd-nixl: UCX_TLS of both instances (default tcp,self: the KV on the fabric link; "
                             "it must include tcp; docs/vllm.md says why sm is left out)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=MAX_NUM_SEQS, metavar="N",
                        help=f"vLLM's --max-num-seqs of every instance: sequences scheduled at once, more wait "
                             f"in its queue (default {MAX_NUM_SEQS}; a positive integer)")
    args = parser.parse_args(argv)
    if args.ucx_tls is not None and args.mode != "pd-nixl":
        parser.error(f"--ucx-tls is for pd-nixl only (mode {args.mode} moves no KV over UCX)")
    run_dir = (args.run_dir or Path(f"/tmp/harness-vllm-{args.mode}")).resolve()
    venv = args.venv.absolute()
    model_dir = (args.model_dir or REPO / ".vllm-model" / f"{args.model_preset}-llama").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    supervise.LOG_PREFIX[0] = "vllm-launch"

    def bring_up(register) -> dict:
        ports = PORTS[args.mode]
        hosts = None
        if args.mode == "pd-nixl":   # the instances' ports are on the hosts' own addresses: only the router's here
            from clusters.vllm.nixl_hosts import Hosts, HostedSupervisor

            hosts = Hosts(run_dir)
            check_ports_free({"router": ports["router"], "router metrics": ports["router_metrics"]})
        else:
            check_ports_free({"router": ports["router"], "router metrics": ports["router_metrics"],
                              **ports["instances"]})
        # build() first: it names a missing venv before ensure_model would try to run its Python
        instances, router = build(args.mode, venv, model_dir, run_dir, args.kv_cache_tokens, hosts,
                                  args.ucx_tls, args.max_num_seqs)
        ensure_model(venv / "bin" / "python", model_dir, args.model_preset)
        if hosts is None:
            supervisor = Supervisor(instances, router, args.startup_timeout)
        else:   # the hosts are built (by start) before the instances that run on them
            supervisor = HostedSupervisor(hosts, instances, router, args.startup_timeout)
        register(supervisor)
        supervisor.start()
        warmed = {}
        if hosts is not None:   # NIXL's first handshake done before READY (clusters/vllm/nixl_hosts.py warm_up)
            from clusters.vllm.nixl_hosts import warm_up

            decode = next(i for i in instances if i.name == "decode-0")
            warmed = {"warm_up": warm_up(f"http://127.0.0.1:{ports['router']}", SERVED_NAME,
                                         run_dir / "decode-0.log", decode.health_url.rsplit("/", 1)[0] + "/metrics",
                                         explain=lambda: supervisor.named_failure(decode))}
        return {"mode": args.mode, "model": SERVED_NAME, "api": f"http://127.0.0.1:{ports['router']}",
                "router_metrics": f"http://127.0.0.1:{ports['router_metrics']}/metrics", "run_dir": str(run_dir),
                "instances": {i.name: {"api": i.health_url.rsplit("/", 1)[0], "pid": i.popen.pid,
                                       "engine_pid": i.engine_pid} for i in instances},
                **(hosts.describe() if hosts is not None else {}), **warmed}

    # the file connector's KV (about 1 KB per token) and vLLM's IPC sockets are the run's scratch,
    # removed at start and stop
    return serve(run_dir, PORTS[args.mode], args.ready_file, [run_dir / "kv-store", rpc_dir(run_dir)], bring_up)

if __name__ == "__main__":
    sys.exit(main())
