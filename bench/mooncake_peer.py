"""Mooncake's transfer engine over TCP as a baseline for bench_transfer.py.

Two peers, each its own process run by an interpreter that has Mooncake (this one, or another
virtualenv's: Mooncake needs no torch): the receiver registers a buffer, the sender registers a
source buffer and writes into the receiver's with ``transfer_sync_write``, as a Mooncake-based PD
connector moves KV from a prefill to a decode worker. Both use P2P handshake metadata (no etcd or
metadata server) and protocol ``tcp``. This file is both the peer (run as a script, driven by JSON
lines on stdin) and the parent's side (``MooncakePair``); the peer imports nothing but the standard
library and ``mooncake.engine``.

Runtime needs: the wheel ``mooncake-transfer-engine-non-cuda`` (the project's ``bench`` extra) and
the system library libibverbs (Debian: ``apt-get install libibverbs1``) even for TCP; without it the
import fails with ``libibverbs.so.1: cannot open shared object file``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import select
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

INSTALL_HINT = ("install it with `pip install -e '.[bench]'` (the non-CUDA wheel, no torch) plus "
                "`apt-get install libibverbs1`, or name a virtualenv that has it with --mooncake-python PATH")
REPLY_TIMEOUT_S = 120.0


class MooncakeUnavailable(RuntimeError):
    """The interpreter cannot import mooncake.engine (the message says why)."""


def interpreter(path: str | None) -> str:
    """The Python to run the peers with: ``path`` (a virtualenv or an interpreter) or this one."""
    if path is None:
        return sys.executable
    p = Path(path)
    if p.is_dir():
        p = p / "bin" / "python"
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise ValueError(f"--mooncake-python {path}: no Python interpreter there (fix: give a virtualenv "
                         f"folder or its bin/python)")
    return str(p)


class _Peer:
    """One peer process; ``call`` sends a command and returns its reply (raises on an error reply)."""

    def __init__(self, python: str, name: str) -> None:
        self.name = name
        self._log = tempfile.TemporaryFile()
        env = dict(os.environ, GLOG_minloglevel=os.environ.get("GLOG_minloglevel", "1"))
        self._proc = subprocess.Popen([python, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._buf = b""
        try:
            first = self._reply()
            if "unavailable" in first:
                raise MooncakeUnavailable(first["unavailable"])
        except BaseException:
            self.close()
            raise

    def log_tail(self, chars: int = 1500) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def _reply(self) -> dict:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"mooncake {self.name} peer: no reply in {REPLY_TIMEOUT_S:.0f} s; its log:\n"
                                   f"{self.log_tail()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"mooncake {self.name} peer exited (code {self._proc.wait()}); its log:\n"
                                   f"{self.log_tail()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, op: str, **args) -> dict:
        self._proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self._proc.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"mooncake {self.name} peer, {op}: {reply['error']}; its log:\n{self.log_tail()}")
        return reply

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                self._proc.stdin.close()  # EOF: the peer exits
                self._proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc.stdout.close()
            self._log.close()


class MooncakePair:
    """A receiver and a sender peer on ``host``, each with ``capacity`` registered bytes."""

    def __init__(self, python: str, host: str, capacity: int) -> None:
        self._receiver = _Peer(python, "receiver")
        self._sender = None
        try:
            self._sender = _Peer(python, "sender")
            version = self._receiver.call("version")["version"]
            dst = self._receiver.call("start", host=host, capacity=capacity)
            self._sender.call("start", host=host, capacity=capacity)
            self.target, self._dst_addr = f"{host}:{dst['port']}", dst["addr"]
            self.description = f"Mooncake {version} TCP transfer engine, P2P handshake, {python}"
            self._sender.call("write", target=self.target, addr=self._dst_addr, n=1)  # opens the segment
        except BaseException:
            self.close()
            raise

    def seconds(self, path: str, nbytes: int, crc: int) -> float:
        """Write the first ``nbytes`` of file ``path`` into the receiver; checks the bytes that arrived."""
        self._sender.call("load", path=path, n=nbytes)
        self._receiver.call("zero", n=nbytes)  # so a transfer that moved nothing fails the checksum
        took = self._sender.call("write", target=self.target, addr=self._dst_addr, n=nbytes)["seconds"]
        got = self._receiver.call("crc", n=nbytes)["crc"]
        if got != crc:
            raise AssertionError(f"Mooncake: received bytes differ from what was sent (crc {got:#x} != {crc:#x})")
        return took

    def close(self) -> None:
        for peer in (self._sender, self._receiver):
            if peer is not None:
                peer.close()


def _serve(proto) -> None:
    """The peer: one command per stdin line, one JSON reply per command on ``proto``."""
    def reply(**fields) -> None:
        proto.write(json.dumps(fields) + "\n")
        proto.flush()

    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        reply(unavailable=f"{sys.executable} cannot import mooncake.engine ({exc})")
        return
    reply(ready=True)
    engine, region, base = None, None, 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op in ("load", "zero", "write", "crc") and not 0 <= cmd["n"] <= (len(region) if region else 0):
                raise ValueError(f"{cmd['n']} bytes do not fit the {len(region) if region else 0} registered")
            if op == "version":
                from importlib.metadata import PackageNotFoundError, version
                try:
                    reply(version=version("mooncake-transfer-engine-non-cuda"))
                except PackageNotFoundError:
                    reply(version=version("mooncake-transfer-engine"))
            elif op == "start":
                engine = TransferEngine()
                rc = engine.initialize(cmd["host"], "P2PHANDSHAKE", "tcp", "")
                if rc != 0:
                    raise RuntimeError(f"initialize({cmd['host']!r}, 'P2PHANDSHAKE', 'tcp') returned {rc}")
                region = mmap.mmap(-1, cmd["capacity"])
                base = ctypes.addressof(ctypes.c_char.from_buffer(region))
                rc = engine.register_memory(base, cmd["capacity"])
                if rc != 0:
                    raise RuntimeError(f"register_memory of {cmd['capacity']} bytes returned {rc}")
                reply(port=engine.get_rpc_port(), addr=base)
            elif op == "load":  # the bytes to send, into the registered source buffer (untimed)
                with open(cmd["path"], "rb") as f:
                    got = f.readinto(memoryview(region)[:cmd["n"]])
                if got != cmd["n"]:
                    raise RuntimeError(f"{cmd['path']} holds {got} bytes, not {cmd['n']}")
                reply(ok=True)
            elif op == "zero":
                ctypes.memset(base, 0, cmd["n"])
                reply(ok=True)
            elif op == "write":
                t0 = time.perf_counter()
                rc = engine.transfer_sync_write(cmd["target"], base, cmd["addr"], cmd["n"])
                took = time.perf_counter() - t0
                if rc != 0:
                    raise RuntimeError(f"transfer_sync_write to {cmd['target']} returned {rc}")
                reply(seconds=took)
            elif op == "crc":
                reply(crc=zlib.crc32(memoryview(region)[:cmd["n"]]))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which fails the run
            reply(error=f"{type(exc).__name__}: {exc}")
    if engine is not None and base:
        engine.unregister_memory(base)


if __name__ == "__main__":
    _proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the native library prints goes to the log, not into the replies
    _serve(_proto)
