"""Probe of the fabric's TCP/IP class: request/response latency and bulk throughput (item 5).

Latency: an echo server in one host and a client in another exchange small messages over one
persistent TCP connection (TCP_NODELAY) at a steady pace; each round trip is timed with
``perf_counter``. Throughput: the raw bulk probe (:mod:`harness.fabric.bandwidth`) on a
TCP-class port. Run it before, during and after a PFC storm; the ports must not be lossless
ports, or the probe measures the class it is meant to be isolated from.

The floor: the same round trip over the client host's own loopback (:func:`loopback`, no network
at all) times what the host's timer, scheduler and the probe ends themselves add. Its p99, taken
beside a sample (``floor_rtts_ms``), is the resolution of that sample's p99: a network p99 below
it is not a measurement of the network (6.1.5 floors its calm side there, harness/checks/fabric.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, fields, replace
from typing import Sequence

from harness.stats import nearest_rank
from harness.errors import ConfigError, ProbeError
from harness.fabric.bandwidth import Station, measure_bulk
from harness.fabric.ends import OP_TIMEOUT_S
from harness.fabric.procs import HostProcess

log = logging.getLogger(__name__)

DEFAULT_PORT = 5301          # RR port; bulk uses port + 1 (both outside the lossless ports)
LOOPBACK_PORT_OFFSET = 2     # the loopback floor's echo server listens on 127.0.0.1, port + 2
LOOPBACK_ADDRESS = "127.0.0.1"
STARTUP_TIMEOUT_S = 60.0
RT_PRIORITY = 20             # SCHED_FIFO priority of the round-trip ends (root only)


@dataclass(frozen=True)
class TcpClassSample:
    label: str                 # "calm" (between storm groups) or "before", "during", "after"
    rtt_p50_ms: float
    rtt_p99_ms: float
    rtt_max_ms: float
    round_trips: int
    throughput_bps: float      # median of the bulk flows
    started_wall: float
    ended_wall: float
    rtts_ms: tuple[float, ...] = ()            # every round trip (for the percentile intervals)
    throughputs_bps: tuple[float, ...] = ()    # each bulk flow
    # the same probe's round trips over the client host's loopback, taken beside this sample (ms)
    floor_rtts_ms: tuple[float, ...] = ()

    @property
    def floor_p99_ms(self) -> float | None:
        """p99 of the loopback round trips taken beside this sample: the resolution of its own
        p99 (timer, scheduler and probe ends, no network); None: not measured."""
        return nearest_rank(self.floor_rtts_ms, 99) if self.floor_rtts_ms else None

    def to_dict(self) -> dict:
        # thousands of values: percentiles and counts stand for them (asdict would copy them all first)
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rtts_ms", "floor_rtts_ms")}
        d["throughputs_bps"] = list(self.throughputs_bps)
        floor = {"floor_p99_ms": self.floor_p99_ms, "floor_round_trips": len(self.floor_rtts_ms)}
        return {**d, **floor, "throughput_gbit_per_s": self.throughput_bps / 1e9}

    def merged(self, more: TcpClassSample) -> TcpClassSample:
        """This sample and ``more`` (a later one of the same window) as one."""
        rtts, flows = self.rtts_ms + more.rtts_ms, self.throughputs_bps + more.throughputs_bps
        return TcpClassSample(self.label, nearest_rank(rtts, 50), nearest_rank(rtts, 99), max(rtts), len(rtts),
                              nearest_rank(flows, 50), self.started_wall, more.ended_wall, rtts, flows,
                              self.floor_rtts_ms + more.floor_rtts_ms)


def _realtime(station: Station, argv: list[str]) -> list[str]:
    """Run the round-trip ends at a real-time priority when we may: on a busy machine the probe
    should time the network, not the CPU scheduler (other processes' load shows up as ms spikes).
    A remote station says itself whether it may (its SSH user is root)."""
    may = station.realtime if station.realtime is not None else (os.geteuid() == 0 and bool(shutil.which("chrt")))
    return ["chrt", "-f", str(RT_PRIORITY), *argv] if may else argv


def loopback(station: Station) -> Station:
    """The same station, its probe ends talking over the host's loopback (127.0.0.1): round trips
    with no network in them, to time the host's own floor."""
    return replace(station, address=LOOPBACK_ADDRESS, name=f"{station.name} loopback")


def measure_round_trips(client: Station, server: Station, *, port: int = DEFAULT_PORT, seconds: float = 3.0,
                        interval_ms: float = 5.0) -> list[float]:
    """Round-trip times in ms of ``MESSAGE_BYTES`` messages, one every ``interval_ms``, for ``seconds``."""
    return [rtt for _, rtt in timed_round_trips(client, server, port=port, seconds=seconds, interval_ms=interval_ms)]


def timed_round_trips(client: Station, server: Station, *, port: int = DEFAULT_PORT, seconds: float = 3.0,
                      interval_ms: float = 5.0) -> list[tuple[float, float]]:
    """(wall time on the client's host when it was sent, round-trip ms) of each round trip."""
    with HostProcess.on(server, _realtime(server, server.ends("tcp-serve", server.address, str(port))),
                        name=f"TCP echo server in {server.name}") as srv:
        if srv.readline(STARTUP_TIMEOUT_S) != "listening":
            raise ProbeError(f"TCP echo server on {server.address}:{port} in {server.name} did not start",
                             fix=f"free port {port} on that host (another process may hold it), or read the "
                                 "echo server's stderr")
        with HostProcess.on(client, _realtime(client, client.ends("tcp-client", server.address, str(port),
                                                                  f"{seconds:g}", f"{interval_ms:g}")),
                            name=f"TCP RR client in {client.name}") as cli:
            result = json.loads(cli.readline(seconds + OP_TIMEOUT_S + STARTUP_TIMEOUT_S))
    rtts = result["rtt_ms"]
    wall0, sent = result.get("wall0", 0.0), result.get("sent_s") or [0.0] * len(rtts)
    if result.get("error"):
        log.warning("TCP round trips %s -> %s stalled: %s", client.name, server.name, result["error"])
    if not rtts:  # the client records a stalled round trip, so empty means it never ran
        raise ProbeError(f"no round trip completed between {client.name} and {server.name} in {seconds} s",
                         fix="check the fabric link and that the port is not blocked")
    return [(wall0 + t, rtt) for t, rtt in zip(sent, rtts)]


@dataclass(frozen=True)
class FlooredRoundTrips:
    """Round trips to the server and, interleaved with them, to the floor's echo server:
    (wall time sent on the client's host, ms) each; ``floor_error``: why there is no floor."""
    network: list[tuple[float, float]]
    floor: list[tuple[float, float]]
    floor_error: str | None = None


def timed_round_trips_with_floor(client: Station, server: Station, *, port: int, floor_port: int,
                                 seconds: float, interval_ms: float, floor_every: int) -> FlooredRoundTrips:
    """Paced round trips ``client -> server`` for ``seconds``, every ``floor_every``-th of them
    sent instead over the client host's loopback (:func:`loopback`, its echo server on
    ``floor_port``). Interleaved, the floor sees the host as the network round trips see it at the
    same moments (a storm's pauses, a flood's busy CPU or an idle one waking up): taken in a phase
    of its own it once fell wholly on one side of a storm, and a host that answers 0.03 ms with a
    busy CPU and 0.4 ms with an idle one read as a storm's latency (CI 2026-12-06). A floor
    whose echo server cannot start or be reached leaves the floor empty with the reason; the
    network round trips go on."""
    floor_station = loopback(client)
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(HostProcess.on(server, _realtime(server, server.ends("tcp-serve", server.address,
                                                                                       str(port))),
                                                 name=f"TCP echo server in {server.name}"))
        if srv.readline(STARTUP_TIMEOUT_S) != "listening":
            raise ProbeError(f"TCP echo server on {server.address}:{port} in {server.name} did not start",
                             fix=f"free port {port} on that host (another process may hold it), or read the "
                                 "echo server's stderr")
        floor_error = None
        try:
            fsrv = stack.enter_context(HostProcess.on(
                floor_station, _realtime(floor_station, floor_station.ends("tcp-serve", LOOPBACK_ADDRESS,
                                                                           str(floor_port))),
                name=f"TCP echo server on {floor_station.name}"))
            if (line := fsrv.readline(STARTUP_TIMEOUT_S)) != "listening":
                floor_error = f"its echo server on {floor_station.name} did not start (it printed {line!r})"
        except ProbeError as exc:   # the server exited: a traceback's last line says why
            lines = str(exc).strip().splitlines() or [""]
            floor_error = lines[0] if len(lines) == 1 else f"{lines[0].split('Traceback')[0].rstrip()} {lines[-1]}"
        if floor_error is None:
            argv = client.ends("tcp-client-floor", server.address, str(port), f"{seconds:g}", f"{interval_ms:g}",
                               LOOPBACK_ADDRESS, str(floor_port), str(floor_every))
        else:
            argv = client.ends("tcp-client", server.address, str(port), f"{seconds:g}", f"{interval_ms:g}")
        with HostProcess.on(client, _realtime(client, argv), name=f"TCP RR client in {client.name}") as cli:
            result = json.loads(cli.readline(seconds + OP_TIMEOUT_S + STARTUP_TIMEOUT_S))
    rtts, wall0 = result["rtt_ms"], result.get("wall0", 0.0)
    if result.get("error"):
        log.warning("TCP round trips %s -> %s stalled: %s", client.name, server.name, result["error"])
    if not rtts:
        raise ProbeError(f"no round trip completed between {client.name} and {server.name} in {seconds} s",
                         fix="check the fabric link and that the port is not blocked")
    floor_error = floor_error or result.get("floor_error")
    if floor_error:
        floor_error = f"loopback floor on port {floor_port} not measured: {floor_error}"
    return FlooredRoundTrips([(wall0 + t, ms) for t, ms in zip(result["sent_s"], rtts)],
                             [(wall0 + t, ms) for t, ms in zip(result.get("floor_sent_s") or (),
                                                               result.get("floor_rtt_ms") or ())],
                             floor_error)


def split_by_spans(items: Sequence[tuple[float, float, float]], spans: Sequence[tuple[float, float]], *,
                   settle_s: float) -> tuple[list[float], list[float]]:
    """Measurements ``(start, end, value)`` (wall times) split into those wholly inside one of
    ``spans`` and those wholly outside every span and its aftermath (``settle_s`` after its end);
    the rest (crossing a span's edge) are neither. Returns (inside values, outside values)."""
    inside: list[float] = []
    outside: list[float] = []
    for start, end, value in items:
        if any(s <= start and end <= e for s, e in spans):
            inside.append(value)
        elif all(end < s or start > e + settle_s for s, e in spans):
            outside.append(value)
    return inside, outside


def class_sample(label: str, rtts: Sequence[float], flows: Sequence[float], started_wall: float,
                 ended_wall: float, floor: Sequence[float] = ()) -> TcpClassSample:
    """A sample made of round trips and bulk flows picked from longer measurements; ``floor``: the
    loopback round trips taken beside them."""
    return TcpClassSample(label, nearest_rank(rtts, 50) if rtts else 0.0, nearest_rank(rtts, 99) if rtts else 0.0,
                          max(rtts, default=0.0), len(rtts), nearest_rank(flows, 50) if flows else 0.0,
                          started_wall, ended_wall, tuple(rtts), tuple(flows), tuple(floor))


def check_probe_ports(port: int, lossless_ports: Sequence[int]) -> None:
    """The probe's round-trip port and its bulk port (``port + 1``) must be TCP-class ports."""
    if port in lossless_ports or port + 1 in lossless_ports:
        raise ConfigError(f"TCP probe ports {port}/{port + 1} are lossless-class ports {list(lossless_ports)}",
                          fix="probe the TCP class on other ports, e.g. the default 5301")


def sample_tcp_class(client: Station, server: Station, *, label: str, port: int = DEFAULT_PORT,
                     rr_seconds: float = 3.0, bulk_seconds: float = 3.0, bulk_repeats: int = 1,
                     lossless_ports: Sequence[int] = ()) -> TcpClassSample:
    """Latency phase, then throughput phase (``bulk_repeats`` flows of ``bulk_seconds``), both
    ``client -> server`` on the TCP class."""
    check_probe_ports(port, lossless_ports)
    t0 = time.time()
    rtts = measure_round_trips(client, server, port=port, seconds=rr_seconds)
    # our own bulk ends: a stalled class then reads as 0 bit/s instead of an iperf3 control-channel error
    flows = [measure_bulk(client, server, port=port + 1, duration_s=bulk_seconds, tool="python", allow_zero=True).bps
             for _ in range(bulk_repeats)]
    sample = TcpClassSample(label, nearest_rank(rtts, 50), nearest_rank(rtts, 99), max(rtts), len(rtts),
                            nearest_rank(flows, 50), t0, time.time(), tuple(rtts), tuple(flows))
    log.info("TCP class %s: RTT p50 %.3f ms p99 %.3f ms (%d), bulk %.3f Gbit/s (median of %d)", label,
             sample.rtt_p50_ms, sample.rtt_p99_ms, sample.round_trips, sample.throughput_bps / 1e9, len(flows))
    return sample
