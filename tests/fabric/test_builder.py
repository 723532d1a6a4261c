"""The emulated fabric on real kernel networking: namespaces, bridges, veths, htb classes."""

from __future__ import annotations

import subprocess

import pytest

from harness.errors import ConfigError
from harness.fabric.builder import Fabric, FabricConfig, leftovers, link_state, list_links, list_netns
from harness.fabric.shaping import LOSSLESS_CLASS, ROOT_CLASS, TCP_CLASS, read_classes
from harness.hosts import LocalExecutor

TEST_PREFIX = "pdt-"  # as in conftest.py

pytestmark = [pytest.mark.root]


def test_config_refuses_addresses_outside_the_benchmark_range():
    with pytest.raises(ConfigError, match="outside 198.18.0.0/15") as err:
        FabricConfig(fabric_subnet="10.0.0.0/24")
    assert "198.18.0.0/15" in (err.value.fix or "")
    with pytest.raises(ConfigError, match="overlap"):
        FabricConfig(fabric_subnet="198.18.1.0/24", control_subnet="198.18.1.0/25")
    with pytest.raises(ConfigError, match="prefix"):
        FabricConfig(prefix="a-very-long-prefix-")


def test_placement_binds_kv_to_the_fabric_and_heartbeats_to_the_control_nic():
    fabric = Fabric(FabricConfig(hosts=3))  # nothing is built: placement is pure
    kwargs = fabric.topology_kwargs(["prefill-0", "decode-0", "decode-1"])
    addr = kwargs["worker_addresses"]["decode-1"]
    assert (addr.kv, addr.control, addr.kv_port) == ("198.18.1.3", "198.18.2.3", 7471)
    assert kwargs["control_host"] == "198.18.2.254"
    assert kwargs["worker_cmd_prefix"]("decode-0") == ["ip", "netns", "exec", "pdh-h1"]
    with pytest.raises(ConfigError, match="no host on the fabric"):
        kwargs["worker_cmd_prefix"]("decode-7")
    with pytest.raises(ConfigError, match="one host per worker"):
        fabric.placement([f"w{i}" for i in range(4)])


@pytest.mark.slow
def test_three_hosts_are_built_idempotently_shaped_and_reachable(make_fabric):
    ex = LocalExecutor()
    fabric = make_fabric(hosts=3, line_rate_bps=5e8)
    fabric.setup()  # a second setup converges to the same fabric
    assert sorted(n for n in list_netns(ex) if n.startswith(TEST_PREFIX)) == ["pdt-h0", "pdt-h1", "pdt-h2"]
    assert {"pdt-fab", "pdt-ctl", "pdt-f0", "pdt-c2"} <= set(list_links(ex))
    for host in fabric.hosts:
        assert link_state(ex, host.fabric_dev, host.netns) == "UP"
        for dev, netns in ((host.fabric_dev, host.netns), (host.fabric_port, None)):  # TX and RX
            classes = read_classes(ex, dev, netns)
            assert classes[ROOT_CLASS].rate_bps == 5e8
            assert classes[LOSSLESS_CLASS].prio == 0 and classes[TCP_CLASS].prio == 0  # round robin (ETS), not strict priority
    mtu = subprocess.run(["ip", "-n", "pdt-h1", "-o", "link", "show", "dev", "fab0"], capture_output=True, text=True)
    assert "mtu 9000" in mtu.stdout
    # host to host over the fabric, and host to the root namespace over the control bridge
    h0 = fabric.hosts[0].exec_prefix()
    probe = "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()"
    with subprocess.Popen([*fabric.hosts[1].exec_prefix(), "python3", "-c",
                           "import socket; s=socket.create_server(('198.18.11.2', 7600)); print('up', flush=True); "
                           "s.accept()"], stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout.readline().strip() == "up"
            subprocess.run([*h0, "python3", "-c", probe, "198.18.11.2", "7600"], check=True, timeout=20)
        finally:
            server.kill()


@pytest.mark.slow
def test_setup_after_a_crash_removes_the_strays_of_its_prefix(make_fabric):
    ex = LocalExecutor()
    # what a crashed larger run leaves: an extra namespace and a dangling link with our prefix
    subprocess.run(["ip", "netns", "add", f"{TEST_PREFIX}h9"], check=True)
    subprocess.run(["ip", "link", "add", f"{TEST_PREFIX}f9", "type", "veth", "peer", "name", "pdt-stray9"], check=True)
    fabric = make_fabric(hosts=2)
    assert f"{TEST_PREFIX}h9" not in list_netns(ex)
    assert not {f"{TEST_PREFIX}f9", "pdt-stray9"} & set(list_links(ex))
    fabric.teardown()
    assert leftovers(ex, TEST_PREFIX) == []


@pytest.mark.slow
def test_two_clusters_get_separate_fabric_slots():
    from harness.fabric.builder import fabric_unavailable_reason
    from harness.fabric.shaping import ShapingSpec

    if fabric_unavailable_reason():
        pytest.skip(fabric_unavailable_reason())
    first = Fabric.in_free_slot(1, ShapingSpec())
    second = Fabric.in_free_slot(1, ShapingSpec())
    try:
        assert first.config.prefix != second.config.prefix
        assert first.config.fabric_subnet != second.config.fabric_subnet
        assert first.control_gateway_ip != second.control_gateway_ip
        first.setup()
        second.setup()  # its stray cleanup leaves the other slot's namespaces alone
        assert f"{first.config.prefix}h0" in list_netns(LocalExecutor())
    finally:
        first.teardown()
        second.teardown()
    assert leftovers(prefix=first.config.prefix) == [] and leftovers(prefix=second.config.prefix) == []
    again = Fabric.in_free_slot(1, ShapingSpec())  # the lock went with the teardown
    try:
        assert again.config.prefix in {first.config.prefix, second.config.prefix}
    finally:
        again.teardown()


def test_teardown_kills_what_still_runs_in_a_namespace_so_the_namespace_really_goes():
    """Planted defect (found after a CI run: three sshd sessions held deleted namespaces): `ip netns
    del` alone drops the name while a process inside keeps the namespace alive, unseen by
    leftovers(). The straggler is killed first; its namespace is gone with it."""
    from tests.fabric.conftest import require_fabric

    require_fabric()
    from harness.fabric.builder import remove_prefixed

    ex, ns = LocalExecutor(), "pdz-strag0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    proc = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"])
    try:
        inode = None
        for _ in range(50):   # until the child is inside the namespace
            if proc.poll() is None and (inode := _netns_inode(proc.pid)) != _netns_inode(1):
                break
            __import__("time").sleep(0.05)
        assert inode is not None and inode != _netns_inode(1)
        remove_prefixed(ex, "pdz-")
        assert proc.wait(timeout=10) == -9   # killed, not left holding the namespace
        assert leftovers(ex, "pdz-") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _netns_inode(pid: int) -> str | None:
    try:
        return __import__("os").readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None
