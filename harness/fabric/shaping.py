"""Line-rate shaping and traffic classes of one fabric NIC, built from tc ``htb`` and ``u32``.

The RDMA analog on a kernel without ``netem``/``prio``: an htb tree per NIC direction::

    1:   htb root qdisc, unclassified traffic -> the TCP class (or the lossless one, on purpose)
    1:1  the line rate (rate = ceil = line rate)
    1:10 lossless KV class, "the RDMA priority": guaranteed share, may borrow up to the line rate
    1:20 TCP/IP class: the rest of the guarantee, may borrow up to the line rate

Both classes have the same htb priority and a quantum of one jumbo frame: htb then serves them by
deficit round robin, the analog of DCB's ETS (weighted shares between traffic classes), not strict
priority. With the lossless class at a higher priority, a resume after a pause sent its whole
burst (125 KB, 1 ms at 1 Gbit/s) ahead of every TCP packet: the TCP class's p99 round trip went
from 0.12 to 1.26 ms under a storm (10x, measured 2026-12-05 once 6.1.5 lost its 1 ms floor),
which no ETS-arbitrated NIC does.

``u32`` filters put TCP segments to or from the lossless ports (the KV data plane) into 1:10.
A "PFC pause" is the lossless class's rate cut to almost nothing (``tc class change``) and a
resume is the original parameters put back; :func:`read_classes` parses ``tc -s class show``
(this iproute2 prints htb classes as text even with ``-j``) for the counters that prove it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Sequence

from harness.errors import ConfigError, ProbeError
from harness.hosts import Executor

log = logging.getLogger(__name__)

ROOT_CLASS = "1:1"
LOSSLESS_CLASS = "1:10"
TCP_CLASS = "1:20"
CLASS_PRIO = 0   # both classes: round robin between them, not strict priority (module docstring)
DEFAULT_LOSSLESS_PORTS = (7471, 7472)   # 7471: decode workers' KV listener; 7472: KV bench and incast floods
PAUSE_RATE_BPS = 8_000                  # a paused class still trickles 1 kB/s: htb refuses a zero rate
TC_TIMEOUT_S = 10.0

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_CLASS_HEAD = re.compile(r"^class htb (?P<id>\S+) (?:root|parent (?P<parent>\S+))(?: leaf \S+)?(?: prio (?P<prio>\d+))?"
                         r" rate (?P<rate>\S+) ceil (?P<ceil>\S+) burst (?P<burst>\S+) cburst (?P<cburst>\S+)")
_SENT = re.compile(r"Sent (?P<bytes>\d+) bytes (?P<pkts>\d+) pkt \(dropped (?P<dropped>\d+), "
                   r"overlimits (?P<overlimits>\d+)")
_BACKLOG = re.compile(r"backlog (?P<bytes>\d+)b (?P<pkts>\d+)p")


def parse_rate(text: str) -> float:
    """``2Gbit`` -> 2e9 bits/s; ``8Kbit``, ``500Mbit``, ``96bit`` likewise (tc's units are decimal)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)bit", text.strip())
    if not m:
        raise ProbeError(f"cannot parse tc rate {text!r}", fix="report this tc output format as a bug")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_size(text: str) -> int:
    """``1375b`` / ``64Kb`` / ``2Mb`` -> bytes (tc prints sizes in binary units)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)b", text.strip())
    if not m:
        raise ProbeError(f"cannot parse tc size {text!r}", fix="report this tc output format as a bug")
    return int(float(m.group(1)) * {"": 1, "K": 1024, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


@dataclass(frozen=True)
class TcClass:
    """One htb class as ``tc -s class show`` reports it: parameters and counters."""

    classid: str
    parent: str | None
    prio: int | None
    rate_bps: float
    ceil_bps: float
    burst_bytes: int
    cburst_bytes: int
    sent_bytes: int = 0
    sent_packets: int = 0
    dropped: int = 0
    overlimits: int = 0
    backlog_bytes: int = 0
    backlog_packets: int = 0


def parse_classes(text: str) -> dict[str, TcClass]:
    """Parse ``tc -s class show dev X`` output (htb classes) into {classid: TcClass}."""
    classes: dict[str, TcClass] = {}
    for block in re.split(r"\n(?=class )", text.strip()):
        head = _CLASS_HEAD.match(block.strip())
        if not head:
            continue
        sent, backlog = _SENT.search(block), _BACKLOG.search(block)
        classes[head["id"]] = TcClass(
            classid=head["id"], parent=head["parent"], prio=int(head["prio"]) if head["prio"] else None,
            rate_bps=parse_rate(head["rate"]), ceil_bps=parse_rate(head["ceil"]),
            burst_bytes=parse_size(head["burst"]), cburst_bytes=parse_size(head["cburst"]),
            sent_bytes=int(sent["bytes"]) if sent else 0, sent_packets=int(sent["pkts"]) if sent else 0,
            dropped=int(sent["dropped"]) if sent else 0, overlimits=int(sent["overlimits"]) if sent else 0,
            backlog_bytes=int(backlog["bytes"]) if backlog else 0,
            backlog_packets=int(backlog["pkts"]) if backlog else 0)
    return classes


@dataclass(frozen=True)
class ShapingSpec:
    """How one fabric NIC is shaped. ``tcp_in_lossless`` misconfigures it on purpose: unclassified
    (TCP/IP) traffic then lands in the lossless class, so a PFC storm spreads to it."""

    line_rate_bps: float = 1e9  # the KV data plane reaches 0.9+ of it on 2 cores (docs/fabric.md, measured)
    mtu: int = 9000
    lossless_share: float = 0.5          # guaranteed fraction of the line rate for the lossless class
    lossless_ports: tuple[int, ...] = DEFAULT_LOSSLESS_PORTS
    tcp_in_lossless: bool = False

    def __post_init__(self) -> None:
        if not 1e6 <= self.line_rate_bps <= 100e9:
            raise ConfigError(f"fabric line rate {self.line_rate_bps:g} bit/s is out of range",
                              fix="use 1e6..1e11 bit/s (the bundled default, 1e9, is what the KV data plane fills on 2 cores)")
        if not 1280 <= self.mtu <= 65000:
            raise ConfigError(f"fabric MTU {self.mtu} is out of range", fix="use 1280..65000 (9000 = jumbo frames)")
        if not 0.05 <= self.lossless_share <= 0.95:
            raise ConfigError(f"lossless_share {self.lossless_share} must be in [0.05, 0.95]",
                              fix="leave room for both classes, e.g. 0.5")
        if not self.lossless_ports or any(not 0 < int(p) < 65536 for p in self.lossless_ports):
            raise ConfigError(f"lossless_ports {self.lossless_ports!r} must be TCP ports",
                              fix="list ports in 1..65535, e.g. [7471, 7472]")

    @property
    def burst_bytes(self) -> int:
        # one millisecond at line rate (at least a few jumbo frames): htb's default burst is one
        # timer tick's worth at 1250 B, which leaves multi-Gbit/s rates well short of their target
        return max(4 * self.mtu, int(self.line_rate_bps / 8 / 1000))

    @property
    def lossless_rate_bps(self) -> float:
        return self.line_rate_bps * self.lossless_share

    @property
    def tcp_rate_bps(self) -> float:
        return self.line_rate_bps - self.lossless_rate_bps


def _tc(netns: str | None, *args: str) -> list[str]:
    return ["tc", *(["-n", netns] if netns else []), *args]


def _bits(bps: float) -> str:
    return f"{int(bps)}bit"


def class_params(spec_rate: float, ceil: float, burst: int, prio: int) -> list[str]:
    return ["rate", _bits(spec_rate), "ceil", _bits(ceil), "burst", str(burst), "cburst", str(burst),
            "prio", str(prio)]


def shaping_commands(dev: str, netns: str | None, spec: ShapingSpec) -> list[list[str]]:
    """The tc commands that (re)build the htb tree on ``dev``; run after :func:`clear_command`."""
    quantum = str(max(spec.mtu + 100, 60000))  # the root's: > MTU, and quiet about "quantum is big" at Gbit rates
    leaf_quantum = str(spec.mtu + 100)        # the classes': one frame a turn (ETS-like round robin, docstring)
    default = LOSSLESS_CLASS if spec.tcp_in_lossless else TCP_CLASS
    line, burst = spec.line_rate_bps, spec.burst_bytes
    cmds = [
        _tc(netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", default.split(":")[1]),
        _tc(netns, "class", "add", "dev", dev, "parent", "1:", "classid", ROOT_CLASS, "htb",
            "rate", _bits(line), "ceil", _bits(line), "burst", str(burst), "cburst", str(burst), "quantum", quantum),
        _tc(netns, "class", "add", "dev", dev, "parent", ROOT_CLASS, "classid", LOSSLESS_CLASS, "htb",
            *class_params(spec.lossless_rate_bps, line, burst, CLASS_PRIO), "quantum", leaf_quantum),
        _tc(netns, "class", "add", "dev", dev, "parent", ROOT_CLASS, "classid", TCP_CLASS, "htb",
            *class_params(spec.tcp_rate_bps, line, burst, CLASS_PRIO), "quantum", leaf_quantum),
    ]
    for port in spec.lossless_ports:
        for direction in ("dport", "sport"):
            cmds.append(_tc(netns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                            "u32", "match", "ip", direction, str(port), "0xffff", "flowid", LOSSLESS_CLASS))
    return cmds


def clear_command(dev: str, netns: str | None) -> list[str]:
    """Remove the root qdisc (rc != 0 when there is none: run with check=False)."""
    return _tc(netns, "qdisc", "del", "dev", dev, "root")


def show_classes_command(dev: str, netns: str | None) -> list[str]:
    return _tc(netns, "-s", "class", "show", "dev", dev)


def change_class_command(dev: str, netns: str | None, classid: str, rate_bps: float, ceil_bps: float,
                         burst: int, prio: int) -> list[str]:
    return _tc(netns, "class", "change", "dev", dev, "parent", ROOT_CLASS, "classid", classid, "htb",
               *class_params(rate_bps, ceil_bps, burst, prio))


def apply_shaping(ex: Executor, dev: str, netns: str | None, spec: ShapingSpec) -> None:
    """Replace whatever shaping ``dev`` has with ``spec`` (idempotent)."""
    ex.run(clear_command(dev, netns), timeout=TC_TIMEOUT_S, check=False)
    for argv in shaping_commands(dev, netns, spec):
        ex.run(argv, timeout=TC_TIMEOUT_S)


def read_classes(ex: Executor, dev: str, netns: str | None) -> dict[str, TcClass]:
    res = ex.run(show_classes_command(dev, netns), timeout=TC_TIMEOUT_S, check=False)
    if res.rc != 0:
        raise ProbeError(f"cannot read tc classes of {dev}{f' in {netns}' if netns else ''}: {res.stderr.strip()}",
                         fix="check that the device exists and tc (iproute2) is installed")
    return parse_classes(res.stdout)


def require_classes(classes: dict[str, TcClass], dev: str, wanted: Sequence[str] = (ROOT_CLASS, LOSSLESS_CLASS,
                                                                                    TCP_CLASS)) -> None:
    missing = [c for c in wanted if c not in classes]
    if missing:
        raise ProbeError(f"{dev} has no htb class {', '.join(missing)} (found {sorted(classes) or 'none'})",
                         fix="build the fabric with harness.fabric.builder (it installs the htb classes)")

