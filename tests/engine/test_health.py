"""Section 5.2 health score and Section 5.3 decision flow."""

import pytest

from harness.engine.resilience.health import (Candidate, DeltaHealthDetector, HealthConfig, HealthSnapshot, TargetWorker,
                                   decide, evict_count, order_victims, pick_target)
from harness.errors import ConfigError


def snap(t=0.0, tpot=20.0, queue=2, hbm=0.3, retrans=0.0):
    return HealthSnapshot(t, tpot, queue, hbm, retrans)


def test_score_is_zero_until_five_snapshots():
    d = DeltaHealthDetector()
    for i in range(4):
        d.ingest(snap(i, tpot=20 * (i + 1)))
    assert d.score() == 0.0
    d.ingest(snap(4, tpot=100))
    assert d.score() > 0


def test_weights_follow_the_article():
    d = DeltaHealthDetector()
    d.ingest(snap(0, tpot=20, queue=2, hbm=0.30, retrans=0.0))
    for i in range(3):
        d.ingest(snap(i + 1, tpot=20, queue=2, hbm=0.30))
    d.ingest(snap(9, tpot=30, queue=3, hbm=0.45, retrans=0.01))
    c = d.components()
    assert c["tpot"] == pytest.approx(0.30 * 0.5)        # p99 20 -> 30 ms
    assert c["queue"] == pytest.approx(0.25 * 0.5)       # queue 2 -> 3
    assert c["hbm"] == pytest.approx(0.25 * 0.15 / 0.3)  # HBM up 15 points
    assert c["retrans"] == pytest.approx(0.20 * 0.01 / 0.05)
    assert d.score() == pytest.approx(sum(c.values()))


def test_improvement_does_not_count_and_score_saturates():
    d = DeltaHealthDetector()
    for i in range(5):
        d.ingest(snap(i, tpot=100 - 10 * i, queue=10 - i, hbm=0.9 - 0.1 * i))
    assert d.score() == 0.0
    d.ingest(snap(6, tpot=1000, queue=100, hbm=1.0, retrans=0.5))
    assert d.score() == 1.0
    assert d.should_migrate()


def test_baseline_slides_with_the_window():
    d = DeltaHealthDetector(HealthConfig(window=5, min_snapshots=5))
    d.ingest(snap(0, tpot=10))
    for i in range(1, 5):
        d.ingest(snap(i, tpot=40))
    assert d.score() > 0.6
    for i in range(5, 10):  # the spike became the new normal
        d.ingest(snap(i, tpot=40))
    assert d.score() == 0.0


def test_snapshot_from_heartbeat_stats_derives_missing_ratio():
    s = HealthSnapshot.from_stats({"kv_blocks_used": 30, "kv_blocks_total": 100, "num_waiting": 4}, 1.0)
    assert (s.hbm_used_ratio, s.queue_depth, s.tpot_p99_ms) == (0.3, 4, 0.0)
    s = HealthSnapshot.from_stats({"kv_used_ratio": 0.9, "queue_depth": 7, "tpot_p99_ms": 12.5,
                                   "retrans_rate": 0.02}, 2.0)
    assert (s.hbm_used_ratio, s.queue_depth, s.tpot_p99_ms, s.retrans_rate) == (0.9, 7, 12.5, 0.02)


def test_bad_config_is_refused():
    with pytest.raises(ConfigError, match="min_snapshots"):
        HealthConfig(window=3, min_snapshots=5)
    with pytest.raises(ConfigError, match="threshold"):
        HealthConfig(threshold=1.5)


def test_evict_count_is_active_times_excess_rounded_up():
    assert evict_count(10, 0.6) == 0
    assert evict_count(10, 0.8) == 2
    assert evict_count(10, 0.61) == 1
    assert evict_count(3, 1.0) == 2
    assert evict_count(0, 1.0) == 0


def test_victims_lowest_priority_then_least_recently_active():
    cands = [Candidate("a", 1, 5.0, 100), Candidate("b", 0, 9.0, 100), Candidate("c", 0, 3.0, 100)]
    assert [c.request_id for c in order_victims(cands)] == ["c", "b", "a"]


def test_target_needs_headroom_then_least_load():
    targets = [TargetWorker("d0", 1, 1000), TargetWorker("d1", 0, 110), TargetWorker("d2", 5, 5000)]
    assert pick_target(targets, 100).worker_id == "d0"      # d1 has 110 <= 1.2 x 100
    assert pick_target(targets, 1000).worker_id == "d2"
    assert pick_target(targets, 10_000) is None


def test_decide_spreads_victims_and_reports_unplaced():
    cands = [Candidate(f"r{i}", 0, float(i), 100) for i in range(10)]
    targets = [TargetWorker("d1", 0, 210), TargetWorker("d2", 0, 210)]
    d = decide(0.9, cands, targets)
    assert d.evict_count == 3
    assert [(p.request_id, p.target) for p in d.plans] == [("r0", "d1"), ("r1", "d2")]
    assert d.unplaced == ["r2"]  # both targets are down to 110 free bytes, below 1.2 x 100


def test_idle_snapshots_are_no_tpot_baseline():
    d = DeltaHealthDetector()
    for i in range(3):
        d.ingest(snap(i, tpot=0.0, queue=0))  # idle: no token in the window
    d.ingest(snap(3, tpot=20.0, queue=0))
    d.ingest(snap(4, tpot=22.0, queue=0))
    assert d.components()["tpot"] == pytest.approx(0.30 * 0.1)  # 20 -> 22 ms, not 0 -> 22 ms
