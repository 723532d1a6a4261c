"""The probe ends that run on the fabric hosts: a TCP echo server and paced round-trip client
(item 5's latency), and a bulk receiver and sender (raw goodput). Standard library only, on
purpose: on a remote host they run as ``python3 -c <this file> CMD ...`` over SSH, so the host
needs a Python 3 and nothing of the harness (docs/fabric.md, "Real hosts").

    python -m harness.fabric.ends tcp-serve HOST PORT
    python -m harness.fabric.ends tcp-client HOST PORT SECONDS INTERVAL_MS
    python -m harness.fabric.ends bulk-serve HOST PORT ACCEPT_TIMEOUT_S
    python -m harness.fabric.ends bulk-send HOST PORT DURATION_S
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

MESSAGE_BYTES = 64
OP_TIMEOUT_S = 10.0          # a round trip slower than this ends the latency phase
CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


def tcp_serve(host: str, port: int) -> None:
    with socket.create_server((host, port)) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while True:
                    conn.sendall(_recv_exact(conn, MESSAGE_BYTES))
            except ConnectionError:
                pass


def tcp_client(host: str, port: int, seconds: float, interval_ms: float) -> None:
    """A round trip that does not complete within OP_TIMEOUT_S is recorded at the time it waited
    and ends the probe: a stalled class is a measurement (huge latency), not a probe failure."""
    rtts: list[float] = []
    message = b"x" * MESSAGE_BYTES
    error = None
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=OP_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            end = time.perf_counter() + seconds
            next_send = time.perf_counter()
            while (now := time.perf_counter()) < end:
                if now < next_send:
                    time.sleep(next_send - now)  # pacing: a steady request rate, not a flood
                t0 = time.perf_counter()
                sock.sendall(message)
                _recv_exact(sock, MESSAGE_BYTES)
                rtts.append((time.perf_counter() - t0) * 1e3)
                next_send = t0 + interval_ms / 1e3
    except OSError as exc:  # socket.timeout included
        rtts.append((time.perf_counter() - t0) * 1e3)
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rtt_ms": rtts, "error": error}), flush=True)


def bulk_serve(host: str, port: int, accept_timeout_s: float) -> None:
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
            view = memoryview(bytearray(CHUNK))
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


def bulk_send(host: str, port: int, duration_s: float) -> None:
    payload = memoryview(bytes(CHUNK))
    with socket.create_connection((host, port), timeout=30) as sock:
        deadline = time.perf_counter() + duration_s
        while time.perf_counter() < deadline:
            sock.sendall(payload)


COMMANDS = {"tcp-serve": (tcp_serve, (str, int)), "tcp-client": (tcp_client, (str, int, float, float)),
            "bulk-serve": (bulk_serve, (str, int, float)), "bulk-send": (bulk_send, (str, int, float))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.fabric.ends", description="fabric probe ends")
    p.add_argument("command", choices=sorted(COMMANDS))
    p.add_argument("args", nargs="*")
    args = p.parse_args(argv)
    func, types = COMMANDS[args.command]
    if len(args.args) != len(types):
        p.error(f"{args.command} takes {len(types)} arguments, got {len(args.args)}")
    func(*(t(a) for t, a in zip(types, args.args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
