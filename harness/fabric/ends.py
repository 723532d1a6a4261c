"""The probe ends that run on the fabric hosts: a TCP echo server and paced round-trip client
(item 5's latency), and a bulk receiver and sender (raw goodput). Standard library only, on
purpose: on a remote host they run as ``python3 -c <this file> CMD ...`` over SSH, so the host
needs a Python 3 and nothing of the harness (docs/fabric.md, "Real hosts").

    python -m harness.fabric.ends tcp-serve HOST PORT
    python -m harness.fabric.ends tcp-client HOST PORT SECONDS INTERVAL_MS
    python -m harness.fabric.ends tcp-client-floor HOST PORT SECONDS INTERVAL_MS FLOOR_HOST FLOOR_PORT FLOOR_EVERY
    python -m harness.fabric.ends bulk-serve HOST PORT ACCEPT_TIMEOUT_S
    python -m harness.fabric.ends bulk-send HOST PORT DURATION_S
    python -m harness.fabric.ends udp-sink HOST PORT MAX_S
    python -m harness.fabric.ends udp-flood HOST PORT DATAGRAM_BYTES MAX_S
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import stat
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
    _paced_round_trips(host, port, seconds, interval_ms, None)


def tcp_client_floor(host: str, port: int, seconds: float, interval_ms: float, floor_host: str, floor_port: int,
                     floor_every: int) -> None:
    """As ``tcp-client``, every ``floor_every``-th round trip going to a second echo server instead
    (the host's loopback: its floor), paced alike, so both kinds of round trip see the same host
    state at the same moments (floor_rtt_ms, floor_sent_s). A floor server that cannot be reached
    leaves the floor empty (floor_error) and the network round trips as they were."""
    _paced_round_trips(host, port, seconds, interval_ms, (floor_host, floor_port, max(2, floor_every)))


def _paced_round_trips(host: str, port: int, seconds: float, interval_ms: float,
                       floor: tuple[str, int, int] | None) -> None:
    kinds: dict[int, tuple[list[float], list[float]]] = {0: ([], []), 1: ([], [])}  # (rtt ms, sent s) each
    message = b"x" * MESSAGE_BYTES
    error = floor_error = None
    t0 = time.perf_counter()
    wall0, perf0 = time.time(), t0
    socks: list[socket.socket] = []
    which = 0
    try:
        socks.append(socket.create_connection((host, port), timeout=OP_TIMEOUT_S))
        if floor is not None:
            try:
                socks.append(socket.create_connection(floor[:2], timeout=OP_TIMEOUT_S))
            except OSError as exc:
                floor_error = f"{type(exc).__name__}: {exc}"
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        every = floor[2] if floor is not None and len(socks) == 2 else 0
        end = time.perf_counter() + seconds
        next_send = time.perf_counter()
        k = 0
        while (now := time.perf_counter()) < end:
            if now < next_send:
                time.sleep(next_send - now)  # pacing: a steady request rate, not a flood
            which = 1 if every and k % every == every - 1 else 0
            k += 1
            t0 = time.perf_counter()
            rtts, sent = kinds[which]
            sent.append(round(t0 - perf0, 6))
            socks[which].sendall(message)
            _recv_exact(socks[which], MESSAGE_BYTES)
            rtts.append((time.perf_counter() - t0) * 1e3)
            next_send = t0 + interval_ms / 1e3
    except OSError as exc:  # socket.timeout included
        rtts, sent = kinds[which]
        rtts.append((time.perf_counter() - t0) * 1e3)
        sent[len(rtts) - 1:] = [round(t0 - perf0, 6)]
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for sock in socks:
            sock.close()
    out = {"rtt_ms": kinds[0][0], "wall0": wall0, "sent_s": kinds[0][1], "error": error}
    if floor is not None:
        out.update(floor_rtt_ms=kinds[1][0], floor_sent_s=kinds[1][1], floor_error=floor_error)
    print(json.dumps(out), flush=True)


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
            total, first, last, first_wall, last_wall = 0, None, None, None, None
            while n := _recv_or_zero(conn, view):
                last, last_wall = time.perf_counter(), time.time()
                if first is None:
                    first, first_wall = last, last_wall  # from the first byte: connection setup is not bandwidth
                total += n
    seconds = (last - first) if first is not None and last is not None else 0.0
    # first_wall / last_wall: this host's wall clock at the first and last byte, the data's own span (a
    # flow started over SSH spends seconds more in starting its ends than in moving data)
    print(json.dumps({"bytes": total, "seconds": seconds, "first_wall": first_wall, "last_wall": last_wall}),
          flush=True)


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


class _Stop(Exception):
    """SIGTERM (how a remote end is stopped) or our stdin closed (how a local one is)."""


def _stop_on_term() -> None:
    def handler(signum: int, frame: object) -> None:
        raise _Stop()
    signal.signal(signal.SIGTERM, handler)


def _input_is_a_pipe() -> bool:
    """A local end's stdin is our pipe; a remote end's is /dev/null (it is stopped by SIGTERM)."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _input_closed() -> bool:
    if not _input_is_a_pipe():
        return False
    ready, _, _ = select.select([0], [], [], 0)
    return bool(ready) and not os.read(0, 4096)


def udp_sink(host: str, port: int, max_s: float) -> None:
    """Count a flood's datagrams until told to stop (stdin closed, SIGTERM) or ``max_s``."""
    _stop_on_term()
    total = datagrams = 0
    first = last = None
    watch = _input_is_a_pipe()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, port))
        print("listening", flush=True)
        view = memoryview(bytearray(65536))
        deadline = time.monotonic() + max_s
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([sock, 0] if watch else [sock], [], [], 0.5)
                if 0 in ready and not os.read(0, 4096):
                    break
                if sock in ready:
                    n = sock.recv_into(view)
                    last = time.perf_counter()
                    first = first if first is not None else last
                    total, datagrams = total + n, datagrams + 1
        except _Stop:
            pass
    seconds = (last - first) if first is not None and last is not None else 0.0
    print(json.dumps({"bytes": total, "datagrams": datagrams, "seconds": seconds}), flush=True)


def udp_flood(host: str, port: int, datagram_bytes: int, max_s: float) -> None:
    """Send datagrams as fast as the path takes them, never backing off, until told to stop: like
    an RDMA sender under PFC, a paused queue holds it (a blocking send on a full socket buffer)
    and a resume lets it go at once."""
    _stop_on_term()
    sent = datagrams = refused = 0
    payload = bytes(datagram_bytes)
    t0 = time.perf_counter()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            print("flooding", flush=True)
            while time.perf_counter() - t0 < max_s:
                for _ in range(32):
                    try:
                        sent += sock.send(payload)
                        datagrams += 1
                    except OSError:   # ENOBUFS, or ECONNREFUSED left by an ICMP: go on
                        refused += 1
                        time.sleep(0.001)
                if _input_closed():
                    break
    except _Stop:
        pass
    print(json.dumps({"sent_bytes": sent, "datagrams": datagrams, "send_errors": refused,
                      "seconds": time.perf_counter() - t0}), flush=True)


COMMANDS = {"tcp-serve": (tcp_serve, (str, int)), "tcp-client": (tcp_client, (str, int, float, float)),
            "tcp-client-floor": (tcp_client_floor, (str, int, float, float, str, int, int)),
            "bulk-serve": (bulk_serve, (str, int, float)), "bulk-send": (bulk_send, (str, int, float)),
            "udp-sink": (udp_sink, (str, int, float)), "udp-flood": (udp_flood, (str, int, int, float))}


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
