"""The hosts' GPU reading over a real loopback sshd: a host without nvidia-smi says why."""

from __future__ import annotations

import pytest

from harness.probes.workers.gpu_hosts import HostGpus, changes, read_host

pytestmark = pytest.mark.slow


def test_a_host_without_nvidia_smi_says_so_and_is_left_out_of_the_changes(sshd):
    from harness.hosts import SSHExecutor, SSHTarget

    target = SSHTarget(host="127.0.0.1", port=sshd.port, user=sshd.user, key_filename=str(sshd.user_key),
                       known_hosts_file=str(sshd.known_hosts))
    with SSHExecutor(target) as ex:
        host = read_host("node-1", ex)
    assert host.gpus == [] and "nvidia-smi failed on" in host.unavailable
    assert host.summary().startswith("node-1: not read (nvidia-smi failed on")
    assert changes([host], [host]) == [] and changes([HostGpus("node-1")], [host]) == []
