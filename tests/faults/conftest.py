"""Fixtures for the fault tests: a real sshd on loopback with throwaway keys, and victim processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Every fault test leaves SIGINT and SIGTERM as it found them: a finished SignalOwner leaves
    SIG_IGN by design (the end of a run), and a test that ran after one such test saw its Ctrl-C
    ignored ("DID NOT RAISE KeyboardInterrupt" after other tests, passing alone)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def keygen(path: Path) -> str:
    """A new ed25519 key pair at path (path.pub); returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "harness-test", "-f", str(path)],
                   check=True, capture_output=True)
    return path.with_suffix(".pub").read_text().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sshd:
    port: int
    user: str
    user_key: Path
    host_pub: str          # "ssh-ed25519 AAAA... comment"
    known_hosts: Path      # holds the real host key
    tmp: Path

    def known_hosts_with(self, pub: str, name: str) -> Path:
        path = self.tmp / name
        path.write_text(f"[127.0.0.1]:{self.port} {' '.join(pub.split()[:2])}\n" if pub else "")
        return path


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A real OpenSSH server on a free loopback port, key auth only, as the current user."""
    if not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None:
        pytest.skip("openssh-server is not installed (no sshd/ssh-keygen); `.ci/run` installs it")
    tmp = tmp_path_factory.mktemp("sshd")
    os.chmod(tmp, 0o700)
    host_pub = keygen(tmp / "host_key")
    user_pub = keygen(tmp / "user_key")
    (tmp / "authorized_keys").write_text(user_pub + "\n")
    port = free_port()
    (tmp / "sshd_config").write_text(f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {tmp / 'host_key'}
PidFile {tmp / 'sshd.pid'}
AuthorizedKeysFile {tmp / 'authorized_keys'}
UsePAM no
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
LogLevel VERBOSE
""")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir sshd insists on
    log = open(tmp / "sshd.log", "w")
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {proc.returncode}: {(tmp / 'sshd.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not listen on {port}: {(tmp / 'sshd.log').read_text()}")
                time.sleep(0.05)
        server = Sshd(port=port, user=os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name,
                      user_key=tmp / "user_key", host_pub=host_pub, known_hosts=tmp / "known_hosts", tmp=tmp)
        server.known_hosts_with(host_pub, "known_hosts")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def victim():
    """A process the test owns and always reaps: a long `sleep` for faults to hit."""
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(["sleep", "300"])
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()  # SIGKILL ends even a stopped process
        proc.wait()


def proc_state(pid: int) -> str | None:
    """State letter of a local pid as `ps` reports it (independent of the code under test); None if gone."""
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return out.stdout.strip()[:1] or None


# A harness run that hangs a victim and then waits; exits 128+signal on SIGTERM/SIGINT after reverting.
HARNESS_CHILD = """
import sys, time
from harness.faults import FaultRunner, Ledger, ProcessHang, Terminated
try:
    with FaultRunner(Ledger.for_cluster("local", sys.argv[1])) as runner:
        runner.inject(ProcessHang.from_worker({"id": "decode-0", "role": "decode", "pid": int(sys.argv[2])}))
        print("injected", flush=True)
        time.sleep(300)
except Terminated as exc:
    sys.exit(exc.exit_code)
except KeyboardInterrupt:
    sys.exit(130)
"""


@contextmanager
def harness_with_hang(state_dir: Path, victim_pid: int) -> Iterator[subprocess.Popen]:
    """A separate harness process with the victim hung; always killed and reaped at the end."""
    harness = subprocess.Popen([sys.executable, "-c", HARNESS_CHILD, str(state_dir), str(victim_pid)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert harness.stdout.readline() == "injected\n", harness.stderr.read()
        assert proc_state(victim_pid) == "T"
        yield harness
    finally:
        if harness.poll() is None:
            harness.kill()
        harness.wait()
        harness.stdout.close()
        harness.stderr.close()


def harness_revert(*args: str) -> subprocess.CompletedProcess:
    """`python -m harness revert ARGS` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "harness", "revert", *args], capture_output=True, text=True,
                          timeout=120)
