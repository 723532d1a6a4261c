"""The fabric's line rate, the denominator of checklist item 1 (">= 80 % of line rate").

Read, never assumed: on the bundled fabric from the shaping itself (the htb class that holds the
line rate); on real hosts through the host's executor (local or SSH) from
``/sys/class/net/DEV/speed``, then ``ethtool DEV``, then ``ibstat CA [PORT]`` for RDMA ports
whose netdev reports no speed. The first source that answers wins; each one tried is kept as
evidence for the report.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from harness.errors import ExecutorError, ProbeError
from harness.fabric.shaping import ROOT_CLASS, read_classes
from harness.hosts import Executor

log = logging.getLogger(__name__)

TIMEOUT_S = 15.0
SOURCES = ("tc", "sysfs", "ethtool", "ibstat")


@dataclass(frozen=True)
class LineRate:
    bps: float
    source: str                       # one of SOURCES
    device: str
    host: str
    tried: tuple[str, ...] = field(default_factory=tuple)  # "source: why it gave no answer", in order

    @property
    def bytes_per_s(self) -> float:
        return self.bps / 8

    def to_dict(self) -> dict:
        return {"bps": self.bps, "gbit_per_s": self.bps / 1e9, "source": self.source, "device": self.device,
                "host": self.host, "tried": list(self.tried)}


def _prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def from_tc(ex: Executor, dev: str, netns: str | None = None) -> tuple[float | None, str]:
    """The rate of the htb class that carries the line rate, or None and why not (for ``tried``).
    A ``tc`` that ran and failed is asked once more before the next source is: a shaped port
    read as unshaped would put its sysfs speed (10 Gbit/s on a veth) under item 6.1.1."""
    why = ""
    for _ in range(2):
        try:
            classes = read_classes(ex, dev, netns)
        except ExecutorError as exc:  # not installed (here), or no answer: the other sources may know
            return None, f"tc: {exc}"
        except ProbeError as exc:     # it ran and failed (no such device, or a passing failure)
            why = f"tc: {exc} (twice)"
            continue
        root = classes.get(ROOT_CLASS)
        if root is None:
            return None, f"tc: no htb class {ROOT_CLASS} on {dev} (classes: {', '.join(sorted(classes)) or 'none'})"
        return root.rate_bps, ""
    return None, why


def from_sysfs(ex: Executor, dev: str, netns: str | None = None) -> float | None:
    res = ex.run([*_prefix(netns), "cat", f"/sys/class/net/{dev}/speed"], timeout=TIMEOUT_S, check=False)
    text = res.stdout.strip()
    if res.rc != 0 or not text.lstrip("-").isdigit() or int(text) <= 0:  # -1: unknown (no carrier, virtual)
        return None
    return int(text) * 1e6


def parse_ethtool(text: str) -> float | None:
    """``Speed: 100000Mb/s`` -> 1e11; ``Speed: Unknown!`` -> None."""
    m = re.search(r"^\s*Speed:\s*(\d+)\s*([MG])b/s", text, re.MULTILINE)
    if not m:
        return None
    return int(m.group(1)) * (1e6 if m.group(2) == "M" else 1e9)


def parse_ibstat(text: str) -> float | None:
    """The ``Rate: 200`` line of an Active port (Gb/s); None when no port is Active."""
    for block in re.split(r"\n(?=\s*Port \d+:)", text):
        if re.search(r"State:\s*Active", block):
            m = re.search(r"^\s*Rate:\s*(\d+(?:\.\d+)?)", block, re.MULTILINE)
            if m:
                return float(m.group(1)) * 1e9
    return None


def _tool(ex: Executor, argv: list[str]) -> str | None:
    try:
        res = ex.run(argv, timeout=TIMEOUT_S, check=False)
    except ExecutorError as exc:  # the tool is not installed there
        log.debug("%s: %s", argv[0], exc)
        return None
    return res.stdout if res.rc == 0 else None


def read_line_rate(ex: Executor, dev: str, netns: str | None = None, *, ib_port: int | None = None) -> LineRate:
    """Line rate of ``dev`` on the executor's host, from the first source that knows it."""
    tried: list[str] = []
    rate, why = from_tc(ex, dev, netns)
    if rate:
        return LineRate(rate, "tc", dev, ex.host, tuple(tried))
    tried.append(why)
    rate = from_sysfs(ex, dev, netns)
    if rate:
        return LineRate(rate, "sysfs", dev, ex.host, tuple(tried))
    tried.append(f"sysfs: /sys/class/net/{dev}/speed missing or unknown (-1)")
    out = _tool(ex, [*_prefix(netns), "ethtool", dev])
    rate = parse_ethtool(out) if out else None
    if rate:
        return LineRate(rate, "ethtool", dev, ex.host, tuple(tried))
    tried.append("ethtool: not installed, failed, or no Speed line" if out is None else "ethtool: speed unknown")
    out = _tool(ex, ["ibstat", dev, *([str(ib_port)] if ib_port else [])])
    rate = parse_ibstat(out) if out else None
    if rate:
        return LineRate(rate, "ibstat", dev, ex.host, tuple(tried))
    tried.append("ibstat: not installed, no such CA, or no Active port")
    raise ProbeError(f"cannot read the line rate of {dev} on {ex.host}: " + "; ".join(tried),
                     fix="name the fabric NIC (netdev or RDMA CA) in the cluster file, or install ethtool/ibstat "
                         "on the host; a threshold against an unknown line rate cannot be judged")
