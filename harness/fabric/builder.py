"""The emulated datacenter fabric: one network namespace per host, a fabric and a control bridge.

::

    root namespace                      host namespace pdh-hN
    pdh-fab (bridge, jumbo MTU)  <-- pdh-fN === fab0  198.18.1.(N+1)   fabric NIC: shaped, 2 classes
    pdh-ctl (bridge) 198.18.2.254 <-- pdh-cN === ctl0  198.18.2.(N+1)   control NIC: router, heartbeats

The fabric NIC is shaped in both directions (``fab0`` egress is the host's TX, ``pdh-fN`` egress
towards the host is its RX), so a host's line rate holds for incast too. The router stays in the
root namespace and reaches the workers over the control bridge. Every name starts with the
fabric's prefix (default ``pdh-``), which is how :meth:`Fabric.setup` finds and removes what a
crashed run left behind, and how :func:`leftovers` proves a teardown complete.

    with Fabric(FabricConfig(hosts=3)) as fabric:
        Topology(..., **fabric.topology_kwargs(["prefill-0", "decode-0", "decode-1"]))
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from harness.errors import ConfigError, HarnessError
from harness.fabric.shaping import ShapingSpec, apply_shaping
from harness.hosts import Executor, LocalExecutor
from harness.waiting import wait_until

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "pdh-"
FABRIC_DEV = "fab0"
CONTROL_DEV = "ctl0"
CONTROL_MTU = 1500
EMULATION_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range: never routed
IP_TIMEOUT_S = 10.0
TEARDOWN_TIMEOUT_S = 10.0
SLOT_DIR = Path("/run/harness-fabric")   # one flock per fabric slot, held while the fabric exists
MAX_SLOTS = 8
SKIP_REASON = "skipped: needs root and iproute2"
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,4}-$")


def fabric_unavailable_reason() -> str | None:
    """None when this machine can build the fabric, else why not (the fabric faults' skip reason)."""
    if os.geteuid() != 0:
        return f"{SKIP_REASON} (not running as root)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{SKIP_REASON} ({', '.join(missing)} not found)"
    return None


@dataclass(frozen=True)
class FabricConfig:
    hosts: int = 3
    shaping: ShapingSpec = field(default_factory=ShapingSpec)
    prefix: str = DEFAULT_PREFIX
    fabric_subnet: str = "198.18.1.0/24"
    control_subnet: str = "198.18.2.0/24"

    def __post_init__(self) -> None:
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or not 1 <= self.hosts <= 64:
            raise ConfigError(f"fabric hosts must be an integer in 1..64, got {self.hosts!r}",
                              fix="one host per worker, e.g. 3 for 1 prefill + 2 decode")
        if not _PREFIX_RE.match(self.prefix):
            raise ConfigError(f"fabric prefix {self.prefix!r} must be 1-5 lowercase letters/digits and a '-'",
                              fix="use e.g. 'pdh-' (interface names are limited to 15 characters)")
        nets = []
        for name in ("fabric_subnet", "control_subnet"):
            try:
                net = ipaddress.ip_network(getattr(self, name))
            except ValueError as exc:
                raise ConfigError(f"fabric {name} {getattr(self, name)!r} is not a network: {exc}",
                                  fix="write e.g. 198.18.1.0/24") from None
            if not net.subnet_of(EMULATION_RANGE):  # type: ignore[arg-type]
                raise ConfigError(f"fabric {name} {net} is outside {EMULATION_RANGE}",
                                  fix="the emulated fabric only uses 198.18.0.0/15 (never routed anywhere)")
            if net.num_addresses - 3 < self.hosts:
                raise ConfigError(f"fabric {name} {net} is too small for {self.hosts} hosts", fix="use a /24")
            nets.append(net)
        if nets[0].overlaps(nets[1]):
            raise ConfigError(f"fabric and control subnets overlap ({nets[0]}, {nets[1]})",
                              fix="use separate subnets, e.g. 198.18.1.0/24 and 198.18.2.0/24")

    @property
    def kv_port(self) -> int:
        """The port decode workers listen on for KV (classified into the lossless class)."""
        return self.shaping.lossless_ports[0]

    @property
    def bench_port(self) -> int:
        """A second lossless-class port for KV benches and incast floods (decode workers hold kv_port)."""
        ports = self.shaping.lossless_ports
        return ports[1] if len(ports) > 1 else ports[0]


@dataclass(frozen=True)
class FabricHost:
    index: int
    netns: str
    fabric_ip: str
    control_ip: str
    fabric_port: str   # root-namespace end of the fabric veth (its egress is the host's RX)
    control_port: str
    fabric_dev: str = FABRIC_DEV
    control_dev: str = CONTROL_DEV

    @property
    def name(self) -> str:
        return self.netns

    def exec_prefix(self) -> list[str]:
        """Prefix that runs a command inside this host (``ip netns exec`` execs, so the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns]


class Fabric:
    """Builds, describes and removes the emulated fabric; every command goes through ``executor``."""

    def __init__(self, config: FabricConfig | None = None, executor: Executor | None = None, *,
                 slot_lock: Any = None) -> None:
        self.config = config or FabricConfig()
        self._slot_lock = slot_lock  # an open, flock()ed file: released at teardown
        self.ex = executor or LocalExecutor()
        p = self.config.prefix
        self.fabric_bridge, self.control_bridge = f"{p}fab", f"{p}ctl"
        fab = list(ipaddress.ip_network(self.config.fabric_subnet).hosts())
        ctl = list(ipaddress.ip_network(self.config.control_subnet).hosts())
        self.control_gateway_ip = str(ctl[-1])   # the root namespace (router) on the control bridge
        self.control_prefixlen = ipaddress.ip_network(self.config.control_subnet).prefixlen
        self.fabric_prefixlen = ipaddress.ip_network(self.config.fabric_subnet).prefixlen
        self.hosts = [FabricHost(index=i, netns=f"{p}h{i}", fabric_ip=str(fab[i]), control_ip=str(ctl[i]),
                                 fabric_port=f"{p}f{i}", control_port=f"{p}c{i}") for i in range(self.config.hosts)]

    @classmethod
    def in_free_slot(cls, hosts: int, shaping: ShapingSpec, executor: Executor | None = None) -> Fabric:
        """A fabric in the first slot no live process holds, so two bundled clusters on one machine
        (two test runs) never share or tear down each other's namespaces. Slot 0 is prefix ``pdh-``
        with 198.18.1.0/24 + 198.18.2.0/24; slot N is ``pdhN-`` with 198.18.(4N+1) and (4N+2).
        What a dead holder of the slot left behind is removed by :meth:`setup` (same prefix)."""
        SLOT_DIR.mkdir(parents=True, exist_ok=True)
        for slot in range(MAX_SLOTS):
            lock = open(SLOT_DIR / f"slot-{slot}.lock", "a+")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            config = FabricConfig(hosts=hosts, shaping=shaping, prefix=f"pdh{slot or ''}-",
                                  fabric_subnet=f"198.18.{4 * slot + 1}.0/24",
                                  control_subnet=f"198.18.{4 * slot + 2}.0/24")
            return cls(config, executor, slot_lock=lock)
        raise HarnessError(f"all {MAX_SLOTS} fabric slots are in use on this machine",
                           fix="wait for another harness run to finish, or stop a stale one")

    # -- lifecycle
    def __enter__(self) -> Fabric:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    @property
    def line_rate_bps(self) -> float:
        return self.config.shaping.line_rate_bps

    def setup(self) -> Fabric:
        """Converge to the configured fabric: remove this prefix's strays (a crashed run's, or a
        larger earlier fabric's), create what is missing, and (re)apply addresses and shaping."""
        reason = fabric_unavailable_reason()
        if reason:
            raise HarnessError(f"cannot build the emulated fabric: {reason}",
                               fix="run as root on a machine with iproute2, or use the loopback cluster")
        try:
            self._remove_strays()
            for bridge, mtu in ((self.fabric_bridge, self.config.shaping.mtu), (self.control_bridge, CONTROL_MTU)):
                if bridge not in self._links():
                    self._ip("link", "add", bridge, "type", "bridge")
                self._ip("link", "set", bridge, "mtu", str(mtu), "up")
            self._ip("addr", "replace", f"{self.control_gateway_ip}/{self.control_prefixlen}",
                     "dev", self.control_bridge)
            for host in self.hosts:
                self._setup_host(host)
        except BaseException:
            log.error("fabric setup failed; removing what was built")
            self.teardown()
            raise
        log.info("fabric up: %d hosts, line rate %.3g bit/s, MTU %d", len(self.hosts), self.line_rate_bps,
                 self.config.shaping.mtu)
        return self

    def teardown(self) -> None:
        """Remove every namespace and link with this prefix; raise if any remains."""
        def remove() -> list:
            remove_prefixed(self.ex, self.config.prefix)
            return leftovers(self.ex, self.config.prefix)

        # again every 0.1 s: the kernel destroys a namespace's devices asynchronously
        left = wait_until(remove, TEARDOWN_TIMEOUT_S, 0.1, what=f"the {self.config.prefix}* namespaces and links to go",
                          accept=lambda left: not left, on_timeout="return")
        if not left and self._slot_lock is not None:
            self._slot_lock.close()  # releases the flock: the slot is free for the next run
            self._slot_lock = None
        if left:
            raise HarnessError(f"fabric teardown left {left}",
                               fix="stop the processes still running in those namespaces, then run "
                                   "`ip netns del NAME` / `ip link del NAME` by hand")

    # -- placement of workers
    def host(self, index_or_netns: int | str) -> FabricHost:
        for h in self.hosts:
            if index_or_netns in (h.index, h.netns):
                return h
        raise ConfigError(f"the fabric has no host {index_or_netns!r}",
                          fix=f"use an index below {len(self.hosts)} or one of {[h.netns for h in self.hosts]}")

    def placement(self, worker_ids: Sequence[str]) -> dict[str, FabricHost]:
        """One host per worker, in order."""
        if len(worker_ids) > len(self.hosts):
            raise ConfigError(f"{len(worker_ids)} workers need {len(worker_ids)} fabric hosts; the fabric has "
                              f"{len(self.hosts)}", fix="build the fabric with one host per worker")
        return dict(zip(worker_ids, self.hosts))

    def topology_kwargs(self, worker_ids: Sequence[str]) -> dict[str, Any]:
        """``Topology(**kwargs)`` arguments that run each worker in its host: KV on the fabric NIC
        at the lossless port, heartbeats and the fallback path on the control NIC."""
        from harness.engine.pd.topology import WorkerAddress

        placed = self.placement(worker_ids)

        def prefix(worker_id: str) -> list[str]:
            if worker_id not in placed:
                raise ConfigError(f"worker {worker_id!r} has no host on the fabric",
                                  fix="build the fabric with one host per worker, including added ones")
            return placed[worker_id].exec_prefix()

        return {"worker_cmd_prefix": prefix, "control_host": self.control_gateway_ip,
                "worker_addresses": {wid: WorkerAddress(kv=h.fabric_ip, control=h.control_ip,
                                                        kv_port=self.config.kv_port) for wid, h in placed.items()}}

    def describe(self) -> dict[str, Any]:
        s = self.config.shaping
        return {"prefix": self.config.prefix, "line_rate_bps": s.line_rate_bps, "mtu": s.mtu,
                "lossless_share": s.lossless_share, "lossless_ports": list(s.lossless_ports),
                "tcp_in_lossless": s.tcp_in_lossless, "control_gateway": self.control_gateway_ip,
                "hosts": [{"netns": h.netns, "fabric_ip": h.fabric_ip, "control_ip": h.control_ip,
                           "fabric_dev": h.fabric_dev, "fabric_port": h.fabric_port} for h in self.hosts]}

    # -- internals
    def _ip(self, *args: str, netns: str | None = None, check: bool = True) -> None:
        self.ex.run(["ip", *(["-n", netns] if netns else []), *args], timeout=IP_TIMEOUT_S, check=check)

    def _links(self, netns: str | None = None) -> set[str]:
        return set(list_links(self.ex, netns))

    def _remove_strays(self) -> None:
        p = self.config.prefix
        wanted_ns = {h.netns for h in self.hosts}
        for ns in list_netns(self.ex):
            if ns.startswith(p) and ns not in wanted_ns:
                log.warning("removing stray namespace %s (a previous run's)", ns)
                self.ex.run(["ip", "netns", "del", ns], timeout=IP_TIMEOUT_S, check=False)
        wanted_links = {self.fabric_bridge, self.control_bridge} | {
            port for h in self.hosts for port in (h.fabric_port, h.control_port)}
        for link in self._links():
            if link.startswith(p) and link not in wanted_links:
                log.warning("removing stray link %s (a previous run's)", link)
                self._ip("link", "del", link, check=False)

    def _setup_host(self, h: FabricHost) -> None:
        if h.netns not in list_netns(self.ex):
            self.ex.run(["ip", "netns", "add", h.netns], timeout=IP_TIMEOUT_S)
        self._ip("link", "set", "lo", "up", netns=h.netns)
        mtu = self.config.shaping.mtu
        root_links, ns_links = self._links(), self._links(h.netns)
        nics = ((h.fabric_port, h.fabric_dev, self.fabric_bridge, mtu, h.fabric_ip, self.fabric_prefixlen),
                (h.control_port, h.control_dev, self.control_bridge, CONTROL_MTU, h.control_ip,
                 self.control_prefixlen))
        for port, dev, bridge, link_mtu, ip, prefixlen in nics:
            if port not in root_links or dev not in ns_links:  # half a pair is useless: rebuild it
                self._ip("link", "del", port, check=False)
                self._ip("link", "del", dev, netns=h.netns, check=False)
                self._ip("link", "add", port, "mtu", str(link_mtu), "type", "veth", "peer", "name", dev,
                         "mtu", str(link_mtu), "netns", h.netns)
            self._ip("link", "set", port, "master", bridge, "mtu", str(link_mtu), "up")
            self._ip("link", "set", dev, "mtu", str(link_mtu), "up", netns=h.netns)
            self._ip("addr", "flush", "dev", dev, netns=h.netns)
            self._ip("addr", "add", f"{ip}/{prefixlen}", "dev", dev, netns=h.netns)
        apply_shaping(self.ex, h.fabric_dev, h.netns, self.config.shaping)   # host TX
        apply_shaping(self.ex, h.fabric_port, None, self.config.shaping)     # host RX (switch port egress)


def list_netns(ex: Executor) -> list[str]:
    res = ex.run(["ip", "netns", "list"], timeout=IP_TIMEOUT_S, check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def list_links(ex: Executor, netns: str | None = None) -> list[str]:
    res = ex.run(["ip", *(["-n", netns] if netns else []), "-j", "link", "show"], timeout=IP_TIMEOUT_S, check=False)
    if res.rc != 0:
        return []
    return [link["ifname"] for link in json.loads(res.stdout or "[]")]


def link_state(ex: Executor, dev: str, netns: str | None = None) -> str:
    """The device's operstate (``UP``, ``DOWN``, ``LOWERLAYERDOWN``, ...) as ``ip -j link`` reports it."""
    res = ex.run(["ip", *(["-n", netns] if netns else []), "-j", "link", "show", "dev", dev],
                 timeout=IP_TIMEOUT_S, check=False)
    if res.rc != 0:
        raise HarnessError(f"no device {dev}{f' in namespace {netns}' if netns else ''}: {res.stderr.strip()}",
                           fix="check the device name (is the fabric built?)")
    return str(json.loads(res.stdout)[0].get("operstate", "UNKNOWN"))


def link_sizes(ex: Executor, dev: str, netns: str | None = None) -> tuple[int, int]:
    """The device's (MTU, gso_max_size): the largest packet and the largest segment-offload
    packet its queue can hold, both in bytes."""
    res = ex.run(["ip", *(["-n", netns] if netns else []), "-j", "-d", "link", "show", "dev", dev],
                 timeout=IP_TIMEOUT_S, check=False)
    if res.rc != 0:
        raise HarnessError(f"no device {dev}{f' in namespace {netns}' if netns else ''}: {res.stderr.strip()}",
                           fix="check the device name (is the fabric built?)")
    link = json.loads(res.stdout)[0]
    return int(link.get("mtu", 1500)), int(link.get("gso_max_size", 65536))


def leftovers(ex: Executor | None = None, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Every namespace and root-namespace link whose name starts with ``prefix``."""
    ex = ex or LocalExecutor()
    return ([f"netns {ns}" for ns in list_netns(ex) if ns.startswith(prefix)]
            + [f"link {link}" for link in list_links(ex) if link.startswith(prefix)])


def remove_prefixed(ex: Executor, prefix: str = DEFAULT_PREFIX) -> None:
    """Delete every namespace (its veth ends and their peers go with it) and link with ``prefix``.
    A process still inside a namespace is killed first: `ip netns del` only drops the name, and the
    namespace lives on as long as any process holds it (an sshd session whose client went away with
    the link waits forever for a FIN that cannot come: three were found holding deleted namespaces
    after a CI run)."""
    for ns in list_netns(ex):
        if ns.startswith(prefix):
            stop_processes_in(ex, ns)
            ex.run(["ip", "netns", "del", ns], timeout=IP_TIMEOUT_S, check=False)
    for link in list_links(ex):
        if link.startswith(prefix):
            ex.run(["ip", "link", "del", link], timeout=IP_TIMEOUT_S, check=False)


def stop_processes_in(ex: Executor, netns: str) -> list[int]:
    """SIGKILL every process still in ``netns`` (``ip netns pids``); returns their pids. Only the
    fabric's own namespaces are passed here: whatever still runs in one at teardown is left over."""
    res = ex.run(["ip", "netns", "pids", netns], timeout=IP_TIMEOUT_S, check=False)
    pids = [int(p) for p in res.stdout.split() if p.isdigit()]
    if pids:
        log.warning("namespace %s still holds process(es) %s at teardown: killed", netns, pids)
        ex.run(["kill", "-9", *map(str, pids)], timeout=IP_TIMEOUT_S, check=False)
    return pids

