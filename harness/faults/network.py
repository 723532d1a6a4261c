"""Fabric faults: NIC port flapping and PFC congestion (a pause storm) on the lossless class.

Both run their pattern as one small shell loop on the target host (harness/faults/host_loop.py; through the host's executor,
so the same fault works on a bundled fabric namespace and over SSH). The loop always ends in the
healthy state (link up, class restored), stops early when its stop file appears, and removes
its pid file when it exits; a revert touches the stop file, waits for the loop to be gone, then
restores once more (idempotent). On a remote host, a NIC flap first arms an on-host timer that
brings the link up by itself, because taking a NIC down can cut the SSH link that would revert it.

    with runner.active(NicFlap.on_fabric_host(fabric.host(1), period_s=1, duty=0.5, count=3)) as flap:
        flap.wait_done(executor)                 # flaps end; the engine keeps serving meanwhile
    with runner.active(PfcStorm.on_fabric_hosts([fabric.host(1)], pause_ms=300, resume_ms=100, bursts=20)):
        ...                                      # measure the TCP class while the lossless class pauses
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from harness.errors import ConfigError, FaultError
from harness.fabric.builder import fabric_unavailable_reason, link_sizes, link_state
from harness.fabric.shaping import LOSSLESS_CLASS, PAUSE_RATE_BPS, change_class_command, read_classes
from harness.faults.base import Fault, no_ledger
from harness.faults.host_loop import COMMAND_TIMEOUT_S, STATE_DIR, HostLoop
from harness.ids import new_fault_id
from harness.hosts import Executor, LocalExecutor, describe_command

log = logging.getLogger(__name__)

POLL_S = 0.02
PAUSE_DEBT_S = 0.01   # a paused class lets one packet through now and then: at most this much of a resume it costs


def _require_tools(ex: Executor, kind: str) -> None:
    """On this machine, say plainly that the fault needs root and iproute2 (a remote host's own
    permissions show in its commands' errors)."""
    reason = fabric_unavailable_reason() if isinstance(ex, LocalExecutor) else None
    if reason:
        raise FaultError(f"{kind}: {reason}", fix="run the harness as root on a machine with iproute2")


def _gone(ex: Executor, device: str, netns: str | None) -> bool:
    """The device (or its namespace) no longer exists: its fabric was torn down since the fault,
    so there is nothing left to restore (a revert from the ledger after a crash, say)."""
    return ex.run(_ip(netns, "link", "show", "dev", device), timeout=COMMAND_TIMEOUT_S, check=False).rc != 0


def _ip(netns: str | None, *args: str) -> list[str]:
    return ["ip", *(["-n", netns] if netns else []), *args]


def _where(device: str, netns: str | None) -> str:
    return f"{device}{f' in {netns}' if netns else ''}"


@dataclass
class NicFlap(Fault):
    """Take a NIC down and up ``count`` times: down ``duty * period_s``, then up for the rest."""

    kind: ClassVar[str] = "nic_flap"

    device: str = "fab0"
    netns: str | None = None           # the host's namespace on the bundled fabric; None on a real host
    host: str = "localhost"
    period_s: float = 1.0
    duty: float = 0.5                  # fraction of each period the link is down
    count: int = 3
    safety_timer_s: float | None = None  # remote hosts: the on-host timer that brings the link up
    fault_id: str = field(default_factory=new_fault_id)
    _loop: Any = no_ledger(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.device:
            raise ConfigError("nic_flap needs a device", fix="name the fabric NIC, e.g. fab0 or eth1")
        if not 0.05 <= self.period_s <= 600 or not 0.05 <= self.duty <= 0.95:
            raise ConfigError(f"nic_flap period_s {self.period_s} / duty {self.duty} out of range",
                              fix="use period_s in 0.05..600 and duty in 0.05..0.95")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or not 1 <= self.count <= 1000:
            raise ConfigError(f"nic_flap count must be an integer in 1..1000, got {self.count!r}",
                              fix="pass e.g. count=3")
        if self.safety_timer_s is None:
            self.safety_timer_s = self.count * self.period_s + 30.0
        self._loop = HostLoop(self.fault_id, [self._set("down")], [self._set("up")], self.count,
                               self.period_s * self.duty, self.period_s * (1 - self.duty))

    @classmethod
    def on_fabric_host(cls, fabric_host: Any, **kwargs: Any) -> NicFlap:
        """Flap the fabric NIC of a bundled-fabric host (a FabricHost)."""
        return cls(device=fabric_host.fabric_dev, netns=fabric_host.netns, **kwargs)

    @property
    def target(self) -> str:
        return f"{_where(self.device, self.netns)} @ {self.host}"

    def _set(self, state: str) -> list[str]:
        return _ip(self.netns, "link", "set", "dev", self.device, state)

    def _safety_argv(self) -> list[str]:
        return ["sh", "-c", f"(sleep {self.safety_timer_s:g}; {shlex.join(self._set('up'))}) "
                            ">/dev/null 2>&1 </dev/null &"]

    def prepare(self, ex: Executor) -> str:
        _require_tools(ex, self.kind)
        state = link_state(ex, self.device, self.netns)
        if state != "UP":
            raise FaultError(f"nic_flap: {self.target} is {state}, not UP, before the fault",
                             fix="bring the link up (or fix the fabric) before flapping it")
        return f"{self.target} is UP"

    def inject(self, ex: Executor) -> str:
        armed = ""
        if not isinstance(ex, LocalExecutor):  # a NIC down can cut our SSH link: the host reverts alone
            ex.run(self._safety_argv(), timeout=COMMAND_TIMEOUT_S)
            armed = f"; on-host timer brings it up after {self.safety_timer_s:g} s"
        self._loop.start(ex)
        return (f"flapping {self.target}: {self.count} x (down {self._loop.on_s:g} s, up {self._loop.off_s:g} s)"
                f"{armed}")

    def verify(self, ex: Executor) -> str:
        t0 = time.monotonic()
        deadline = t0 + self.period_s * 2 + 5
        while time.monotonic() < deadline:
            state = link_state(ex, self.device, self.netns)
            if state != "UP":
                return f"{self.target} operstate {state} {time.monotonic() - t0:.2f} s after the flap started"
            if not self._loop.running() and self._loop.result is not None:
                break
            time.sleep(POLL_S)  # polling operstate while the loop takes the link down
        raise FaultError(f"nic_flap: {self.target} never left operstate UP "
                         f"({self._loop.result.stderr.strip() if self._loop.result else 'loop running'})",
                         fix="check that `ip link set dev X down` works on the host (root, right namespace)")

    def wait_done(self, ex: Executor, timeout_s: float | None = None) -> list[tuple[str, float]]:
        """Block until the flaps ran their course; returns the ("on"=down / "off"=up, wall time) transitions."""
        if not self._loop.wait(timeout_s if timeout_s is not None else self._loop.duration_s + 30):
            raise FaultError(f"nic_flap on {self.target} did not finish its {self.count} flaps in time",
                             fix="check the host's load")
        return self._loop.transitions(ex)

    def revert(self, ex: Executor) -> str:
        if _gone(ex, self.device, self.netns):
            return f"{self.target}: {self._loop.stop(ex, restore=False)}; the device is gone, nothing to bring up"
        return f"{self.target}: {self._loop.stop(ex)} (link up)"

    def verify_reverted(self, ex: Executor) -> str:
        if _gone(ex, self.device, self.netns):
            return f"{self.target} no longer exists; nothing is down"
        deadline = time.monotonic() + 10
        while (state := link_state(ex, self.device, self.netns)) != "UP":
            if time.monotonic() > deadline:
                raise FaultError(f"nic_flap: {self.target} is {state} 10 s after the revert",
                                 fix=f"bring it up by hand: {shlex.join(self._set('up'))} on {self.host}")
            time.sleep(0.05)  # carrier comes back asynchronously
        return f"{self.target} operstate UP"

    def plan(self) -> list[str]:
        state = shlex.join(_ip(self.netns, "-j", "link", "show", "dev", self.device))
        return [
            f"prepare: {self.host}$ {state}  # refuse unless operstate is UP",
            f"inject: {describe_command(self.host, self._safety_argv())}  # remote hosts only",
            f"inject: {describe_command(self.host, self._loop.argv())}",
            f"verify: {self.host}$ {state}  # poll until operstate is not UP",
            f"revert: {self.host}$ touch {self._loop.stop_file}; wait for {self._loop.pid_file} to vanish; "
            f"{shlex.join(self._set('up'))}",
            f"verify_reverted: {self.host}$ {state}  # poll until operstate is UP, up to 10 s",
        ]


@dataclass
class PfcStorm(Fault):
    """Pause the lossless class on one or more fabric NICs in bursts (pause ``pause_ms``, resume
    ``resume_ms``, ``bursts`` times): the class's rate drops to ``pause_rate_bps`` as if the port
    kept receiving PFC pause frames for that priority. Other classes are untouched.

    htb keeps a paused class's token debt across ``tc class change`` (docs/fabric.md: at 8 kbit/s
    one 64 KB packet blocked the resumes for 60 s), so the pause rate lets one MTU cost at most
    PAUSE_DEBT_S and the NIC's ``gso_max_size`` is its MTU while the storm lasts (reverted). With ``group``
    > 0 the bursts come in groups of ``group`` with ``gap_ms`` of calm between groups, so that a
    probe can compare the storm with calm periods interleaved with it (:meth:`spans`)."""

    kind: ClassVar[str] = "pfc_storm"

    nics: list[list[Any]] = field(default_factory=list)   # [[netns or None, device], ...]
    host: str = "localhost"
    classid: str = LOSSLESS_CLASS
    pause_ms: float = 300.0
    resume_ms: float = 100.0
    bursts: int = 20
    pause_rate_bps: float = PAUSE_RATE_BPS
    group: int = 0          # bursts per group (0: one storm, no calm gaps)
    gap_ms: float = 0.0     # calm between groups
    saved: dict[str, list[float]] = field(default_factory=dict)  # "netns/dev" -> [rate, ceil, burst, prio, mtu, gso]
    fault_id: str = field(default_factory=new_fault_id)
    _loop: Any = no_ledger(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.nics or any(len(n) != 2 or not n[1] for n in self.nics):
            raise ConfigError(f"pfc_storm needs [[netns or null, device], ...], got {self.nics!r}",
                              fix="name at least one fabric NIC")
        if not 1 <= self.pause_ms <= 60000 or not 0 <= self.resume_ms <= 60000:
            raise ConfigError(f"pfc_storm pause_ms {self.pause_ms} / resume_ms {self.resume_ms} out of range",
                              fix="use pause_ms in 1..60000 and resume_ms in 0..60000")
        if isinstance(self.bursts, bool) or not isinstance(self.bursts, int) or not 1 <= self.bursts <= 100000:
            raise ConfigError(f"pfc_storm bursts must be an integer >= 1, got {self.bursts!r}", fix="pass e.g. 20")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 0 \
                or (self.group and not self.resume_ms <= self.gap_ms <= 600000):
            raise ConfigError(f"pfc_storm group {self.group!r} / gap_ms {self.gap_ms} out of range",
                              fix="use group 0 (no gaps), or group >= 1 with gap_ms in resume_ms..600000")
        if self.saved:
            self._build_loop()

    @classmethod
    def on_fabric_hosts(cls, fabric_hosts: Sequence[Any], **kwargs: Any) -> PfcStorm:
        """Storm the fabric NICs (host TX side) of bundled-fabric hosts (FabricHosts)."""
        return cls(nics=[[h.netns, h.fabric_dev] for h in fabric_hosts], **kwargs)

    @property
    def target(self) -> str:
        return f"class {self.classid} on {', '.join(_where(d, n) for n, d in self.nics)} @ {self.host}"

    @staticmethod
    def _key(netns: str | None, dev: str) -> str:
        return f"{netns or ''}/{dev}"

    def rate_when_paused(self, netns: str | None, dev: str) -> float:
        saved = self.saved[self._key(netns, dev)]
        mtu = saved[4] if len(saved) > 4 else 1500
        return max(self.pause_rate_bps, 8 * mtu / PAUSE_DEBT_S)

    def _gso(self, netns: str | None, dev: str, size: float) -> list[str]:
        return _ip(netns, "link", "set", "dev", dev, "gso_max_size", str(int(size)))

    def _pause(self) -> list[list[str]]:
        return [change_class_command(dev, ns, self.classid, self.rate_when_paused(ns, dev),
                                     self.rate_when_paused(ns, dev), 1600, int(self.saved[self._key(ns, dev)][3]))
                for ns, dev in self.nics]

    def _restore(self) -> list[list[str]]:
        return self._restore_for(self.nics)

    def _restore_for(self, nics: Sequence[Sequence[Any]]) -> list[list[str]]:
        out = []
        for ns, dev in nics:
            rate, ceil, burst, prio = self.saved[self._key(ns, dev)][:4]
            out.append(change_class_command(dev, ns, self.classid, rate, ceil, int(burst), int(prio)))
        return out

    def _build_loop(self) -> None:
        self._loop = HostLoop(self.fault_id, self._pause(), self._restore(), self.bursts,
                               self.pause_ms / 1000, self.resume_ms / 1000, group=self.group, gap_s=self.gap_ms / 1000)

    def prepare(self, ex: Executor) -> str:
        _require_tools(ex, self.kind)
        for ns, dev in self.nics:
            classes = read_classes(ex, dev, ns)
            cls = classes.get(self.classid)
            if cls is None:
                raise FaultError(f"pfc_storm: {_where(dev, ns)} has no class {self.classid} "
                                 f"(found {sorted(classes) or 'none'})",
                                 fix="storm a NIC shaped by harness.fabric (or name its lossless class)")
            mtu, gso = link_sizes(ex, dev, ns)
            if cls.rate_bps <= max(self.pause_rate_bps, 8 * mtu / PAUSE_DEBT_S) * 2:
                raise FaultError(f"pfc_storm: class {self.classid} on {_where(dev, ns)} is already paused, or too "
                                 f"slow for a pause to show ({cls.rate_bps:g} bit/s; a pause runs at "
                                 f"{max(self.pause_rate_bps, 8 * mtu / PAUSE_DEBT_S):g})",
                                 fix="revert the earlier storm (harness revert), or name a class twice that fast")
            self.saved[self._key(ns, dev)] = [cls.rate_bps, cls.ceil_bps, cls.burst_bytes, cls.prio or 0, mtu, gso]
        self._build_loop()
        return "saved " + ", ".join(f"{k}: rate {v[0]:g} ceil {v[1]:g} mtu {v[4]:g} gso_max_size {v[5]:g}"
                                    for k, v in self.saved.items())

    def inject(self, ex: Executor) -> str:
        for ns, dev in self.nics:   # one MTU per queued packet: see the class docstring
            ex.run(self._gso(ns, dev, self.saved[self._key(ns, dev)][4]), timeout=COMMAND_TIMEOUT_S)
        self._loop.start(ex)
        groups = f", in groups of {self.group} with {self.gap_ms:g} ms calm between" if self.group else ""
        rates = sorted({self.rate_when_paused(ns, dev) for ns, dev in self.nics})
        return (f"pausing {self.target}: {self.bursts} x (pause {self.pause_ms:g} ms at "
                f"{'/'.join(f'{r:g}' for r in rates)} bit/s, resume {self.resume_ms:g} ms){groups}; "
                "gso_max_size = MTU while it lasts")

    def running(self) -> bool:
        """The pause bursts are still going: the loop inject() started has not ended (all its bursts
        done, stopped, or failed). A measurement "during the storm" must end while this holds."""
        return self._loop is not None and self._loop.running()

    def spans(self, ex: Executor) -> list[tuple[float, float]]:
        """(first pause, last resume) host wall times of each group of bursts so far (one span without
        groups); the group under way has no end yet (inf), one cut short ends at its last transition."""
        out: list[tuple[float, float]] = []
        first = last = None
        n = 0
        for what, t in self._loop.transitions(ex) if self._loop is not None else []:
            if what == "on" and first is None:
                first = t
            last = t
            if what == "off":
                n += 1
                if self.group and n % self.group == 0:
                    out.append((first, t))
                    first = None
        if first is not None and last is not None:
            out.append((first, float("inf") if self.running() else last))
        return out

    def counters(self, ex: Executor) -> dict[str, dict[str, float]]:
        """Per NIC: the lossless class's rate, bytes sent, overlimits, drops and backlog now."""
        out = {}
        for ns, dev in self.nics:
            c = read_classes(ex, dev, ns).get(self.classid)
            if c is not None:
                out[self._key(ns, dev)] = {"rate_bps": c.rate_bps, "sent_bytes": c.sent_bytes,
                                           "overlimits": c.overlimits, "dropped": c.dropped,
                                           "backlog_bytes": c.backlog_bytes}
        return out

    def verify(self, ex: Executor) -> str:
        t0 = time.monotonic()
        deadline = t0 + (self.pause_ms + self.resume_ms) / 1000 * 2 + 5
        paused: set[str] = set()
        while time.monotonic() < deadline and len(paused) < len(self.nics):
            now = self.counters(ex)
            for ns, dev in self.nics:
                c = now.get(self._key(ns, dev))
                if c is not None and c["rate_bps"] <= self.rate_when_paused(ns, dev) * 1.01:
                    paused.add(self._key(ns, dev))
            time.sleep(POLL_S)  # polling tc while the loop changes the class
        if len(paused) < len(self.nics):
            missing = [self._key(n, d) for n, d in self.nics if self._key(n, d) not in paused]
            raise FaultError(f"pfc_storm: class {self.classid} was never seen paused on {missing}",
                             fix="check that `tc class change` works on the host (root, right namespace)")
        for ns, dev in self.nics:   # every queued packet one MTU at most, or a pause blocks the resumes after it
            mtu, gso = link_sizes(ex, dev, ns)
            if gso > mtu:
                raise FaultError(f"pfc_storm: {_where(dev, ns)} kept gso_max_size {gso} > MTU {mtu}: a paused "
                                 "class would stay blocked through its resumes",
                                 fix=f"check that `{shlex.join(self._gso(ns, dev, mtu))}` works on the host")
        return (f"class {self.classid} seen paused on {len(paused)} NIC(s) after {time.monotonic() - t0:.2f} s; "
                "gso_max_size = MTU on each")

    def wait_done(self, ex: Executor, timeout_s: float | None = None) -> list[tuple[str, float]]:
        """Block until every burst ran; returns the ("on"=pause / "off"=resume, wall time) transitions."""
        if not self._loop.wait(timeout_s if timeout_s is not None else self._loop.duration_s + 30):
            raise FaultError(f"pfc_storm on {self.target} did not finish its bursts in time", fix="check the load")
        return self._loop.transitions(ex)

    def revert(self, ex: Executor) -> str:
        if self._loop is None:
            return "nothing saved, nothing was changed"
        present = [(ns, dev) for ns, dev in self.nics if not _gone(ex, dev, ns)]
        stopped = self._loop.stop(ex, restore=False)
        for argv in self._restore_for(present):
            ex.run(argv, timeout=COMMAND_TIMEOUT_S)
        for ns, dev in present:
            if len(saved := self.saved[self._key(ns, dev)]) > 5:
                ex.run(self._gso(ns, dev, saved[5]), timeout=COMMAND_TIMEOUT_S)
        gone = len(self.nics) - len(present)
        return (f"{self.target}: {stopped}; class parameters put back on {len(present)} NIC(s)"
                + (f"; {gone} NIC(s) gone" if gone else ""))

    def verify_reverted(self, ex: Executor) -> str:
        for ns, dev in self.nics:
            if _gone(ex, dev, ns):
                continue
            c = read_classes(ex, dev, ns).get(self.classid)
            saved = self.saved[self._key(ns, dev)]
            rate, ceil = saved[:2]
            if len(saved) > 5 and (gso := link_sizes(ex, dev, ns)[1]) != int(saved[5]):
                raise FaultError(f"pfc_storm: {_where(dev, ns)} has gso_max_size {gso}, expected {int(saved[5])}",
                                 fix=f"put it back: {shlex.join(self._gso(ns, dev, saved[5]))}")
            if c is None or abs(c.rate_bps - rate) > rate * 0.01 or abs(c.ceil_bps - ceil) > ceil * 0.01:
                raise FaultError(f"pfc_storm: class {self.classid} on {_where(dev, ns)} is "
                                 f"{'gone' if c is None else f'rate {c.rate_bps:g} ceil {c.ceil_bps:g}'}, "
                                 f"expected rate {rate:g} ceil {ceil:g}",
                                 fix="restore it by hand with `tc class change` (see the fault's plan)")
        return f"class {self.classid} restored on {len(self.nics)} NIC(s)"

    def plan(self) -> list[str]:
        shows = [f"tc{f' -n {ns}' if ns else ''} -s class show dev {dev}" for ns, dev in self.nics]
        lines = [f"prepare: {self.host}$ {s}  # save rate/ceil/burst/prio of {self.classid}" for s in shows]
        if self._loop is not None:
            lines.append(f"inject: {describe_command(self.host, self._loop.argv())}")
        else:
            groups = f" in groups of {self.group}, {self.gap_ms:g} ms calm between" if self.group else ""
            lines.append(f"inject: {self.host}$ sh -c '<{self.bursts} x pause {self.pause_ms:g} ms / resume "
                         f"{self.resume_ms:g} ms of {self.classid}{groups} with tc class change>'")
        lines[len(shows):len(shows)] = [
            f"inject: {self.host}$ {shlex.join(_ip(ns, 'link', 'set', 'dev', dev, 'gso_max_size'))} "
            f"{int(self.saved[self._key(ns, dev)][4]) if self._key(ns, dev) in self.saved else '<MTU>'}"
            for ns, dev in self.nics]
        lines += [f"verify: {self.host}$ {s}  # poll until the rate is the pause rate (8 x MTU / "
                  f"{PAUSE_DEBT_S:g} s bit/s, at least {self.pause_rate_bps:g})" for s in shows]
        lines.append(f"revert: {self.host}$ touch {STATE_DIR}/{self.fault_id}.stop; wait for the loop to exit; "
                     "tc class change back to the saved parameters; ip link set ... gso_max_size <saved>")
        lines += [f"verify_reverted: {self.host}$ {s}  # rate and ceil equal the saved ones" for s in shows]
        return lines
