"""The fabric items on named hosts over SSH: a cluster file whose hosts have ``ssh:`` and
``fabric:`` settings (docs/fabric.md, "Real hosts over SSH").

Every probe end runs on the hosts themselves: commands through the host's executor (paramiko,
audited), streaming children (iperf3, ib_write_bw, the TCP probe ends) through the ``ssh``
client with the cluster file's key and known_hosts (audited too, see ``HostProcess.on``).
Nothing here touches a network namespace: the emulated fabric reached through
``python -m harness sshd-test up`` looks to this module exactly like real hosts.
"""

from __future__ import annotations

import logging
import re
import shlex
import time
from dataclasses import dataclass
from typing import Any, Sequence

from harness.errors import ConfigError, ProbeError
from harness.fabric.bandwidth import BandwidthResult, Station, measure_bulk
from harness.fabric.procs import HostProcess
from harness.fabric.ssh_hosts import fabric_hosts, ssh_fabric_reason

log = logging.getLogger(__name__)

IB_PORT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FabricNode:
    """One host of the cluster file with SSH access and a fabric NIC."""

    name: str
    roles: tuple[str, ...]
    interface: str             # the fabric netdev (flapped, stormed, line rate read from it)
    tcp_interface: str         # the NIC the TCP/IP probe's flows use (often the same one)
    station: Station           # probe ends on the fabric address
    tcp_station: Station       # probe ends on the TCP/IP address
    lossless_class: str | None
    lossless_ports: tuple[int, ...]
    rdma_device: str | None

    @property
    def bench_port(self) -> int:
        """The lossless-class port of the raw bench and the storm's flood (7472 when none is named)."""
        return self.lossless_ports[-1] if self.lossless_ports else 7472


def ssh_prefix(target: Any) -> tuple[str, ...]:
    """``ssh ... user@host --`` with the cluster file's key and known_hosts only (never learned)."""
    return ("ssh", "-i", target.key_filename, "-p", str(target.port), "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={target.known_hosts_file}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", f"ConnectTimeout={int(target.connect_timeout_s)}",
            "-o", "LogLevel=ERROR", f"{target.user}@{target.host}", "--")


def fabric_nodes(cluster: Any, audit: Any = None) -> list[FabricNode]:
    """One FabricNode per SSH fabric host of ``cluster`` (a ClusterHandle)."""
    nodes = []
    for h in fabric_hosts(cluster.spec):
        target = cluster.ssh_target(h.name)
        f = h.fabric
        realtime = target.user == "root"
        common = {"name": h.name, "remote": True, "python": f.python, "realtime": realtime, "audit": audit,
                  "prefix": ssh_prefix(target)}
        nodes.append(FabricNode(h.name, tuple(h.roles), f.interface, f.tcp_interface or f.interface,
                                Station(address=f.address, **common),
                                Station(address=f.tcp_address or f.address, **common), f.lossless_class,
                                tuple(f.lossless_ports), f.rdma_device))
    return nodes


def pick(nodes: Sequence[FabricNode]) -> dict[str, FabricNode]:
    """Roles of the fabric items among the nodes: ``source`` (a prefill host: its NIC is stormed,
    it sends the raw bench), ``peer`` (a decode host: the TCP probe's other end, the flapped NIC),
    ``other`` (a second decode host, the flood's receiver; the peer when there is none)."""
    if len(nodes) < 2:
        raise ConfigError(f"the fabric items need 2 SSH fabric hosts, the cluster file has {len(nodes)}",
                          fix="add `ssh:` and `fabric:` settings to at least two hosts")
    prefill = [n for n in nodes if "prefill" in n.roles] or list(nodes[:1])
    source = prefill[0]
    decode = [n for n in nodes if n is not source and "decode" in n.roles] or [n for n in nodes if n is not source]
    return {"source": source, "peer": decode[0], "other": decode[1] if len(decode) > 1 else decode[0]}


def ssh_nodes(cluster: Any, audit: Any = None) -> dict[str, FabricNode] | None:
    """The fabric items' roles among the cluster's SSH fabric hosts (:func:`pick`), or None when the
    cluster is not reached that way (it has an emulated fabric, is bundled, or has fewer than 2 such hosts)."""
    if cluster.fabric is not None or ssh_fabric_reason(cluster.spec) is not None:
        return None
    return pick(fabric_nodes(cluster, audit))


def tool_present(ex: Any, tool: str) -> bool:
    return ex.run(["sh", "-c", f"command -v {shlex.quote(tool)}"], timeout=15, check=False).rc == 0


# ---------------------------------------------------------------- raw bandwidth: iperf3 or ib_write_bw


def iperf3_bulk(sender: Station, receiver: Station, *, port: int, seconds: float | None = None,
                nbytes: int | None = None, timeout_s: float = 120.0) -> BandwidthResult:
    """One iperf3 TCP flow ``sender -> receiver`` for ``seconds`` or ``nbytes`` (``-n``), both ends
    started (and stopped) over SSH; the receiver's count is the result."""
    from harness.fabric.bandwidth import parse_iperf3_json

    if (seconds is None) == (nbytes is None):
        raise ConfigError("iperf3_bulk takes seconds or nbytes", fix="pass exactly one")
    amount = ["-t", f"{seconds:g}"] if seconds is not None else ["-n", str(nbytes)]
    with HostProcess.on(receiver, ["iperf3", "-s", "-1", "-B", receiver.address, "-p", str(port), "--forceflush"],
                        name=f"iperf3 server on {receiver.name}") as server:
        while "listening" not in server.readline(timeout_s):
            pass
        with HostProcess.on(sender, ["iperf3", "-c", receiver.address, "-p", str(port), *amount, "-J"],
                            name=f"iperf3 client on {sender.name}") as client:
            out = client.read_rest(timeout_s)
        server.wait(timeout_s)
    r = parse_iperf3_json(out, f"iperf3 {sender.name} -> {receiver.name}")
    return BandwidthResult(r["bps"], r["bytes"], r["seconds"], "iperf3", port, sender.name, receiver.name)


def ib_write_bw_argv(device: str, size: int, iterations: int, server_ip: str | None = None) -> list[str]:
    """perftest's RDMA write bandwidth: the server form without ``server_ip``."""
    return ["ib_write_bw", "-d", device, "-s", str(size), "-n", str(iterations), "--report_gbits", "-F",
            *([server_ip] if server_ip else [])]


_IB_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", re.MULTILINE)


def parse_ib_write_bw(text: str) -> dict[str, float]:
    """The result row of ``ib_write_bw --report_gbits``: ``#bytes #iterations BW peak[Gb/sec]
    BW average[Gb/sec] MsgRate[Mpps]`` -> bytes, iterations, peak and average bit/s."""
    rows = _IB_ROW.findall(text)
    if not rows:
        raise ProbeError(f"ib_write_bw printed no result row: {text[-500:]!r}",
                         fix="check the RDMA device name and that both ends reach each other")
    size, iters, peak, avg, _ = rows[-1]
    if "Gb/sec" not in text:
        raise ProbeError("ib_write_bw reported in MB/sec", fix="run it with --report_gbits")
    return {"bytes": int(size), "iterations": int(iters), "peak_bps": float(peak) * 1e9, "avg_bps": float(avg) * 1e9}


def ib_write_bw(sender: Station, receiver: Station, device: str, *, size: int, iterations: int = 2000,
                timeout_s: float = IB_PORT_TIMEOUT_S) -> BandwidthResult:
    """RDMA write bandwidth ``sender -> receiver`` on ``device`` (both hosts), over SSH."""
    with HostProcess.on(receiver, ib_write_bw_argv(device, size, iterations), name=f"ib_write_bw on {receiver.name}"):
        deadline = time.monotonic() + timeout_s
        while True:  # the server listens a moment after it starts: retry while it is not there yet
            with HostProcess.on(sender, ib_write_bw_argv(device, size, iterations, receiver.address),
                                name=f"ib_write_bw client on {sender.name}") as client:
                out = client.read_rest(timeout_s)
                if client.popen.returncode == 0 or time.monotonic() > deadline:
                    break
            time.sleep(0.5)
    r = parse_ib_write_bw(out)
    return BandwidthResult(r["avg_bps"], r["bytes"] * r["iterations"], r["bytes"] * r["iterations"] * 8 / r["avg_bps"],
                           "ib_write_bw", 0, sender.name, receiver.name)


def raw_curve(source: FabricNode, dest: FabricNode, executor: Any, *, sizes_mib: Sequence[float],
              seconds: float = 3.0) -> tuple[BandwidthResult, list[BandwidthResult]]:
    """The raw bandwidth ``source -> dest`` (a timed flow) and a curve over transfer sizes:
    ib_write_bw when both nodes name an RDMA device and it is installed, else iperf3."""
    if _rdma(source, dest, executor):
        curve = [_ib_write_bw_mib(source, dest, m) for m in sizes_mib]
        return max(curve, key=lambda r: r.bytes), curve
    timed = raw_timed(source, dest, executor, sizes_mib=sizes_mib, seconds=seconds)
    curve = [iperf3_bulk(source.station, dest.station, port=source.bench_port, nbytes=int(m * (1 << 20)))
             for m in sizes_mib]
    return timed, curve


def raw_timed(source: FabricNode, dest: FabricNode, executor: Any, *, sizes_mib: Sequence[float],
              seconds: float = 3.0) -> BandwidthResult:
    """One more measurement of the figure :func:`raw_curve` judges (its timed flow): ib_write_bw at
    the largest size when both nodes have RDMA, else a timed iperf3 flow."""
    if _rdma(source, dest, executor):
        return _ib_write_bw_mib(source, dest, max(sizes_mib))
    if not tool_present(executor, "iperf3"):
        raise ProbeError(f"neither ib_write_bw (with fabric.rdma_device) nor iperf3 is installed on {source.name}",
                         fix="install iperf3 (apt-get install iperf3) or perftest on the fabric hosts")
    return iperf3_bulk(source.station, dest.station, port=source.bench_port, seconds=seconds)


def _rdma(source: FabricNode, dest: FabricNode, executor: Any) -> bool:
    return bool(source.rdma_device and dest.rdma_device and tool_present(executor, "ib_write_bw"))


def _ib_write_bw_mib(source: FabricNode, dest: FabricNode, mib: float) -> BandwidthResult:
    return ib_write_bw(source.station, dest.station, source.rdma_device, size=int(mib * (1 << 20)),
                       iterations=max(5, int(512 / mib)))


def bulk(sender: Station, receiver: Station, *, port: int, seconds: float, allow_zero: bool = False) -> BandwidthResult:
    """The probe ends' own bulk flow over SSH (a stalled path reads 0 bit/s, not an error)."""
    return measure_bulk(sender, receiver, port=port, duration_s=seconds, tool="python", allow_zero=allow_zero)

