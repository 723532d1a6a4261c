"""`python -m harness sshd-test`: the loopback server of clusters/ssh-test.yaml comes up with the
key and known_hosts that file names (relative to --state-dir) and `down` leaves nothing; bad
combinations are clear errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.clusterfile import load_cluster
from harness.errors import ConfigError, HarnessError
from harness.fabric.sshdtest import LOOPBACK_PORT, SshdTest, known_hosts_line, unavailable_reason
from harness.hosts import SSHExecutor, SSHTarget
from tests.fabric.conftest import missing

ROOT = Path(__file__).resolve().parents[2]


def test_known_hosts_lines_bracket_only_non_default_ports():
    assert known_hosts_line("198.18.22.1", 22, "ssh-ed25519 AAAAC3 harness") == "198.18.22.1 ssh-ed25519 AAAAC3\n"
    assert known_hosts_line("127.0.0.1", 2222, "ssh-ed25519 AAAAC3 c") == "[127.0.0.1]:2222 ssh-ed25519 AAAAC3\n"


def test_loopback_mode_has_no_fabric_and_no_engine(tmp_path):
    if unavailable_reason():
        missing(unavailable_reason())
    with pytest.raises(ConfigError, match="--loopback"):
        SshdTest(tmp_path, loopback=True, engine=True)


@pytest.mark.slow
def test_ssh_test_cluster_file_works_after_sshd_test_up_loopback(tmp_path):
    if reason := unavailable_reason():
        missing(reason)
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", LOOPBACK_PORT)) == 0:
            missing(f"port {LOOPBACK_PORT} is taken (another sshd-test --loopback?)")
    up = subprocess.Popen([sys.executable, "-m", "harness", "sshd-test", "up", "--loopback",
                           f"--state-dir={tmp_path}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    try:
        for line in up.stdout:
            if line.startswith("ready"):
                break
        assert "clusters/ssh-test.yaml" in line, up.stderr.read()
        ssh = load_cluster("ssh-test").hosts[0].ssh  # its paths, under our state dir instead of ./state
        target = SSHTarget(host="127.0.0.1", port=ssh.port, user=ssh.user,
                           key_filename=str(tmp_path / Path(ssh.key_file).relative_to("state")),
                           known_hosts_file=str(tmp_path / Path(ssh.known_hosts).relative_to("state")))
        with SSHExecutor(target) as ex:
            assert ex.run(["echo", "hello"], timeout=20).stdout == "hello\n"
        with pytest.raises(HarnessError, match="already up"):
            SshdTest(tmp_path, loopback=True).start()
    finally:
        down = subprocess.run([sys.executable, "-m", "harness", "sshd-test", "down", f"--state-dir={tmp_path}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        up.wait(timeout=60)
        up.stdout.close()
        up.stderr.close()
    assert down.returncode == 0 and "nothing left" in down.stdout, down.stdout + down.stderr
    assert not (tmp_path / "ssh-test").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", LOOPBACK_PORT)) != 0
