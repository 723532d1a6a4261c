"""soak.leaks from synthetic leak samples (harness/probes/workers/leaks.py's types) and idle KV figures:
an honest run passes, a planted KV leak or a steep RSS slope fails (on a short run only when far
beyond the limit: the early fail), a restart is no slope, nothing measured is inconclusive. Each
test's docstring names the defect in the check it catches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.checklists import Checklist
from harness.checks.leaks import ITEM, leak_verdict
from harness.checks.verdict import Status, Verdict, undecided
from harness.probes.workers.leaks import LeakSample, ProcessReading, WorkerLeakReading

T0 = 1_700_000_000.0
MB = 1 << 20
IDLE = {"prefill-0": 0, "decode-0": 0, "decode-1": 0}


@pytest.fixture(scope="module")
def checklist() -> Checklist:
    return Checklist.load()


def run(minutes: float, *, step_s: float = 2.0, rss_mb_per_h: dict[str, float] | None = None,
        harness_mb_per_h: float = 0.0, pids: dict[str, list[tuple[float, int, float]]] | None = None,
        seed: int = 0) -> list[LeakSample]:
    """Samples every ``step_s`` for ``minutes``: each worker's RSS around 300 MB (a few MB of noise)
    growing by ``rss_mb_per_h``; ``pids``: worker -> [(from minute, pid, RSS MB then)] (restarts)."""
    rng = np.random.default_rng(seed)
    slopes = rss_mb_per_h or {}
    out = []
    for k in range(int(minutes * 60 / step_s) + 1):
        t = k * step_s
        workers = []
        for i, wid in enumerate(IDLE):
            starts = (pids or {}).get(wid, [(0.0, 1000 + i, 300.0)])
            since, pid, base = max((s for s in starts if s[0] * 60 <= t), key=lambda s: s[0])
            mb = base + slopes.get(wid, 0.0) * (t - since * 60) / 3600 + rng.normal(0, 3)
            proc = ProcessReading(pid, int(mb * MB), fds=40 + int(rng.integers(0, 3)), threads=12)
            workers.append(WorkerLeakReading(wid, wid.split("-")[0], pid, "healthy", int(rng.integers(0, 50)), 1000,
                                             2, 3, proc))
        harness = ProcessReading(99, int((200 + harness_mb_per_h * t / 3600 + rng.normal(0, 1)) * MB), 30, 8)
        out.append(LeakSample(T0 + t, harness, tuple(workers)))
    return out


def check_json(v: Verdict) -> None:
    assert json.loads(json.dumps(v.to_dict()))["item"] == ITEM


def test_an_honest_run_passes_stating_its_figures(checklist):
    """Catches a growth rule that fails (or cannot pass) a flat, noisy run: every unit must pass."""
    v = leak_verdict(checklist, run(20), idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.PASS, v.reason
    assert v.cause["code"] == "met" and v.cause["what"] == ("KV blocks held once the load drained above idle before "
                                                            "the run, the most of 3 workers (decode-0: 0 vs 0 before)")
    assert (v.cause["figure"], v.cause["threshold"], v.cause["more_met"]) == ("0 blocks", "<= 0 blocks", 13)
    assert v.layer("note")["text"].startswith("steepest RSS growth") and "MB/h [" in v.layer("note")["text"]
    procs = v.evidence["processes"]
    assert len(procs) == 3
    for p in procs:   # every interval wholly below its limit, and near the true slope (0)
        assert p["rss_growth_mb_per_h"]["interval"]["hi"] < 256 and abs(p["rss_growth_mb_per_h"]["estimate"]) < 60
        assert p["threads_growth_per_h"]["estimate"] == 0
    assert [r["unit"] for r in v.evidence["roles"]] == ["role decode", "worker decode-0", "worker decode-1",
                                                        "role prefill"]
    assert v.evidence["kv"]["workers"]["decode-1"] == {"idle_before": 0, "idle_after": 0, "leaked": 0}
    assert len(v.evidence["measurements"]) == 1 + 3 * 4 + 1    # KV, 3 growths of 4 units, harness band
    series = v.evidence["series"]["decode-0"]
    assert len(series) == 300 and series[0][0] == 0 and series[-1][0] == 1200   # 601 samples, downsampled
    assert len(series[0]) == 5 and 290 < series[0][1] < 310
    assert len(v.evidence["harness_rss_mb"]) == 300
    check_json(v)


def test_a_planted_kv_leak_fails_naming_the_worker_and_its_blocks(checklist):
    """Catches a KV rule that misses blocks held after the drain (local-leaky's planted leak)."""
    v = leak_verdict(checklist, run(3), idle_before=IDLE, idle_after={**IDLE, "decode-1": 16, "decode-0": 8})
    assert v.status is Status.FAIL
    assert v.measured == 16 and v.threshold == 0 and v.unit == "blocks"
    assert v.cause["code"] == "missed" and v.cause["what"].endswith("on decode-1 (16 vs 0 before; also over on decode-0: 8)")
    assert (v.cause["figure"], v.cause["threshold"]) == ("16 blocks", "<= 0 blocks")
    assert "A leak of a few blocks per recovery" in v.cause["why"]   # the item's why
    check_json(v)


def test_blocks_held_idle_before_the_run_are_not_a_leak(checklist):
    """Catches a KV rule comparing with 0 instead of the idle figure before the run."""
    v = leak_verdict(checklist, run(3), idle_before={**IDLE, "decode-0": 5}, idle_after={**IDLE, "decode-0": 5})
    assert v.status is Status.PASS, v.reason
    assert v.evidence["kv"]["workers"]["decode-0"] == {"idle_before": 5, "idle_after": 5, "leaked": 0}


def test_a_steep_rss_slope_over_20_minutes_fails(checklist):
    """Catches one leaking worker diluted by its healthy peer in the role's common slope: the
    worker's own fit (across its restarts) must fail, naming it."""
    v = leak_verdict(checklist, run(20, rss_mb_per_h={"decode-0": 1200.0}), idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.FAIL
    assert v.cause["code"] == "missed" and v.cause["what"].startswith(
        "RSS growth of decode-0 (pid 1001), one slope across restarts over 19.0 min after each process's first 60 s"), v.reason
    assert "MB/h [" in v.cause["figure"] and v.cause["threshold"] == "<= 256 MB/h" and "early fail" not in v.reason
    assert 1000 < v.measured < 1400 and v.interval["lo"] > 256
    other = next(p for p in v.evidence["processes"] if p["worker"] == "decode-1")
    assert other["rss_growth_mb_per_h"]["interval"]["hi"] < 256


def test_a_short_run_fails_early_only_far_beyond_the_limit(checklist):
    """Catches the defect of issue 33: a leak 4x+ over the limit passing as 'under 10 min: evidence
    only'; and the opposite defect, a slope under 4x the limit failing a short run."""
    v = leak_verdict(checklist, run(5, rss_mb_per_h={"decode-0": 2400.0}), idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.FAIL, v.reason
    assert v.reason.startswith("RSS growth of decode-0 (pid 1001), one slope across restarts over 4.0 min"), v.reason
    assert "early fail: its lower bound is over 4x the limit" in v.reason and v.interval["lo"] > 4 * 256
    v = leak_verdict(checklist, run(5, rss_mb_per_h={"decode-0": 600.0}), idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.PASS, v.reason
    assert "observed under 10 min: their growth is evidence only unless it is over 4x the limit" in v.reason
    steep = next(p for p in v.evidence["processes"] if p["worker"] == "decode-0")
    assert steep["rss_growth_mb_per_h"]["interval"]["lo"] > 256       # the slope is there, as evidence
    assert len(v.evidence["measurements"]) == 1 and v.evidence["harness"]["judged"] is False


def test_a_restarted_worker_is_a_new_segment_not_a_slope(checklist):
    """Catches a fit that joins a restart's jump to its predecessor (one straight line through both
    processes would read ~750 MB/h here): the segments keep their own intercepts."""
    restart = {"decode-0": [(0.0, 1001, 300.0), (12.0, 2001, 450.0)]}
    v = leak_verdict(checklist, run(24, pids=restart), idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.PASS, v.reason
    d0 = [p for p in v.evidence["processes"] if p["worker"] == "decode-0"]
    assert [p["pid"] for p in d0] == [1001, 2001]
    assert d0[1]["first_t_rel_s"] == pytest.approx(720, abs=2)
    worker = next(r for r in v.evidence["roles"] if r["unit"] == "worker decode-0")
    assert worker["processes"] == ["decode-0 (pid 1001)", "decode-0 (pid 2001)"]
    assert abs(worker["rss_mb_per_h"]["estimate"]) < 60


def test_a_leak_restarted_before_10_minutes_is_still_judged_across_restarts(checklist):
    """Catches the defect of issue 33 at --soak=11m: kills restarting every leaking worker before it
    lived 10 minutes, each new process starting its evidence afresh, so none was ever judged."""
    starts = {w: [(m, 3000 + 10 * i + k, 300.0) for k, m in enumerate((0.0, 4.0, 8.0, 12.0))]
              for i, w in enumerate(("decode-0", "decode-1"))}
    v = leak_verdict(checklist, run(16, rss_mb_per_h={"decode-0": 600.0, "decode-1": 600.0}, pids=starts),
                     idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.FAIL, v.reason
    assert v.reason.startswith("RSS growth of role decode (8 processes: decode-0 (pid 3000), decode-0 (pid 3001)")
    assert "early fail" not in v.reason and 256 < v.interval["lo"] and 500 < v.measured < 700


def test_the_harness_growing_past_its_band_fails_on_a_long_run_or_far_beyond_it(checklist):
    """Catches a harness band judged on a bare point (no interval) or never judged on a short run."""
    v = leak_verdict(checklist, run(20, harness_mb_per_h=300.0), idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.FAIL
    assert v.reason.startswith("the harness's own RSS rise after its first 60 s (from ") and "required <= 0.1" in v.reason
    assert v.measured == pytest.approx(95 / 200, abs=0.03)   # 300 MB/h over 19 min above 200 MB
    assert v.interval["method"].startswith("Theil-Sen") and 0.1 < v.interval["lo"] <= v.measured <= v.interval["hi"]
    short = leak_verdict(checklist, run(5, harness_mb_per_h=300.0), idle_before=IDLE, idle_after=dict(IDLE))
    assert short.status is Status.PASS and 0.05 < short.evidence["harness"]["band"] < 0.4
    assert "evidence only" in short.evidence["harness"]["note"]
    steep = leak_verdict(checklist, run(5, harness_mb_per_h=3000.0), idle_before=IDLE, idle_after=dict(IDLE))
    assert steep.status is Status.FAIL and "early fail" in steep.reason and steep.interval["lo"] > 0.4


def test_no_samples_is_inconclusive(checklist):
    """Catches a check passing when the sampler recorded nothing."""
    v = leak_verdict(checklist, [], idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.INCONCLUSIVE
    assert "no leak samples were taken" in v.reason and v.evidence["samples_taken"] == 0
    # a KV leak is certain evidence even without samples
    assert leak_verdict(checklist, [], idle_before=IDLE, idle_after={**IDLE, "decode-0": 3}).status is Status.FAIL


def test_no_idle_figures_after_the_run_is_inconclusive_and_a_missing_worker_is_named(checklist):
    """Catches an unread worker's KV figure taken as no leak."""
    v = leak_verdict(checklist, run(3), idle_before=IDLE, idle_after={})
    assert v.status is Status.INCONCLUSIVE and "no worker's KV blocks could be read" in v.reason
    one = {k: n for k, n in IDLE.items() if k != "decode-1"}
    v = leak_verdict(checklist, run(3), idle_before=IDLE, idle_after=one)
    assert v.status is Status.INCONCLUSIVE
    assert "the KV blocks of decode-1 could not be read once the load drained" in v.reason
    assert v.evidence["kv"]["unread_after"] == ["decode-1"]
    assert "could not be read" in v.evidence["kv"]["workers"]["decode-1"]["note"]


def test_a_slope_whose_interval_straddles_the_limit_is_undecided(checklist):
    """Catches a point comparison of the slope: an interval straddling the limit must be undecided."""
    samples = run(12, step_s=30.0, rss_mb_per_h={"decode-0": 256.0}, seed=1)
    noisy = [LeakSample(s.t, s.harness, tuple(
        w if w.id != "decode-0" else WorkerLeakReading(
            w.id, w.role, w.pid, w.health, w.kv_blocks_used, w.kv_blocks_total, w.num_running, w.active_requests,
            ProcessReading(w.pid, w.process.rss_bytes + int(((i * 7919) % 41 - 20) * MB), 40, 12))
        for w in s.workers)) for i, s in enumerate(samples)]
    v = leak_verdict(checklist, noisy, idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.INCONCLUSIVE, v.reason
    assert v.cause["code"] == "straddles" and v.cause["what"].startswith("RSS growth of decode-0 (pid 1001)")
    assert v.cause["threshold"] == "<= 256 MB/h"
    assert [u["key"] for u in undecided(v)] == ["rss_growth_mb_per_h"]


def test_remote_workers_without_process_readings_are_judged_on_kv_alone(checklist):
    """Catches growth rules that crash or fail on workers without /proc readings."""
    samples = [LeakSample(s.t, s.harness, tuple(WorkerLeakReading(w.id, w.role, None, w.health, w.kv_blocks_used,
                                                                  w.kv_blocks_total, w.num_running, w.active_requests)
                                                for w in s.workers)) for s in run(3)]
    v = leak_verdict(checklist, samples, idle_before=IDLE, idle_after=dict(IDLE))
    assert v.status is Status.PASS and v.layer("note")["text"] == "no process readings: growth not measured"
    assert v.evidence["series"]["decode-0"][0][1:4] == [None, None, None]


def test_the_verdict_says_it_is_outside_the_runs_false_fail_budget():
    """Catches soak.leaks claiming (or silently taking) a share of the run's 1 % false-fail budget:
    its slopes are plain 95 % intervals, so its evidence must say which method decided and that it
    is outside the budget (docs/soak.md 'Error rate'), and judge() must not re-level them."""
    from harness.checks.leaks import ERROR_CONTROL
    v = leak_verdict(Checklist.load(), [], idle_before={"decode-0": 0}, idle_after={"decode-0": 0})
    assert v.evidence["error_control"] == ERROR_CONTROL
    assert "outside the run's false-fail budget" in ERROR_CONTROL["budget"] and "95 %" in ERROR_CONTROL["method"]
    assert "false_fail_alpha" not in dict(Checklist.load().item("soak.leaks").thresholds)


def test_the_early_fail_needs_its_fewest_medians_and_span(checklist):
    """Catches the early fail's guards dropped (a bound from 5 medians, or from under early_span_s,
    failing a short run): with bins held at 30 s (``short_bin_s`` 30), a leak of 24,000 MB/h whose
    worker has 5 medians over 120 s after its warmup passes (6 medians needed), fails when 5 are
    allowed, and passes again when 120 s is under the span asked for. The shipped rules bin so short a
    span at 10 s: 13 medians, and the same leak fails early (planted: bins fixed at 30 s)."""
    from harness.checks.leaks import Rules

    samples = run(3.0, rss_mb_per_h={"decode-0": 24000.0})
    fixed = Rules(short_bin_s=30.0)
    v = leak_verdict(checklist, samples, idle_before=IDLE, idle_after=dict(IDLE), rules=fixed)
    worker = next(r for r in v.evidence["roles"] if r["unit"] == "worker decode-0")
    assert (worker["medians"], worker["span_s"]) == (5, 120.0) and worker["rss_mb_per_h"]["interval"]["lo"] > 4 * 256
    assert v.status is Status.PASS, v.reason
    five = leak_verdict(checklist, samples, idle_before=IDLE, idle_after=dict(IDLE),
                        rules=Rules(short_bin_s=30.0, early_points=5))
    assert five.status is Status.FAIL and "early fail" in five.reason and "5 medians" in five.reason
    longer = Rules(short_bin_s=30.0, early_points=5, early_span_s=121.0)
    assert leak_verdict(checklist, samples, idle_before=IDLE, idle_after=dict(IDLE), rules=longer).status is Status.PASS
    shipped = leak_verdict(checklist, samples, idle_before=IDLE, idle_after=dict(IDLE))
    worker = next(r for r in shipped.evidence["roles"] if r["unit"] == "worker decode-0")
    assert (worker["medians"], worker["bin_s"]) == (13, 10.0), worker
    assert shipped.status is Status.FAIL and "early fail" in shipped.reason, shipped.reason
