"""Line rate from the shaping, sysfs, ethtool and ibstat, through an executor."""

from __future__ import annotations

import shutil

import pytest

from harness.errors import ProbeError
from harness.fabric.linerate import parse_ethtool, parse_ibstat, read_line_rate
from harness.hosts import LocalExecutor

from tests.faults.conftest import sshd  # noqa: F401  (fixture: a real sshd on loopback)

ETHTOOL = """Settings for eth1:
\tSupported ports: [ FIBRE ]
\tSpeed: 100000Mb/s
\tDuplex: Full
"""
IBSTAT = """CA 'mlx5_0'
\tPort 1:
\t\tState: Down
\t\tRate: 10
\tPort 2:
\t\tState: Active
\t\tPhysical state: LinkUp
\t\tRate: 200
"""


def test_parsers():
    assert parse_ethtool(ETHTOOL) == 100e9
    assert parse_ethtool("\tSpeed: Unknown!\n") is None
    assert parse_ibstat(IBSTAT) == 200e9           # the Active port, not the first one
    assert parse_ibstat(IBSTAT.replace("Active", "Down")) is None


def test_a_device_nobody_knows_the_speed_of_is_a_clear_error():
    # loopback: no htb class, sysfs speed unreadable, and no ethtool/ibstat answer for it
    with pytest.raises(ProbeError, match="cannot read the line rate of lo") as err:
        read_line_rate(LocalExecutor(), "lo")
    assert "tc: no htb class 1:1 on lo (classes: none)" in str(err.value) and "sysfs:" in str(err.value)
    assert err.value.fix


@pytest.mark.root
@pytest.mark.slow
def test_line_rate_comes_from_the_shaping_then_from_sysfs(make_fabric):
    fabric = make_fabric(hosts=2, line_rate_bps=7e8)
    host = fabric.hosts[0]
    rate = read_line_rate(LocalExecutor(), host.fabric_dev, host.netns)
    assert (rate.bps, rate.source) == (7e8, "tc")
    control = read_line_rate(LocalExecutor(), host.control_dev, host.netns)  # unshaped veth: sysfs says 10 Gbit/s
    assert control.source == "sysfs" and control.bps == 10e9 and control.tried


@pytest.mark.root
@pytest.mark.slow
def test_a_host_without_tc_falls_back_to_sysfs_and_says_why(make_fabric, tmp_path, monkeypatch):
    fabric = make_fabric(hosts=1, line_rate_bps=7e8)
    port = fabric.hosts[0].fabric_port  # the switch-side end, shaped, in this namespace
    assert read_line_rate(LocalExecutor(), port).source == "tc"
    bin_dir = tmp_path / "bin"  # a host with cat but no iproute2
    bin_dir.mkdir()
    (bin_dir / "cat").symlink_to(shutil.which("cat"))
    monkeypatch.setenv("PATH", str(bin_dir))
    rate = read_line_rate(LocalExecutor(), port)  # was: ExecutorError out of read_line_rate
    assert (rate.source, rate.bps) == ("sysfs", 10e9)
    assert len(rate.tried) == 1 and rate.tried[0].startswith("tc: command not found") and "'tc'" in rate.tried[0]


@pytest.mark.root
@pytest.mark.slow
def test_line_rate_is_read_over_ssh_like_on_a_real_host(make_fabric, sshd):
    from harness.hosts import SSHExecutor, SSHTarget

    fabric = make_fabric(hosts=1, line_rate_bps=6e8)
    port = fabric.hosts[0].fabric_port  # the switch-side end: shaped in the root namespace sshd runs in
    target = SSHTarget(host="127.0.0.1", port=sshd.port, user=sshd.user, key_filename=str(sshd.user_key),
                       known_hosts_file=str(sshd.known_hosts))
    with SSHExecutor(target) as ex:
        shaped = read_line_rate(ex, port)
        control = read_line_rate(ex, fabric.hosts[0].control_port)
    assert (shaped.bps, shaped.source, shaped.host) == (6e8, "tc", f"127.0.0.1:{sshd.port}"), shaped.tried
    assert (control.bps, control.source) == (10e9, "sysfs")
