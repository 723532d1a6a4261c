"""``python -m harness serve``: the single-engine reference server, and ``ServerProcess``,
which runs it (or another serving subcommand) as a child process for tests and suites.

The server binds its socket itself before uvicorn starts, so ``--port 0`` works and the real
port is known at once (``--port-file`` hands it to a parent). SIGINT and SIGTERM stop
uvicorn gracefully (open streams get a few seconds), then the engine is closed, which stops
and reaps its worker process in ``--engine process`` mode.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import httpx

from harness.engine import DEFAULT_PRESET
from harness.errors import ConfigError, EngineError
from harness.waiting import WaitTimeoutError, wait_until

logger = logging.getLogger(__name__)

ENGINE_MODES = ("inproc", "process")
GRACEFUL_SHUTDOWN_S = 5


# ---- the `serve` subcommand ----------------------------------------------------------------

def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = any free port), got {port}")
    return port


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=DEFAULT_PRESET,
                        help=f"model preset (python -m harness presets); default {DEFAULT_PRESET}")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 = any free port")
    parser.add_argument("--engine", choices=ENGINE_MODES, default="inproc",
                        help="inproc: engine in the server's process; process: engine in a child process")
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                        help="speculative decoding with the draft model (default: the engine's default)")
    parser.add_argument("--kv-budget-mb", type=_positive_int, default=None,
                        help="size of the KV block pool (the HBM tier) in MiB")
    parser.add_argument("--port-file", type=Path, default=None,
                        help="write the port actually bound to this file (for --port 0)")


def _engine_config(args: argparse.Namespace):
    from harness.engine.core.config import EngineConfig

    overrides = {}
    if args.speculative is not None:
        overrides["speculative"] = args.speculative
    if args.kv_budget_mb is not None:
        overrides["kv_budget_bytes"] = args.kv_budget_mb * 1024 * 1024
    return EngineConfig(preset=args.preset, **overrides)


def bind_socket(host: str, port: int) -> socket.socket:
    """The API's listening socket. Created with IPPROTO_TCP named: asyncio sets TCP_NODELAY only on
    sockets whose ``proto`` says TCP, and an accepted socket inherits the listener's; with proto 0,
    Nagle held every keep-alive client's first SSE chunk until its delayed ACK (about 40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}",
                          fix="pick another --port (0 = any free port) or stop what holds it") from None
    sock.listen(1024)
    return sock


def run(args: argparse.Namespace) -> int:
    config = _engine_config(args)  # bad options fail before anything binds or loads
    sock = bind_socket(args.host, args.port)
    try:
        return asyncio.run(_serve(config, args.engine, sock, args.port_file))
    finally:
        sock.close()
        stop_resource_tracker()


def stop_resource_tracker() -> None:
    """Stop and reap multiprocessing's resource-tracker child, if this process started one.

    The spawn context (``--engine process``) starts it, and it exits only after this process
    does; on a machine whose PID 1 reaps no orphans it would stay a zombie. Call this last,
    when no multiprocessing object is used any more (it restarts on demand if one is).
    """
    from multiprocessing import resource_tracker, util

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)  # CPython's own shutdown hook
    if stop is None:
        return
    # multiprocessing's exit hook first: it unlinks the queues' semaphores, which must happen
    # while the tracker still runs; it would otherwise run after this, at interpreter exit.
    util._exit_function()
    stop()


async def _serve(config, mode: str, sock: socket.socket, port_file: Path | None) -> int:
    import uvicorn

    from harness.engine.serving.api import build_app
    from harness.engine.core.client import make_client

    # Until uvicorn takes over the signals, a SIGINT/SIGTERM marks the server to stop as soon
    # as it can. uvicorn then restores these handlers and re-raises the signal that stopped
    # it: recording it here makes that harmless, so the engine is closed below, not killed.
    received: list[int] = []
    server: uvicorn.Server | None = None

    def on_signal(signum: int, _frame) -> None:
        received.append(signum)
        if server is not None:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    client = make_client(config, mode)
    try:
        app = build_app(client)
        server = uvicorn.Server(uvicorn.Config(app, log_level=logging.getLogger().getEffectiveLevel(),
                                               timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                               access_log=logger.isEnabledFor(logging.DEBUG)))
        server.should_exit = bool(received)
        host, port = sock.getsockname()[:2]
        if port_file is not None:
            tmp = port_file.with_name(port_file.name + ".tmp")
            tmp.write_text(str(port))
            tmp.replace(port_file)  # atomic: a reader never sees a half-written port
        print(f"harness serve: preset {config.preset}, engine {mode}, listening on "
              f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
        await server.serve(sockets=[sock])
    finally:
        await client.close()
    logger.info("server stopped (signals: %s); engine closed", received)
    return 0


# ---- ServerProcess: a server as a child process ---------------------------------------------

class ServerProcess:
    """Runs ``python -m harness serve`` (or another subcommand that accepts ``--host``,
    ``--port 0`` and ``--port-file``) as a child process on a free port.

    ``with ServerProcess("tiny") as server:`` returns once ``/health`` answers 200; leaving
    the block sends SIGTERM, waits, then SIGKILLs if needed, and always reaps the child.
    The child's output goes to ``log_path`` (shown in errors).
    """

    def __init__(self, preset: str = "tiny", *, engine: str = "inproc", speculative: bool | None = None,
                 kv_budget_mb: int | None = None, host: str = "127.0.0.1", command: str = "serve",
                 extra_args: Sequence[str] = (), startup_timeout_s: float = 180.0,
                 stop_timeout_s: float = 20.0, env: dict[str, str] | None = None) -> None:
        if engine not in ENGINE_MODES:
            raise ConfigError(f"unknown engine mode {engine!r}", fix=f"use one of {ENGINE_MODES}")
        if startup_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ConfigError("startup_timeout_s and stop_timeout_s must be positive",
                              fix="pass positive numbers of seconds")
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._env = env
        self._dir = tempfile.TemporaryDirectory(prefix="harness-serve-")
        self._port_file = Path(self._dir.name) / "port"
        self.log_path = Path(self._dir.name) / "server.log"
        self.argv = [sys.executable, "-m", "harness", command, "--preset", preset, "--engine", engine,
                     "--host", host, "--port", "0", "--port-file", str(self._port_file), *extra_args]
        if speculative is not None:
            self.argv.append("--speculative" if speculative else "--no-speculative")
        if kv_budget_mb is not None:
            self.argv += ["--kv-budget-mb", str(kv_budget_mb)]
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        if self.port is None:
            raise EngineError("the server is not running", fix="use ServerProcess as a context manager")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self._env} if self._env else None)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise EngineError(f"server exited with code {self.proc.returncode} while starting:\n"
                                  f"{self.log_tail()}", fix="read the log above")
            if self.port is None and self._port_file.exists():
                self.port = int(self._port_file.read_text())
            return self.port is not None and httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200

        try:  # polling interval 0.1 s while the child imports torch and builds the model
            wait_until(healthy, self.startup_timeout_s, 0.1, what="the server's /health",
                       retry_on=(httpx.TransportError,))  # not accepting yet
        except WaitTimeoutError as exc:
            raise EngineError(f"server did not become healthy within {self.startup_timeout_s:.0f} s:\n"
                              f"{self.log_tail()}", fix="raise startup_timeout_s on a loaded machine") from exc
        logger.info("server pid %d ready at %s", self.proc.pid, self.url)

    def stop(self) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; always reaps. Returns the exit code. Idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("server pid %d ignored SIGTERM for %.0f s; killing it",
                               self.proc.pid, self.stop_timeout_s)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the server and delete its log and port file."""
        self.stop()
        self._dir.cleanup()
