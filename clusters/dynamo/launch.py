"""Start a real NVIDIA Dynamo cluster on this machine, as the harness's proof target (docs/dynamo.md).

    python -m clusters.dynamo.launch agg       # frontend + 2 aggregated mocker workers
    python -m clusters.dynamo.launch disagg    # frontend + 1 prefill + 2 decode mocker workers
    python -m clusters.dynamo.launch many      # frontend + 128 workers in 16 processes of 8 (--workers, --per-process)

Dynamo 1.6.1 from the package registry (clusters/dynamo/setup.sh) runs without a GPU, etcd or NATS: file
discovery in a fresh directory, the TCP request plane, ZMQ events, every host 127.0.0.1. Its workers are
Dynamo's own mocker engine (simulated vLLM workers with real scheduling, KV block accounting and timing);
everything else, the frontend's HTTP server, routing, request migration and metrics, is the real thing.

Standard library only (run it with any Python 3.10+). It makes the model directory when missing
(``clusters.dynamo.make_model``), starts each worker process and then the frontend with
``subprocess.Popen``, waits until every worker process answers its system ``/health`` and the frontend
lists every worker as registered, lists the model and serves a real completion, prints ``READY`` with its
endpoints and stays in the foreground as a supervisor: a process that exits is started again on the same
ports and its pid file ``<run-dir>/<name>.pid`` rewritten. Ctrl-C or SIGTERM stops and reaps everything.
The fixed ports match clusters/dynamo-agg.yaml, dynamo-disagg.yaml and dynamo-many.yaml.

``DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS`` is removed from every process's environment: the frontend
answers 400 to a request field it does not support, as a user's Dynamo does, and the harness must send
only what its engine profile allows.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from clusters import supervise
from clusters.supervise import REPO, Instance, LaunchError, Supervisor, check_ports_free, log, serve

SERVED_NAME = "tiny-llama"
MIGRATION_LIMIT = 3
# Fixed ports: the frontend's HTTP port (OpenAI API, /health, /metrics) and each worker process's
# system port (DYN_SYSTEM_PORT: /health, /metrics with its kvstats).
FRONTEND_PORT = {"agg": 8400, "disagg": 8500, "many": 8600}
FRONTEND_HOST = "127.0.0.1"  # --frontend-host: e.g. a bridge's address, for load hosts in network namespaces
ROLES = {"agg": [("dynamo-0", "aggregated"), ("dynamo-1", "aggregated")],
         "disagg": [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]}
# what the frontend's /health lists each role's workers under (component of the `generate` endpoint)
COMPONENT = {"aggregated": "backend", "decode": "backend", "prefill": "prefill"}
MOCKER_ARGS = ["--speedup-ratio", "1.0", "--num-gpu-blocks-override", "16384", "--block-size", "16"]
DYNAMO_ENV = {
    "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    # without it a worker's /health stays 503 "notready" (its endpoints report no health status)
    "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
}


def worker_layout(mode: str, workers: int, per_process: int) -> list[tuple[str, str, int, int]]:
    """(process name, role, system port, workers in it) per worker process."""
    base = FRONTEND_PORT[mode]
    if mode != "many":
        return [(name, role, base + 1 + i, 1) for i, (name, role) in enumerate(ROLES[mode])]
    if workers < 2 or per_process < 1 or workers % per_process:
        raise LaunchError(f"--workers {workers} must be at least 2 and a multiple of --per-process {per_process}")
    if workers // per_process < 2:
        raise LaunchError(f"--workers {workers} in processes of {per_process} is one process: a kill would take "
                          "every worker down; use a smaller --per-process")
    if workers // per_process > 99:
        raise LaunchError(f"{workers // per_process} worker processes exceed the 99 system ports "
                          f"{base + 1}..{base + 99}; use a larger --per-process")
    return [(f"mocker-{i:02d}", "aggregated", base + 1 + i, per_process) for i in range(workers // per_process)]


def build(mode: str, venv: Path, model_dir: Path, run_dir: Path, workers: int = 128,
          per_process: int = 8, frontend_host: str = FRONTEND_HOST) -> tuple[list[Instance], Instance, dict[str, int]]:
    """The worker instances, the frontend and the registered workers expected per component.
    ``frontend_host``: the one address the frontend's HTTP server listens on (its API, /health and
    /metrics); the workers and the planes between them stay on 127.0.0.1."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise LaunchError(f"{python} is missing: make the Dynamo venv first with clusters/dynamo/setup.sh {venv}")
    env = {k: v for k, v in os.environ.items() if k != "DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS"}
    env.update(DYNAMO_ENV, DYN_FILE_KV=str(run_dir / "discovery"))
    instances, expected = [], {}
    for name, role, port, count in worker_layout(mode, workers, per_process):
        argv = [str(python), "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", SERVED_NAME,
                *MOCKER_ARGS, *(["--disaggregation-mode", role] if role in ("prefill", "decode") else []),
                *(["--num-workers", str(count)] if count > 1 else [])]
        instances.append(Instance(name, argv, {**env, "DYN_SYSTEM_PORT": str(port)}, run_dir / f"{name}.log",
                                  f"http://127.0.0.1:{port}/health", run_dir))
        expected[COMPONENT[role]] = expected.get(COMPONENT[role], 0) + count
    port = FRONTEND_PORT[mode]
    frontend = Instance("frontend", [str(python), "-m", "dynamo.frontend", "--http-host", frontend_host,
                                     "--http-port", str(port), "--migration-limit", str(MIGRATION_LIMIT),
                                     "--router-mode", "round-robin"],
                        env, run_dir / "frontend.log", f"http://{frontend_host}:{port}/health", run_dir)
    return instances, frontend, expected


def _get_json(url: str, body: dict | None = None, timeout_s: float = 10.0) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def registered(api: str) -> dict[str, int]:
    """Workers the frontend has discovered, per component (its /health lists each `generate` instance)."""
    counts: dict[str, int] = {}
    for inst in _get_json(f"{api}/health").get("instances", []):
        if inst.get("endpoint") == "generate":
            counts[inst.get("component", "?")] = counts.get(inst.get("component", "?"), 0) + 1
    return counts


def serves(api: str) -> str | None:
    """None when /v1/models lists the model and a completion returns every token asked for; else why not."""
    try:
        models = [m.get("id") for m in _get_json(f"{api}/v1/models").get("data", [])]
        if SERVED_NAME not in models:
            return f"/v1/models lists {models}"
        out = _get_json(f"{api}/v1/completions", {"model": SERVED_NAME, "prompt": "ready?", "max_tokens": 4,
                                                  "ignore_eos": True}, timeout_s=30)
        tokens = (out.get("usage") or {}).get("completion_tokens")
        return None if tokens == 4 else f"a 4-token completion returned {tokens} tokens"
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        return f"{type(exc).__name__}: {exc}"


def wait_registered(supervisor: Supervisor, api: str, expected: dict[str, int], timeout_s: float) -> None:
    deadline, why = time.monotonic() + timeout_s, "not asked yet"
    while time.monotonic() < deadline:
        if supervisor.stopping:
            raise KeyboardInterrupt
        try:
            have = registered(api)
        except (OSError, ValueError) as exc:
            have, why = {}, f"{api}/health: {exc}"
        if have == expected:
            why = serves(api)
            if why is None:
                return
        elif have:
            why = f"the frontend lists {have} workers, {expected} expected"
        time.sleep(0.5)
    raise LaunchError(f"the frontend did not serve every worker within {timeout_s:.0f} s ({why}): see the logs in "
                      f"{supervisor.router.log_path.parent}")


def check_frontend_host(host: str, port: int) -> None:
    """Fail before anything starts when the frontend could not listen on ``host``: not an IP address,
    or no interface of this machine has it (a namespace bridge not up yet), or its port is taken there."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise LaunchError(f"--frontend-host {host!r} is not an IP address: give one of this machine's addresses, "
                          f"e.g. 127.0.0.1 (the default) or a bridge's gateway address") from None
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"the frontend cannot listen on {host}:{port} ({exc.strerror}): is that address on "
                              f"an interface of this machine (ip -brief addr) and the port free (ss -ltnp "
                              f"'sport = :{port}')?") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clusters.dynamo.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=sorted(FRONTEND_PORT),
                        help="agg: 2 aggregated workers; disagg: 1 prefill + 2 decode; many: --workers workers")
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("HARNESS_DYNAMO_VENV", REPO / ".venv-dynamo")),
                        help="made by clusters/dynamo/setup.sh (default $HARNESS_DYNAMO_VENV, else .venv-dynamo)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default .dynamo-model/tiny-llama (made when missing)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="pid files, logs, discovery directory (default /tmp/harness-dynamo-MODE, as the cluster "
                             "files say)")
    parser.add_argument("--workers", type=int, default=128, help="many: workers in all (default 128)")
    parser.add_argument("--per-process", type=int, default=8,
                        help="many: workers per mocker process (--num-workers; default 8): a kill or hang of one "
                             "process hits that many workers at once")
    parser.add_argument("--frontend-host", default=FRONTEND_HOST,
                        help=f"the address the frontend listens on (default {FRONTEND_HOST}); e.g. a bridge's "
                             "gateway address so that load hosts in network namespaces reach it")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds per start (default 300)")
    parser.add_argument("--ready-file", type=Path, help="written (JSON with URLs and pids) once all are ready")
    args = parser.parse_args(argv)
    supervise.LOG_PREFIX[0] = "dynamo-launch"
    run_dir = (args.run_dir or Path(f"/tmp/harness-dynamo-{args.mode}")).resolve()
    venv = args.venv.absolute()
    model_dir = (args.model_dir or REPO / ".dynamo-model" / "tiny-llama").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    def bring_up(register) -> dict:
        instances, frontend, expected = build(args.mode, venv, model_dir, run_dir, args.workers, args.per_process,
                                              args.frontend_host)
        check_ports_free({i.name: int(i.health_url.rsplit(":", 1)[1].split("/")[0]) for i in [*instances, frontend]})
        check_frontend_host(args.frontend_host, FRONTEND_PORT[args.mode])
        if not (model_dir / "made-by.json").exists():
            log(f"making the model directory {model_dir}")
            subprocess.run([str(venv / "bin" / "python"), "-m", "clusters.dynamo.make_model", str(model_dir)],
                           cwd=REPO, check=True)
        t0 = time.monotonic()
        supervisor = Supervisor(instances, frontend, args.startup_timeout)
        register(supervisor)
        supervisor.start()
        api = frontend.health_url.rsplit("/", 1)[0]
        wait_registered(supervisor, api, expected, args.startup_timeout)
        return {"mode": args.mode, "model": SERVED_NAME, "api": api, "metrics": f"{api}/metrics",
                "run_dir": str(run_dir), "startup_s": round(time.monotonic() - t0, 1), "registered": expected,
                "workers": {i.name: {"health": i.health_url, "metrics": i.health_url.replace("/health", "/metrics"),
                                     "pid": i.popen.pid, "pid_file": str(run_dir / f"{i.name}.pid")}
                            for i in instances}}

    # the discovery directory is the run's scratch: a fresh registry, no dead instances from before
    return serve(run_dir, {"frontend": FRONTEND_PORT[args.mode]}, args.ready_file, run_dir / "discovery", bring_up)

if __name__ == "__main__":
    sys.exit(main())
