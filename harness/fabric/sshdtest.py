"""Foreign-looking hosts on this machine: an OpenSSH server in each emulated-fabric namespace
(``clusters/ssh-fabric.yaml``), or one on loopback port 2222 (``clusters/ssh-test.yaml``).

``python -m harness sshd-test up`` runs :class:`SshdTest` in the foreground until SIGTERM/Ctrl-C
(or ``python -m harness sshd-test down``): it builds a fabric with prefix ``pds-`` (198.18.21.0/24
fabric, 198.18.22.0/24 control; never a bundled cluster's slot), writes a user key, one host key
per host, ``authorized_keys`` and a ``known_hosts`` naming exactly those host keys under
``state/sshd-test/``, and starts ``sshd -D`` in every namespace on its control address, port 22.
With ``--engine`` it also runs the bundled engine with one worker per host (router API at
198.18.22.254:8390), restarting a worker that dies as a service manager would: a cluster the
harness reaches only as a user's cluster, over HTTP and SSH.

The process is a child subreaper: whatever a remote command leaves running (a NIC flap's safety
timer) is adopted and reaped here, and ended when it stops, so nothing outlives ``down``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.errors import ConfigError, HarnessError
from harness.hosts import LocalExecutor

log = logging.getLogger(__name__)

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
PREFIX = "pds-"
FABRIC_SUBNET, CONTROL_SUBNET = "198.18.21.0/24", "198.18.22.0/24"
ENGINE_PORT = 8390
LOOPBACK_PORT = 2222
LISTEN_TIMEOUT_S = 30.0
PR_SET_CHILD_SUBREAPER = 36


def keygen(path: Path) -> str:
    """A fresh ed25519 key pair at ``path`` (+ .pub); returns the public key line."""
    for p in (path, path.with_suffix(".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "harness-sshd-test", "-f", str(path)],
                   check=True, capture_output=True, timeout=30)
    return path.with_suffix(".pub").read_text().strip()


def known_hosts_line(address: str, port: int, public_key: str) -> str:
    host = address if port == 22 else f"[{address}]:{port}"
    return f"{host} {' '.join(public_key.split()[:2])}\n"


def sshd_config(listen: str, port: int, host_key: Path, pid_file: Path, authorized: Path) -> str:
    return (f"Port {port}\nListenAddress {listen}\nHostKey {host_key}\nPidFile {pid_file}\n"
            f"AuthorizedKeysFile {authorized}\nUsePAM no\nStrictModes no\nPubkeyAuthentication yes\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            "MaxSessions 64\nMaxStartups 64\nLogLevel INFO\n"
            "Subsystem sftp internal-sftp\n")  # as a stock sshd: distributed load reads its records over SFTP


def unavailable_reason() -> str | None:
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
        return "openssh-server and openssh-client are not installed (apt-get install openssh-server openssh-client)"
    if os.geteuid() != 0:
        return "sshd-test needs root (network namespaces, sshd privilege separation)"
    return None


class SshdTest:
    """The servers (and optionally the engine) of one ``sshd-test up``; a context manager."""

    def __init__(self, state_dir: str | os.PathLike[str] = "state", *, hosts: int = 3, loopback: bool = False,
                 sabotaged: bool = False, line_rate_bps: float = 1e9, engine: bool = False,
                 prefix: str = PREFIX, fabric_subnet: str = FABRIC_SUBNET, control_subnet: str = CONTROL_SUBNET,
                 lossless_ports: tuple[int, ...] | None = None) -> None:
        """``prefix`` and the subnets: another set of hosts beside the default one (a test of its own);
        ``lossless_ports``: the fabric's lossless-class ports (default 7471, 7472)."""
        if reason := unavailable_reason():
            raise HarnessError(f"sshd-test: {reason}", fix="install OpenSSH and run as root")
        if loopback and (engine or sabotaged):
            raise ConfigError("sshd-test --loopback starts one sshd for clusters/ssh-test.yaml (no fabric, no engine)",
                              fix="drop --engine/--sabotaged, or drop --loopback for the fabric hosts")
        self.loopback, self.hosts, self.engine_wanted = loopback, hosts, engine
        self.dir = (Path(state_dir) / ("ssh-test" if loopback else "sshd-test")).resolve()
        self.key = self.dir / "id_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.sshds: list[subprocess.Popen] = []
        self.fabric: Any = None
        self.topology: Any = None
        self._logs: list[Any] = []
        self._before: set[int] = set()   # children of this process before start: never ours to end
        if not loopback:
            from harness.fabric.builder import Fabric, FabricConfig
            from harness.fabric.shaping import ShapingSpec

            self.fabric = Fabric(FabricConfig(hosts=hosts, prefix=prefix, fabric_subnet=fabric_subnet,
                                              control_subnet=control_subnet,
                                              shaping=ShapingSpec(line_rate_bps=line_rate_bps, tcp_in_lossless=sabotaged,
                                                                  **({"lossless_ports": tuple(lossless_ports)}
                                                                     if lossless_ports else {}))))

    @property
    def pid_file(self) -> Path:
        return self.dir / "keeper.pid"

    def endpoints(self) -> list[tuple[str, str, int]]:
        """(name, listen address, port) of every sshd."""
        if self.loopback:
            return [("localhost", "127.0.0.1", LOOPBACK_PORT)]
        return [(h.netns, h.control_ip, 22) for h in self.fabric.hosts]

    def pid_cluster_data(self, name: str, pids: list[int], folder: Path, *, api: str, worker_port: int,
                         allowed_faults: tuple[str, ...] = ("process_hang",),
                         connect_timeout_s: float = 10) -> dict[str, Any]:
        """A cluster file (as data) reaching each host only over SSH, one worker per host whose
        process is ``pids[i]`` (pid files written under ``folder``): for faults fanned out over
        these hosts. ``api`` and the workers' ``worker_port`` are never called."""
        ssh = {"user": "root", "key_file": str(self.key), "known_hosts": str(self.known_hosts),
               "connect_timeout_s": connect_timeout_s}
        data: dict[str, Any] = {"version": 2, "name": name, "kind": "external", "endpoints": {"api": api},
                                "hosts": [], "workers": [], "safety": {"allowed_faults": list(allowed_faults)}}
        folder.mkdir(parents=True, exist_ok=True)
        for i, ((_, address, _), pid) in enumerate(zip(self.endpoints(), pids)):
            (folder / f"w-{i}.pid").write_text(f"{pid}\n")
            data["hosts"].append({"name": f"h{i}", "address": address, "roles": ["decode"], "ssh": ssh})
            data["workers"].append({"name": f"w-{i}", "role": "decode", "host": f"h{i}",
                                    "api": f"http://{address}:{worker_port}",
                                    "process": {"pid_file": str(folder / f"w-{i}.pid")}})
        return data

    def __enter__(self) -> SshdTest:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.pid_file.exists() and _alive(int(self.pid_file.read_text() or 0)):
            raise HarnessError(f"sshd-test is already up (pid {self.pid_file.read_text().strip()})",
                               fix="run `python -m harness sshd-test down` first")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, mode=0o700)
        self.pid_file.write_text(str(os.getpid()))
        self._before = _children()
        user_pub = keygen(self.key)
        (self.dir / "authorized_keys").write_text(user_pub + "\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        if self.fabric is not None:
            self.fabric.setup()
        known = []
        for name, listen, port in self.endpoints():
            hdir = self.dir / name
            hdir.mkdir()
            host_pub = keygen(hdir / "host_key")
            (hdir / "sshd_config").write_text(sshd_config(listen, port, hdir / "host_key", hdir / "sshd.pid",
                                                          self.dir / "authorized_keys"))
            known.append(known_hosts_line(listen, port, host_pub))
            ns = [] if self.loopback else ["ip", "netns", "exec", name]
            out = open(hdir / "sshd.log", "w")
            self._logs.append(out)
            self.sshds.append(subprocess.Popen([*ns, SSHD, "-D", "-e", "-f", str(hdir / "sshd_config")],
                                               stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        self.known_hosts.write_text("".join(known))
        for (name, listen, port), proc in zip(self.endpoints(), self.sshds):
            self._wait_listening(name, listen, port, proc)
        if self.engine_wanted:
            self._start_engine()

    def _wait_listening(self, name: str, listen: str, port: int, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise HarnessError(f"sshd on {name} exited with {proc.returncode}: "
                                   f"{(self.dir / name / 'sshd.log').read_text()[-800:]}", fix="read the sshd log")
            try:
                socket.create_connection((listen, port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise HarnessError(f"sshd on {name} did not listen on {listen}:{port}",
                                       fix=f"read {self.dir / name / 'sshd.log'}") from None
                time.sleep(0.05)  # sshd binds a moment after it starts

    def _start_engine(self) -> None:
        from harness.engine.pd.topology import Topology

        decode = self.hosts - 1
        ids = ["prefill-0"] + [f"decode-{i}" for i in range(decode)]
        self.topology = Topology(prefill=1, decode=decode, preset="tiny", host=self.fabric.control_gateway_ip,
                                 port=ENGINE_PORT, log_dir=self.dir / "engine", **self.fabric.topology_kwargs(ids))
        self.topology.start()

    def supervise(self) -> list[str]:
        """Restart the engine's workers that died, as a service manager would (the cluster file
        says ``supervised: true``): a kill over SSH is then followed by the worker coming back."""
        restarted = []
        if self.topology is None:
            return restarted
        for wid, code in self.topology.exited_workers().items():
            log.warning("worker %s exited with %s; restarting it", wid, code)
            self.topology.restart(wid, wait=False)
            restarted.append(wid)
        return restarted

    def reap_adopted(self) -> None:
        """Reap the zombies of adopted orphans (never our own Popen children: they reap themselves)."""
        for pid in _children() - self._own_pids() - self._before:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def _own_pids(self) -> set[int]:
        own = {p.pid for p in self.sshds}
        if self.topology is not None:
            own |= self.topology.child_pids()
        return own

    def stop(self) -> None:
        """Stop the engine and every sshd, end what remote commands left behind, remove the fabric
        and the state directory; raises if a part remains."""
        problems = []
        if self.topology is not None:
            try:
                self.topology.stop()
            except Exception as exc:  # keep going: the servers and the fabric must still go
                problems.append(f"engine: {exc}")
            self.topology = None
        for proc in self.sshds:
            _end(proc)
        self.sshds.clear()
        for out in self._logs:
            out.close()
        self._logs.clear()
        # adopted orphans (safety timers, probe ends of a dropped session); a child this process had
        # before start (a test session's own sshd, say) is someone else's and is left alone
        for pid in _children() - self._before:
            _kill_and_reap(pid)
        if self.fabric is not None:
            try:
                self.fabric.teardown()
            except HarnessError as exc:
                problems.append(str(exc))
        if self.pid_file.exists() and self.pid_file.read_text().strip() == str(os.getpid()):
            shutil.rmtree(self.dir, ignore_errors=True)
        if problems:
            raise HarnessError("sshd-test down left: " + "; ".join(problems), fix="python -m harness fabric down --force")


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: orphans of remote commands go to pid 1")


def _children() -> set[int]:
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_and_reap(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                return
            time.sleep(0.05)  # waiting for the signal to land


def down(state_dir: str | os.PathLike[str] = "state", timeout_s: float = 60.0, *, force: bool = False) -> list[str]:
    """Ask the ``sshd-test up`` runs of ``state_dir`` (fabric and loopback) to stop, wait until
    they have, and remove what a killed one left; the ``pds-`` fabric goes when this state dir
    had one up (or ``force``). Returns what still remains of them (empty: nothing)."""
    from harness.fabric.builder import leftovers, remove_prefixed

    ours_fabric = force
    for sub in ("sshd-test", "ssh-test"):
        folder = Path(state_dir) / sub
        if not folder.exists():
            continue
        ours_fabric |= sub == "sshd-test"
        pid_file = folder / "keeper.pid"
        pid = int(pid_file.read_text().strip() or 0) if pid_file.exists() else 0
        if pid and _alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)  # the keeper stops its engine, servers and fabric
        for server_pid in folder.glob("*/sshd.pid"):  # a SIGKILLed keeper's servers
            try:
                os.kill(int(server_pid.read_text().strip()), signal.SIGTERM)
            except (ValueError, ProcessLookupError):
                pass
        if not (pid and _alive(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    left = []
    if ours_fabric:
        remove_prefixed(LocalExecutor(), PREFIX)
        left += leftovers(LocalExecutor(), PREFIX)
    return left + [f"sshd pid {pid}" for pid in _sshd_pids(Path(state_dir).resolve())]


def _sshd_pids(state_dir: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"sshd -D -e -f {state_dir}/(sshd-test|ssh-test)/"],
                         capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if _alive(int(p))]
