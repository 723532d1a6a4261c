"""Raw bandwidth probe: a plain TCP bulk transfer between two fabric hosts, the reference for the
achieved line rate that item 1's KV curve is shown beside.

iperf3 when it is installed (``iperf3 -s -1`` in the receiving host, ``iperf3 -c -J`` in the
sending one); otherwise this module's own bulk sender and receiver
(``python -m harness.fabric.bandwidth serve|send``), timed at the receiver from the first to the
last byte. Both ends run behind each host's exec prefix (``ip netns exec HOST``) and are reaped.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from harness.errors import ConfigError, ProbeError
from harness.fabric.procs import HostProcess

log = logging.getLogger(__name__)

TOOLS = ("auto", "iperf3", "python")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Station:
    """One end of a probe: how to run a command there, and its fabric address."""

    prefix: tuple[str, ...]
    address: str
    name: str = ""

    @classmethod
    def of(cls, host) -> Station:  # a harness.fabric.builder.FabricHost
        return cls(tuple(host.exec_prefix()), host.fabric_ip, host.netns)


@dataclass(frozen=True)
class BandwidthResult:
    bps: float          # goodput: payload bits per second as the receiver counted them
    bytes: int
    seconds: float
    tool: str
    port: int
    sender: str
    receiver: str

    def to_dict(self) -> dict:
        return {**asdict(self), "gbit_per_s": self.bps / 1e9}


def measure_bulk(sender: Station, receiver: Station, *, port: int, duration_s: float = 3.0,
                 tool: str = "auto", timeout_s: float = 60.0, allow_zero: bool = False) -> BandwidthResult:
    """One bulk TCP flow ``sender -> receiver`` on ``port`` for about ``duration_s`` seconds.
    ``allow_zero``: a flow that moved nothing is a measurement (0 bit/s), not an error."""
    if tool not in TOOLS:
        raise ConfigError(f"bandwidth tool {tool!r} is unknown", fix=f"use one of {TOOLS}")
    if not 0.5 <= duration_s <= 300:
        raise ConfigError(f"bulk duration {duration_s} s is out of range", fix="use 0.5..300 s")
    if tool == "auto":
        tool = "iperf3" if shutil.which("iperf3") else "python"
    run = _iperf3 if tool == "iperf3" else _python
    bps, nbytes, seconds = run(sender, receiver, port, duration_s, timeout_s)
    if (nbytes <= 0 or seconds <= 0) and allow_zero:
        bps, nbytes, seconds = 0.0, 0, duration_s
    elif nbytes <= 0 or seconds <= 0:
        raise ProbeError(f"bulk transfer {sender.name} -> {receiver.name} moved nothing",
                         fix="check that the fabric link between them is up")
    result = BandwidthResult(bps, nbytes, seconds, tool, port, sender.name or sender.address,
                             receiver.name or receiver.address)
    log.info("raw bulk %s -> %s: %.3f Gbit/s (%s)", result.sender, result.receiver, bps / 1e9, tool)
    return result


def _iperf3(sender: Station, receiver: Station, port: int, duration_s: float,
            timeout_s: float) -> tuple[float, int, float]:
    with HostProcess(receiver.prefix, ["iperf3", "-s", "-1", "-B", receiver.address, "-p", str(port),
                                       "--forceflush"], name=f"iperf3 server in {receiver.name}") as server:
        while "listening" not in server.readline(timeout_s):
            pass
        with HostProcess(sender.prefix, ["iperf3", "-c", receiver.address, "-p", str(port), "-t", f"{duration_s:g}",
                                         "-J"], name=f"iperf3 client in {sender.name}") as client:
            out = client.read_rest(timeout_s)
        server.wait(timeout_s)
    try:
        report = json.loads(out)
        summary = report["end"]["sum_received"]
    except (json.JSONDecodeError, KeyError) as exc:
        raise ProbeError(f"iperf3 {sender.name} -> {receiver.name} gave no result: {out[-500:]}",
                         fix="check that the receiver's address is reachable on the fabric") from exc
    return float(summary["bits_per_second"]), int(summary["bytes"]), float(summary["seconds"])


def _python(sender: Station, receiver: Station, port: int, duration_s: float,
            timeout_s: float) -> tuple[float, int, float]:
    with HostProcess.python(receiver.prefix, __name__, "serve", receiver.address, str(port),
                            f"{duration_s + 20:g}", name=f"bulk receiver in {receiver.name}") as server:
        if server.readline(timeout_s) != "listening":
            raise ProbeError("bulk receiver did not start", fix="read its stderr")
        with HostProcess.python(sender.prefix, __name__, "send", receiver.address, str(port), f"{duration_s:g}",
                                name=f"bulk sender in {sender.name}") as client:
            client.wait(timeout_s)
        result = json.loads(server.readline(timeout_s + duration_s + 20))
    seconds = result["seconds"]
    return (result["bytes"] * 8 / seconds if seconds > 0 else 0.0), result["bytes"], seconds


# ---------------------------------------------------------------- the bulk ends (child processes)


def _serve(host: str, port: int, accept_timeout_s: float) -> None:
    with socket.create_server((host, port)) as srv:
        print("listening", flush=True)
        srv.settimeout(accept_timeout_s)
        try:
            conn, _ = srv.accept()
        except socket.timeout:  # the sender never got through: a stalled path moved 0 bytes
            print(json.dumps({"bytes": 0, "seconds": 0.0}), flush=True)
            return
        conn.settimeout(accept_timeout_s)
        with conn:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            total, first, last = 0, None, None
            while n := _recv_or_zero(conn, view):
                last = time.perf_counter()
                if first is None:
                    first = last  # time from the first byte: connection setup is not bandwidth
                total += n
    seconds = (last - first) if first is not None and last is not None else 0.0
    print(json.dumps({"bytes": total, "seconds": seconds}), flush=True)


def _recv_or_zero(conn: socket.socket, view: memoryview) -> int:
    try:
        return conn.recv_into(view)
    except socket.timeout:  # the sender stalled for good: end the measurement with what arrived
        return 0


def _send(host: str, port: int, duration_s: float) -> None:
    payload = memoryview(bytes(_CHUNK))
    with socket.create_connection((host, port), timeout=30) as sock:
        deadline = time.perf_counter() + duration_s
        while time.perf_counter() < deadline:
            sock.sendall(payload)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description="raw TCP bulk transfer ends")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("host")
    s.add_argument("port", type=int)
    s.add_argument("accept_timeout_s", type=float)
    c = sub.add_parser("send")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("duration_s", type=float)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        _serve(args.host, args.port, args.accept_timeout_s)
    else:
        _send(args.host, args.port, args.duration_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
