"""The SSH fabric path's pieces that need no fabric: iperf3 -J and ib_write_bw outputs (iperf3's
recorded on this machine), the remote command wrapper (run by a real sh: it ends the command
when its stdin closes), the ssh command line, and the hosts' roles from a cluster file."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from harness.clusterfile import load_cluster
from harness.errors import ConfigError, ProbeError
from harness.fabric.bandwidth import parse_iperf3_json
from harness.fabric.procs import remote_command
from harness.fabric.remote import FabricNode, ib_write_bw_argv, parse_ib_write_bw, pick, ssh_prefix
from harness.fabric.bandwidth import Station
from harness.fabric.ssh_hosts import ssh_fabric_reason
from harness.hosts import SSHTarget

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[2]


def test_iperf3_json_gives_the_receivers_totals_and_tcp_details():
    r = parse_iperf3_json((DATA / "iperf3_ok.json").read_text())
    assert r["bytes"] == 128843776 and r["seconds"] == pytest.approx(1.098349)
    assert r["bps"] == pytest.approx(938454178.04, rel=1e-6)
    assert r["retransmits"] == 6 and r["mean_rtt_us"] == 4527


def test_iperf3_errors_are_quoted_in_the_probe_error():
    with pytest.raises(ProbeError, match="unable to connect to server: Connection refused"):
        parse_iperf3_json((DATA / "iperf3_refused.json").read_text(), "iperf3 a -> b")
    with pytest.raises(ProbeError, match="no JSON result"):
        parse_iperf3_json("iperf3: error - unable to connect to server\n")


def test_ib_write_bw_report_in_gbits():
    r = parse_ib_write_bw((DATA / "ib_write_bw_client.txt").read_text())
    assert r == {"bytes": 8388608, "iterations": 500, "peak_bps": pytest.approx(196.34e9),
                 "avg_bps": pytest.approx(196.21e9)}
    with pytest.raises(ProbeError, match="no result row"):
        parse_ib_write_bw(" Couldn't connect to 10.0.0.2:18515\nUnable to open file descriptor for socket connection")
    with pytest.raises(ProbeError, match="--report_gbits"):
        parse_ib_write_bw((DATA / "ib_write_bw_client.txt").read_text().replace("Gb/sec", "MB/sec"))
    assert ib_write_bw_argv("mlx5_0", 65536, 100, "10.0.0.2") == [
        "ib_write_bw", "-d", "mlx5_0", "-s", "65536", "-n", "100", "--report_gbits", "-F", "10.0.0.2"]


def test_remote_command_quotes_every_word_and_ends_the_command_when_stdin_closes(tmp_path):
    """Each word reaches the remote command as itself (no shell expansion), and closing the
    channel's stdin ends the command. Planted defects: shlex.join dropped (the $(touch) runs, the
    words split); the stdin watcher removed (the sleep outlives the closed stdin).
    Stdin stays open while the printf runs, as an SSH channel's does: a stdin closed at once (the
    old ``input=""``) let the watcher kill the printf before it printed, 1 run in 4."""
    marker = tmp_path / "injected"
    proc = subprocess.Popen(["sh", "-c", remote_command(["printf", "%s|", "a b", f"$(touch {marker})", "it's"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        printed = proc.stdout.read()  # type: ignore[union-attr]
        assert (proc.wait(timeout=30), printed) == (0, f"a b|$(touch {marker})|it's|")
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert not marker.exists()
    proc = subprocess.Popen(["sh", "-c", remote_command(["sleep", "300"])], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        time.sleep(0.5)
        proc.stdin.close()  # what our stop() and a dropped SSH channel do
        assert proc.wait(timeout=20) != 0  # the sleep was killed, so the wrapper ended
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_ssh_prefix_uses_only_the_cluster_files_key_and_known_hosts(tmp_path):
    key, known = tmp_path / "key", tmp_path / "known"
    key.write_text("k")
    known.write_text("")
    argv = ssh_prefix(SSHTarget(host="10.0.0.5", user="ops", key_filename=str(key), known_hosts_file=str(known),
                                port=2200))
    assert argv[0] == "ssh" and argv[-2:] == ("ops@10.0.0.5", "--")
    assert "StrictHostKeyChecking=yes" in argv and f"UserKnownHostsFile={known}" in argv and "BatchMode=yes" in argv
    assert argv[argv.index("-i") + 1] == str(key) and argv[argv.index("-p") + 1] == "2200"


def _node(name: str, *roles: str) -> FabricNode:
    st = Station((), "10.0.0.1", name)
    return FabricNode(name, roles, "eth1", "eth1", st, st, None, (), None)


def test_roles_of_the_fabric_items_among_the_hosts():
    chosen = pick([_node("d0", "decode"), _node("p0", "prefill"), _node("d1", "decode")])
    assert {k: v.name for k, v in chosen.items()} == {"source": "p0", "peer": "d0", "other": "d1"}
    two = pick([_node("a", "aggregated"), _node("b", "aggregated")])
    assert (two["source"].name, two["peer"].name, two["other"].name) == ("a", "b", "b")
    with pytest.raises(ConfigError, match="2 SSH fabric hosts"):
        pick([_node("a", "prefill")])


def test_the_ssh_fabric_cluster_file_is_reached_over_ssh_and_the_bundled_ones_are_not():
    assert ssh_fabric_reason(load_cluster(ROOT / "clusters" / "ssh-fabric.yaml")) is None
    assert "external" in ssh_fabric_reason(load_cluster("local-fabric"))
    assert "0 host(s)" in ssh_fabric_reason(load_cluster("prod-a"))
