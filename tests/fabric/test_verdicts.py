"""Verdicts of the fabric items from measurements (no root): each fails with a reason that says
what was measured against what, when its property is broken."""

from __future__ import annotations

from types import SimpleNamespace

from harness.checks.thresholds import Checklist
from harness.checks.verdict import Status
from harness.fabric.bandwidth import BandwidthResult
from harness.fabric.kvbandwidth import KVCurve, KVPoint
from harness.fabric.linerate import LineRate
from harness.fabric.tcpprobe import TcpClassSample
from harness.checks.fabric import (flap_recovery_verdict, kv_bandwidth_verdict, pfc_isolation_verdict,
                                     placement_or_skip)

CHECKLIST = Checklist.load()
LINE = LineRate(1e9, "tc", "fab0", "localhost")
RAW = BandwidthResult(0.95e9, 10**8, 0.84, "iperf3", 7472, "h0", "h1")


def _curve(*gbits: float) -> KVCurve:
    sizes = [1 << 20, 128 << 20][:len(gbits)]
    return KVCurve("tiny", "h0", "h1", [KVPoint(s, s // 2048, [g, g], 0, 0) for s, g in zip(sizes, gbits)])


def test_kv_bandwidth_is_judged_on_the_largest_transfer():
    ok = kv_bandwidth_verdict(CHECKLIST, LINE, RAW, _curve(0.1, 0.9))  # small transfers are latency-bound
    assert ok.status == Status.PASS and ok.measured == 0.9
    assert [p["line_rate_fraction"] for p in ok.evidence["kv_curve"]] == [0.1, 0.9]
    slow = kv_bandwidth_verdict(CHECKLIST, LINE, RAW, _curve(0.1, 0.5))
    assert slow.status == Status.FAIL
    assert "128 MiB" in slow.reason and ">= 0.8" in slow.reason


def _sample(label: str, p99: float, gbit: float) -> TcpClassSample:
    return TcpClassSample(label, p99 / 2, p99, p99, 500, gbit * 1e9, 0.0, 1.0)


def test_pfc_isolation_fails_when_tcp_stalls_with_the_lossless_class():
    before, after = _sample("before", 0.4, 0.95), _sample("after", 0.5, 0.95)
    assert pfc_isolation_verdict(CHECKLIST, before, _sample("during", 0.6, 0.93), after, {}).status == Status.PASS
    broken = pfc_isolation_verdict(CHECKLIST, before, _sample("during", 300.0, 0.2), after, {})
    assert broken.status == Status.FAIL and "p99 round trip during the storm" in broken.reason
    slow = pfc_isolation_verdict(CHECKLIST, before, _sample("during", 0.5, 0.5), after, {})
    assert slow.status == Status.FAIL and "throughput" in slow.reason


def test_flap_recovery_needs_bandwidth_back_in_time():
    ok = flap_recovery_verdict(CHECKLIST, 1.0, [(1.0, 0.5), (3.0, 0.97)], {})
    assert ok.status == Status.PASS and ok.evidence["measurements"][1]["value"] == 3.0
    never = flap_recovery_verdict(CHECKLIST, 1.0, [(1.0, 0.5), (20.0, 0.6), (31.0, 0.6)], {})
    assert never.status == Status.FAIL and "fraction of before" in never.reason
    late = flap_recovery_verdict(CHECKLIST, 1.0, [(20.0, 0.99)], {})
    assert late.status == Status.FAIL and "time from the last flap" in late.reason


def test_a_cluster_without_the_fabric_is_inconclusive_with_the_reason():
    recorded = []
    cluster = SimpleNamespace(fabric=None, fabric_unavailable="skipped: needs root and iproute2 (not running as root)",
                              thresholds=CHECKLIST)
    assert placement_or_skip(cluster, SimpleNamespace(record=recorded.append), "6.1.5") is None
    (verdict,) = recorded
    assert verdict.status == Status.INCONCLUSIVE
    assert verdict.reason == "skipped: needs root and iproute2 (not running as root)"
