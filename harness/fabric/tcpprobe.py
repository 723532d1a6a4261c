"""Probe of the fabric's TCP/IP class: request/response latency and bulk throughput (item 5).

Latency: an echo server in one host and a client in another exchange small messages over one
persistent TCP connection (TCP_NODELAY) at a steady pace; each round trip is timed with
``perf_counter``. Throughput: the raw bulk probe (:mod:`harness.fabric.bandwidth`) on a
TCP-class port. Run it before, during and after a PFC storm; the ports must not be lossless
ports, or the probe measures the class it is meant to be isolated from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from harness.checks.stats import nearest_rank
from harness.errors import ConfigError, ProbeError
from harness.fabric.bandwidth import Station, measure_bulk
from harness.fabric.procs import HostProcess

log = logging.getLogger(__name__)

DEFAULT_PORT = 5301          # RR port; bulk uses port + 1 (both outside the lossless ports)
MESSAGE_BYTES = 64
STARTUP_TIMEOUT_S = 60.0
OP_TIMEOUT_S = 10.0          # a round trip slower than this ends the latency phase
RT_PRIORITY = 20             # SCHED_FIFO priority of the round-trip ends (root only)


@dataclass(frozen=True)
class TcpClassSample:
    label: str                 # "before", "during", "after"
    rtt_p50_ms: float
    rtt_p99_ms: float
    rtt_max_ms: float
    round_trips: int
    throughput_bps: float
    started_wall: float
    ended_wall: float

    def to_dict(self) -> dict:
        return {**asdict(self), "throughput_gbit_per_s": self.throughput_bps / 1e9}


def _realtime(station: Station) -> tuple[str, ...]:
    """Run the round-trip ends at a real-time priority when we may: on a busy machine the probe
    should time the network, not the CPU scheduler (other processes' load shows up as ms spikes)."""
    if os.geteuid() == 0 and shutil.which("chrt"):
        return (*station.prefix, "chrt", "-f", str(RT_PRIORITY))
    return station.prefix


def measure_round_trips(client: Station, server: Station, *, port: int = DEFAULT_PORT, seconds: float = 3.0,
                        interval_ms: float = 5.0) -> list[float]:
    """Round-trip times in ms of ``MESSAGE_BYTES`` messages, one every ``interval_ms``, for ``seconds``."""
    with HostProcess.python(_realtime(server), __name__, "serve", server.address, str(port),
                            name=f"TCP echo server in {server.name}") as srv:
        if srv.readline(STARTUP_TIMEOUT_S) != "listening":
            raise ProbeError("TCP echo server did not start", fix="read its stderr")
        with HostProcess.python(_realtime(client), __name__, "client", server.address, str(port), f"{seconds:g}",
                                f"{interval_ms:g}", name=f"TCP RR client in {client.name}") as cli:
            result = json.loads(cli.readline(seconds + OP_TIMEOUT_S + STARTUP_TIMEOUT_S))
    rtts = result["rtt_ms"]
    if result.get("error"):
        log.warning("TCP round trips %s -> %s stalled: %s", client.name, server.name, result["error"])
    if not rtts:  # the client records a stalled round trip, so empty means it never ran
        raise ProbeError(f"no round trip completed between {client.name} and {server.name} in {seconds} s",
                         fix="check the fabric link and that the port is not blocked")
    return rtts


def sample_tcp_class(client: Station, server: Station, *, label: str, port: int = DEFAULT_PORT,
                     rr_seconds: float = 3.0, bulk_seconds: float = 3.0, lossless_ports: Sequence[int] = ()
                     ) -> TcpClassSample:
    """Latency phase, then throughput phase, both ``client -> server`` on the TCP class."""
    if port in lossless_ports or port + 1 in lossless_ports:
        raise ConfigError(f"TCP probe ports {port}/{port + 1} are lossless-class ports {list(lossless_ports)}",
                          fix="probe the TCP class on other ports, e.g. the default 5301")
    t0 = time.time()
    rtts = measure_round_trips(client, server, port=port, seconds=rr_seconds)
    # our own bulk ends: a stalled class then reads as 0 bit/s instead of an iperf3 control-channel error
    bulk = measure_bulk(client, server, port=port + 1, duration_s=bulk_seconds, tool="python", allow_zero=True)
    sample = TcpClassSample(label, nearest_rank(rtts, 50), nearest_rank(rtts, 99), max(rtts), len(rtts),
                            bulk.bps, t0, time.time())
    log.info("TCP class %s: RTT p50 %.3f ms p99 %.3f ms (%d), bulk %.3f Gbit/s", label, sample.rtt_p50_ms,
             sample.rtt_p99_ms, sample.round_trips, bulk.bps / 1e9)
    return sample


# ---------------------------------------------------------------- the two ends (child processes)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


def _serve(host: str, port: int) -> None:
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


def _client(host: str, port: int, seconds: float, interval_ms: float) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description="TCP-class round-trip probe ends")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("host")
    s.add_argument("port", type=int)
    c = sub.add_parser("client")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("seconds", type=float)
    c.add_argument("interval_ms", type=float)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        _serve(args.host, args.port)
    else:
        _client(args.host, args.port, args.seconds, args.interval_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
