"""Raw bandwidth probe: a plain TCP bulk transfer between two fabric hosts, the reference for the
achieved line rate that item 1's KV curve is shown beside.

iperf3 when it is installed (``iperf3 -s -1`` in the receiving host, ``iperf3 -c -J`` in the
sending one); otherwise this module's own bulk sender and receiver
(``harness.fabric.ends bulk-serve|bulk-send``), timed at the receiver from the first to the
last byte. Both ends run behind each host's exec prefix (``ip netns exec HOST``) and are reaped.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import ConfigError, ProbeError
from harness.fabric import ends
from harness.fabric.procs import HostProcess

log = logging.getLogger(__name__)

TOOLS = ("auto", "iperf3", "python")
ENDS_SOURCE = Path(ends.__file__).read_text()  # what a remote host runs with `python3 -c`


@dataclass(frozen=True)
class Station:
    """One end of a probe: how to run a command there, and its fabric address. ``remote``: the
    prefix is an ``ssh ... user@host --`` command line (harness.fabric.remote), the host runs the
    probe ends with its own ``python`` and every command started there goes to ``audit``."""

    prefix: tuple[str, ...]
    address: str
    name: str = ""
    remote: bool = False
    python: str = "python3"
    realtime: bool | None = None      # None: decided on this machine (root and chrt)
    audit: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, host) -> Station:  # a harness.fabric.builder.FabricHost
        return cls(tuple(host.exec_prefix()), host.fabric_ip, host.netns)

    def ends(self, *args: str) -> list[str]:
        """argv of a probe end (harness.fabric.ends) on this station."""
        if self.remote:
            return [self.python, "-c", ENDS_SOURCE, *args]
        return [sys.executable, "-m", ends.__name__, *args]


@dataclass(frozen=True)
class BandwidthResult:
    bps: float          # goodput: payload bits per second as the receiver counted them
    bytes: int
    seconds: float
    tool: str
    port: int
    sender: str
    receiver: str
    # the receiver's wall clock at the first and last byte (its host's clock; None: the tool gives none)
    first_wall: float | None = None
    last_wall: float | None = None

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
    bps, nbytes, seconds, walls = run(sender, receiver, port, duration_s, timeout_s)
    if (nbytes <= 0 or seconds <= 0) and allow_zero:
        bps, nbytes, seconds, walls = 0.0, 0, duration_s, (None, None)
    elif nbytes <= 0 or seconds <= 0:
        raise ProbeError(f"bulk transfer {sender.name} -> {receiver.name} moved nothing",
                         fix="check that the fabric link between them is up")
    result = BandwidthResult(bps, nbytes, seconds, tool, port, sender.name or sender.address,
                             receiver.name or receiver.address, *walls)
    log.info("raw bulk %s -> %s: %.3f Gbit/s (%s)", result.sender, result.receiver, bps / 1e9, tool)
    return result


def _iperf3(sender: Station, receiver: Station, port: int, duration_s: float,
            timeout_s: float) -> tuple[float, int, float, tuple[None, None]]:
    with HostProcess.on(receiver, ["iperf3", "-s", "-1", "-B", receiver.address, "-p", str(port), "--forceflush"],
                        name=f"iperf3 server in {receiver.name}") as server:
        while "listening" not in server.readline(timeout_s):
            pass
        with HostProcess.on(sender, ["iperf3", "-c", receiver.address, "-p", str(port), "-t", f"{duration_s:g}", "-J"],
                            name=f"iperf3 client in {sender.name}") as client:
            out = client.read_rest(timeout_s)
        server.wait(timeout_s)
    result = parse_iperf3_json(out, f"iperf3 {sender.name} -> {receiver.name}")
    return result["bps"], result["bytes"], result["seconds"], (None, None)


def parse_iperf3_json(text: str, what: str = "iperf3") -> dict[str, Any]:
    """The receiver's totals of an ``iperf3 -c ... -J`` report: bps, bytes, seconds (plus the
    sender's retransmits and mean RTT when TCP reports them). iperf3 puts its own errors in the
    JSON's ``error`` key; they become a ProbeError that quotes them."""
    try:
        report = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProbeError(f"{what} gave no JSON result: {text[-500:]!r}",
                         fix="check that iperf3 (3.1 or newer, for -J) is installed on both hosts") from exc
    if report.get("error"):
        raise ProbeError(f"{what} failed: {report['error']}",
                         fix="check that the receiver's address is reachable on the fabric and the port is free")
    try:
        received = report["end"]["sum_received"]
        sent = report["end"].get("sum_sent", {})
        streams = report["end"].get("streams") or [{}]
    except (KeyError, TypeError) as exc:
        raise ProbeError(f"{what} report has no end.sum_received: {text[-500:]!r}",
                         fix="use iperf3 in TCP mode (no -u) with -J") from exc
    rtt = streams[0].get("sender", {}).get("mean_rtt")
    return {"bps": float(received["bits_per_second"]), "bytes": int(received["bytes"]),
            "seconds": float(received["seconds"]), "retransmits": sent.get("retransmits"),
            "mean_rtt_us": rtt}


def _python(sender: Station, receiver: Station, port: int, duration_s: float,
            timeout_s: float) -> tuple[float, int, float, tuple[float | None, float | None]]:
    with HostProcess.on(receiver, receiver.ends("bulk-serve", receiver.address, str(port), f"{duration_s + 20:g}"),
                        name=f"bulk receiver in {receiver.name}") as server:
        if server.readline(timeout_s) != "listening":
            raise ProbeError("bulk receiver did not start", fix="read its stderr")
        with HostProcess.on(sender, sender.ends("bulk-send", receiver.address, str(port), f"{duration_s:g}"),
                            name=f"bulk sender in {sender.name}") as client:
            client.wait(timeout_s)
        result = json.loads(server.readline(timeout_s + duration_s + 20))
    seconds = result["seconds"]
    return ((result["bytes"] * 8 / seconds if seconds > 0 else 0.0), result["bytes"], seconds,
            (result.get("first_wall"), result.get("last_wall")))


class LosslessFlood:
    """A UDP flood from ``sender`` to ``receiver`` on a lossless-class port while the context is
    open: the congestion of item 6.1.5. A TCP flood backs off under 300 ms pauses (its
    retransmission timer doubles: one moved 0.5 MB in 52 s), so the paused queue stood empty most
    of the time; this one never backs off (a full socket buffer holds it, as PFC holds an RDMA
    sender) and runs at once when the class resumes. ``result`` (after the context): what the
    receiver counted and the sender sent. ``datagram_bytes`` must fit the path's MTU (the u32
    filter that puts it in the lossless class sees ports in the first fragment only)."""

    def __init__(self, sender: Station, receiver: Station, *, port: int, datagram_bytes: int,
                 max_s: float = 900.0) -> None:
        if not 64 <= datagram_bytes <= 65000:
            raise ConfigError(f"flood datagram of {datagram_bytes} bytes", fix="use the path's MTU minus 28")
        self.sender, self.receiver, self.port = sender, receiver, port
        self.datagram_bytes, self.max_s = datagram_bytes, max_s
        self.result: dict[str, Any] = {}
        self._procs: list[HostProcess] = []

    def __enter__(self) -> LosslessFlood:
        try:
            sink = HostProcess.on(self.receiver, self.receiver.ends(
                "udp-sink", self.receiver.address, str(self.port), f"{self.max_s + 30:g}"),
                name=f"UDP flood sink in {self.receiver.name}")
            self._procs.append(sink)
            if sink.readline(30) != "listening":
                raise ProbeError("UDP flood sink did not start", fix="read its stderr")
            flood = HostProcess.on(self.sender, self.sender.ends(
                "udp-flood", self.receiver.address, str(self.port), str(self.datagram_bytes), f"{self.max_s:g}"),
                name=f"UDP flood in {self.sender.name}")
            self._procs.append(flood)
            if flood.readline(30) != "flooding":
                raise ProbeError("UDP flood did not start", fix="read its stderr")
        except BaseException:
            self._stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            sink, flood = self._procs
            flood.end_input()
            sent = json.loads(flood.readline(30))
            sink.end_input()
            got = json.loads(sink.readline(30))
            seconds = got["seconds"]
            self.result = {"tool": "udp", "port": self.port, "sender": self.sender.name, "receiver": self.receiver.name,
                           "datagram_bytes": self.datagram_bytes, "bytes": got["bytes"], "datagrams": got["datagrams"],
                           "seconds": seconds, "gbit_per_s": got["bytes"] * 8 / seconds / 1e9 if seconds > 0 else 0.0,
                           "sent_bytes": sent["sent_bytes"], "send_errors": sent["send_errors"]}
        except (ProbeError, ValueError, KeyError) as e:   # evidence only: never hide the measurement for it
            self.result = {"tool": "udp", "error": f"{type(e).__name__}: {e}"}
        finally:
            self._stop_all()

    def _stop_all(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()
