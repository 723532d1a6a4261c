"""``python -m clusters.vllm.launch pd-nixl``: vLLM prefill and decode on two emulated hosts, KV over NIXL.

Each instance runs in its own network namespace of an emulated fabric (harness/fabric/builder.py, as
``harness sshd-test`` builds it: prefix ``pvn-``, fabric 198.18.31.0/24 on a shaped ``fab0`` with a
lossless and a TCP class, control 198.18.32.0/24, an OpenSSH server on each host's control address).
vLLM's ``NixlConnector`` moves the prompt's KV from prefill to decode with NIXL's UCX backend over TCP
through the hosts' ``fab0`` links: the KV crosses the shaped link in the lossless class, where the
fabric faults (PFC storm, NIC flap) act on it. vllm-router (PD mode, ``--kv-connector nixl``) stays in
the root namespace and reaches the instances over the control bridge. Needs root and iproute2, and
the project's Python (this module imports harness; the rest of the launcher is standard library).

The UCX settings that make the KV take the fabric (measured here, 2026-12-06):

- ``UCX_TLS=tcp,self``: with ``sm`` allowed, UCX sees both processes on one machine and moves the KV
  through shared memory, across namespaces, bypassing the link entirely (6.5 MB of KV moved, 1.8 KB
  crossed ``fab0``). Without it the link's lossless class carried 6.56 MB for NIXL's 6.49 MB.
- ``UCX_NET_DEVICES=fab0``: the fabric NIC, never the control one.
- ``UCX_TCP_PORT_RANGE``: UCX's TCP listeners take ports of the lossless class. With a two-port range
  (7471-7472) vLLM's NIXL worker hung at start-up (no free port for its listeners, retried forever);
  the fabric here classifies 7471-7486 as lossless and UCX takes 7473-7486, leaving 7471/7472 to the
  harness's own KV bench and incast floods (6.1.1, 6.1.5).
- NIXL's side channel (the handshake that exchanges agent metadata) listens on each instance's fabric
  address (``VLLM_NIXL_SIDE_CHANNEL_HOST``), ports 5611 (prefill) and 5612 (decode): TCP class.

vLLM's NIXL worker on CPU pins its own model thread to the last core of each NUMA node ("reserve
different cores for start_load_kv() from model_forward()", ``os.sched_setaffinity`` in
``nixl/base_worker.py``), whatever ``VLLM_CPU_OMP_THREADS_BIND`` says: on a one-node machine both
instances' models then share one core (measured here: ``prefill-0::Worker`` and ``decode-0::Worker``
at ``Cpus_allowed_list: 1``, every other thread 0-1). The supervisor gives their threads every CPU back
once they are up and after every restart (``clusters.supervise.unpin_groups``; logged per thread).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from clusters.supervise import Instance, LaunchError, Supervisor, log, unpin_groups
from clusters.vllm.nixl_errors import START_MARK, classify, last_error_line, message

PREFIX = "pvn-"
FABRIC_SUBNET, CONTROL_SUBNET = "198.18.31.0/24", "198.18.32.0/24"
LINE_RATE_BPS = 1e9
LOSSLESS_PORTS = tuple(range(7471, 7487))   # 7471/7472: the harness's KV bench; 7473-7486: UCX
UCX_PORT_RANGE = "7473-7486"
SIDE_CHANNEL_PORTS = {"prefill-0": 5611, "decode-0": 5612}
ROLES = {"prefill-0": "kv_producer", "decode-0": "kv_consumer"}


UCX_TLS = "tcp,self"
UNPIN_EVERY_S = 5.0   # how often supervision looks for pinned threads (a /proc scan)


def ucx_env(fabric_ip: str, name: str, tls: str = UCX_TLS) -> dict[str, str]:
    """What one instance needs for its KV to cross its host's fabric link (the module doc says why);
    ``tls``: the launcher's ``--ucx-tls`` (UCX must be given ``tcp``: the fabric is a TCP link)."""
    return {"UCX_TLS": tls, "UCX_NET_DEVICES": "fab0", "UCX_TCP_PORT_RANGE": UCX_PORT_RANGE,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": fabric_ip, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(SIDE_CHANNEL_PORTS[name])}


def kv_transfer_config(name: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": ROLES[name], "kv_buffer_device": "cpu"}


class Hosts:
    """The two emulated hosts with an sshd each (harness.fabric.sshdtest.SshdTest), keys under
    ``state_dir/sshd-test/``; built by :meth:`start`, removed by :meth:`stop` (namespaces, links,
    sshds and any process still in a namespace)."""

    def __init__(self, state_dir: Path) -> None:
        from harness.errors import HarnessError
        from harness.fabric.builder import fabric_unavailable_reason

        if reason := fabric_unavailable_reason():
            raise LaunchError(f"pd-nixl builds two emulated hosts: {reason}; run the launcher as root")
        from harness.fabric.sshdtest import SshdTest

        try:
            self.sshd = SshdTest(state_dir, hosts=2, prefix=PREFIX, fabric_subnet=FABRIC_SUBNET,
                                 control_subnet=CONTROL_SUBNET, line_rate_bps=LINE_RATE_BPS,
                                 lossless_ports=LOSSLESS_PORTS)
        except HarnessError as exc:
            raise LaunchError(f"pd-nixl: {exc} ({exc.fix})") from None
        self.state_dir = state_dir

    def start(self) -> None:
        from harness.errors import HarnessError

        try:   # a half-built host is removed by stop(), which serve() calls on every exit path
            self.sshd.start()
        except HarnessError as exc:
            raise LaunchError(f"pd-nixl hosts: {exc} ({exc.fix})") from None

    def stop(self) -> None:
        from harness.errors import HarnessError

        try:
            self.sshd.stop()
        except HarnessError as exc:   # logged, never a traceback; `python -m harness fabric down --force` removes it
            log(f"error: pd-nixl hosts not fully removed: {exc} ({exc.fix})")

    @property
    def hosts(self) -> list[Any]:
        return self.sshd.fabric.hosts

    def describe(self) -> dict[str, Any]:
        return {"hosts": {f"nx-h{h.index}": {"netns": h.netns, "fabric_ip": h.fabric_ip, "control_ip": h.control_ip}
                          for h in self.hosts},
                "ssh": {"key_file": str(self.sshd.key), "known_hosts": str(self.sshd.known_hosts)},
                "fabric": {"line_rate_bps": LINE_RATE_BPS, "lossless_ports": list(LOSSLESS_PORTS),
                           "ucx_port_range": UCX_PORT_RANGE}}


class HostedSupervisor(Supervisor):
    """A Supervisor whose instances live on :class:`Hosts`: the hosts come up before the instances and
    go after them, on every exit path (serve() stops what it registered). While the instances start it
    reads their logs for a known NIXL/UCX failure (clusters/vllm/nixl_errors.py) and stops with that one
    named error: one (a side-channel port taken) never makes vLLM exit, the others would otherwise read
    "exited with code 1: see the log" over 80 lines of traceback."""

    def __init__(self, hosts: Hosts, instances: list[Instance], router: Instance, startup_timeout_s: float) -> None:
        super().__init__(instances, router, startup_timeout_s)
        self.hosts = hosts
        self._log_from: dict[str, int] = {}
        self._next_unpin = 0.0

    def start(self) -> None:
        self.hosts.start()
        super().start()
        self.unpin()

    def tick(self) -> None:
        super().tick()
        if time.monotonic() >= self._next_unpin:  # a restarted worker pins itself again while it starts
            self._next_unpin = time.monotonic() + UNPIN_EVERY_S
            self.unpin()

    def unpin(self) -> None:
        """Undo vLLM's NIXL pinning of the instances' threads (the module's docstring)."""
        for line in unpin_groups({i.popen.pid for i in self.instances if i.popen is not None}):
            log(f"unpinned {line}")

    def stop(self) -> None:   # serve() ignores SIGTERM/SIGINT from here on: the namespaces always go
        try:
            super().stop()
        finally:
            self.hosts.stop()

    def context(self, inst: Instance) -> dict[str, str]:
        """What a fix names for ``inst``: its host, namespace, side-channel port, UCX_TLS, venv, peer."""
        i = self.instances.index(inst)
        h, peer = self.hosts.hosts[i], self.hosts.hosts[1 - i]
        other = self.instances[1 - i].name
        python = next((a for a in inst.argv if a.endswith("/bin/python")), "")
        return {"host": f"nx-h{h.index}", "netns": h.netns, "side_port": str(SIDE_CHANNEL_PORTS[inst.name]),
                "ucx_tls": inst.env.get("UCX_TLS", "?"), "venv": str(Path(python).parent.parent) if python else "?",
                "peer": f"{peer.fabric_ip}:{SIDE_CHANNEL_PORTS[other]}", "peer_ip": peer.fabric_ip}

    def log_since_start(self, inst: Instance) -> str:
        """``inst``'s log from its last start mark on (the log is appended to across runs and restarts)."""
        try:
            with open(inst.log_path, "rb") as f:
                if inst.name not in self._log_from:
                    data = f.read()
                    self._log_from[inst.name] = max(data.rfind(START_MARK.encode()), 0)
                    return data[self._log_from[inst.name]:].decode(errors="replace")
                f.seek(self._log_from[inst.name])
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def named_failure(self, inst: Instance) -> str | None:
        """The launcher's one error for a known NIXL/UCX failure in ``inst``'s log, or None."""
        if inst not in self.instances:
            return None
        failure = classify(self.log_since_start(inst), **self.context(inst))
        return message(inst.name, failure, inst.log_path) if failure else None

    def starting_failure(self, p: Instance) -> str | None:
        return self.named_failure(p)

    def exit_detail(self, p: Instance) -> str:
        last = last_error_line(self.log_since_start(p))
        return f"; its last error: \"{last}\"" if last else ""

    def wait_healthy(self, procs: list[Instance]) -> None:
        """As Supervisor.wait_healthy, and a known NIXL/UCX failure in a starting instance's log stops
        the start at once, named (an exited instance's log is read once more for its last error line)."""
        self._log_from = {k: v for k, v in self._log_from.items() if k not in {p.name for p in procs}}
        super().wait_healthy(procs)


WARMUP_TRIES = 3


XFERS = "vllm:nixl_xfer_time_seconds_count"


def nixl_transfers(metrics_url: str) -> float:
    """decode's count of NIXL transfers (``vllm:nixl_xfer_time_seconds_count``, summed over its labels)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(XFERS + "{") or line.startswith(XFERS + " "))


def warm_up(api: str, model: str, decode_log: Path, decode_metrics: str, tries: int = WARMUP_TRIES,
            explain: Any = None) -> dict[str, Any]:
    """One completion through the router until one succeeds and decode's NIXL transfer count rose (at
    most ``tries``): its KV crossed the fabric, so NIXL's handshake between the two instances is done
    before READY. vLLM gives that first handshake 5 s (``_nixl_handshake``'s receive timeout) and fails
    the request when it runs out (seen here once under the test machine's load:
    "handshake_setup_failed", HTTP 500); a later request handshakes again. Returns what happened;
    raises LaunchError when every try failed: ``explain()`` (HostedSupervisor.named_failure of decode)
    names the handshake failure decode's log shows, when it shows one."""
    import json
    import urllib.error
    import urllib.request

    errors = []
    for k in range(1, tries + 1):
        body = json.dumps({"model": model, "prompt": "warm-up " + "the quick brown fox jumps " * 20,
                           "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{api}/v1/completions", data=body, headers={"content-type": "application/json"})
        t0 = time.monotonic()
        try:
            before = nixl_transfers(decode_metrics)
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
            moved = nixl_transfers(decode_metrics) - before
            if moved < 1:   # served, but decode computed the prompt itself: no KV crossed
                raise OSError(f"served with no NIXL transfer on decode ({XFERS} rose by {moved:g})")
            log(f"warm-up request {k}: KV moved prefill -> decode over NIXL in {time.monotonic() - t0:.1f} s")
            return {"tries": k, "errors": errors, "nixl_transfers": moved}
        except (urllib.error.URLError, OSError, ValueError) as exc:
            errors.append(f"try {k}: {exc}")
            log(f"warm-up request {k} failed ({exc}); {'again' if k < tries else 'giving up'}")
            time.sleep(2.0)
    named = explain() if explain is not None else None
    if named:
        raise LaunchError(f"{named} (warm-up: no request crossed prefill -> decode in {tries} tries)")
    raise LaunchError(f"no request crossed prefill -> decode in {tries} tries ({'; '.join(errors)}): "
                      f"see {decode_log} (NIXL handshake or transfer errors)")
