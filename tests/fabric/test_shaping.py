"""tc output parsing and the htb tree the fabric installs (no root needed)."""

from __future__ import annotations

import pytest

from harness.errors import ConfigError, ProbeError
from harness.fabric.shaping import (LOSSLESS_CLASS, TCP_CLASS, ShapingSpec, parse_classes, parse_rate, parse_size,
                                    shaping_commands)

# `tc -s class show dev fab0` on this machine's iproute2 6.1 (htb prints text even with -j)
TC_OUTPUT = """\
class htb 1:10 parent 1:1 prio 0 rate 500Mbit ceil 1Gbit burst 125000b cburst 125000b 
 Sent 698024694 bytes 77461 pkt (dropped 3, overlimits 10783 requeues 0) 
 backlog 18000b 2p requeues 0
 lended: 0 borrowed: 0 giants: 0
 tokens: 187 ctokens: 93

class htb 1:1 root rate 1Gbit ceil 1Gbit burst 125000b cburst 125000b 
 Sent 1408140650 bytes 156269 pkt (dropped 0, overlimits 11108 requeues 0) 
 backlog 0b 0p requeues 0

class htb 1:20 parent 1:1 prio 1 rate 8Kbit ceil 8Kbit burst 1600b cburst 1600b 
 Sent 42 bytes 1 pkt (dropped 0, overlimits 0 requeues 0) 
 backlog 0b 0p requeues 0
"""


def test_parse_classes_reads_parameters_and_counters():
    classes = parse_classes(TC_OUTPUT)
    assert set(classes) == {"1:1", "1:10", "1:20"}
    kv = classes["1:10"]
    assert (kv.parent, kv.prio, kv.rate_bps, kv.ceil_bps) == ("1:1", 0, 500e6, 1e9)
    assert (kv.sent_bytes, kv.dropped, kv.overlimits, kv.backlog_bytes, kv.backlog_packets) == (698024694, 3, 10783,
                                                                                                18000, 2)
    assert classes["1:1"].parent is None and classes["1:1"].rate_bps == 1e9
    assert classes["1:20"].rate_bps == 8000 and classes["1:20"].burst_bytes == 1600


def test_units():
    assert parse_rate("2Gbit") == 2e9 and parse_rate("96bit") == 96 and parse_rate("1.5Mbit") == 1.5e6
    assert parse_size("64Kb") == 65536 and parse_size("1375b") == 1375
    with pytest.raises(ProbeError, match="cannot parse tc rate"):
        parse_rate("fast")


def test_kv_ports_are_classified_into_the_lossless_class_both_ways():
    cmds = [" ".join(c) for c in shaping_commands("fab0", "ns1", ShapingSpec(lossless_ports=(7471,)))]
    assert all(c.startswith("tc -n ns1 ") for c in cmds)
    assert any("htb default 20" in c for c in cmds)
    for direction in ("dport", "sport"):
        assert any(f"u32 match ip {direction} 7471 0xffff flowid {LOSSLESS_CLASS}" in c for c in cmds)
    assert not any(f"flowid {TCP_CLASS}" in c for c in cmds)  # the TCP class is the default, not a filter


def test_sabotage_puts_unclassified_traffic_into_the_lossless_class():
    cmds = [" ".join(c) for c in shaping_commands("fab0", None, ShapingSpec(tcp_in_lossless=True))]
    assert any("htb default 10" in c for c in cmds)
    assert all(c.startswith("tc qdisc") or c.startswith("tc class") or c.startswith("tc filter") for c in cmds)


@pytest.mark.parametrize("kwargs, message", [
    ({"line_rate_bps": 10}, "line rate"), ({"mtu": 100}, "MTU"), ({"lossless_share": 1.0}, "lossless_share"),
    ({"lossless_ports": (0,)}, "lossless_ports"),
])
def test_bad_shaping_is_refused_with_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        ShapingSpec(**kwargs)
    assert err.value.fix
