"""The power of 6.1.5's p99 latency verdict, simulated through the real code path: round trips
drawn per round as the scenario takes them (harness/scenarios/pfc_isolation.py: RR_S of round
trips every RR_INTERVAL_MS, about SIDE_SHARE of them on each side, FLOOR_S of loopback round trips
split the same way, so each side carries its own floor, as ``InterleavedStorm.sides`` gives them), judged by ``pfc_isolation_verdict`` under the extension loop
(``repeat_until_decided``: first after one round, then at most 2 rounds at a time up to the
checklist's ``max_repeats``), at the error levels ``judge()`` spends.

The shapes (docs/statistics.md, "6.1.5's power"): calm p99 0.6 ms (the quiet p99s of 0.58-0.66
ms in the docs), the storm side at p99 x the true ratio (2.0 must fail at 1.5x; 1.0 must not),
either **light-tailed** (lognormal, p50 0.25 ms on both sides: the docs' "p50 unchanged" during
the storm) or with the **heavy tail fitted** to the widths of the recorded 6.1.5 intervals (Pareto,
Q(u) = s (1 - u) ** -XI, XI = 0.6: 0.64 [0.52-0.83] after 8 rounds, 0.95 [0.75-1.20] after 6,
0.63 [0.45-0.84] after 3); loopback round trips lognormal with p50 0.066 and p99 0.36 ms (measured
here over 127.0.0.1) on the calm side, and on the storm side, where the storm's own tc commands
run on the same host, a p99 of 0.45 ms (STORM_FLOOR_P99: the measured storm / calm loopback p99s,
0.31 / 0.12 ms, put it higher than the calm one; 0.45 keeps it under the calm network p99, where a
real fabric's figures sit: a storm-side floor above the calm p99 becomes the base, evidence
``rtt_floor.by_side_p99_ms``). Bulk flows are held at 7 a side, under the bootstrap's minimum of 8: the
throughput ratio never decides, so a FAIL is the latency ratio's alone and a healthy trial runs
every look (the most chances for a wrong fail).
"""

from __future__ import annotations

import math

import numpy as np

from harness.checklists import Checklist
from harness.checks.extend import repeat_until_decided
from harness.checks.fabric import ITEM_PFC_ISOLATION, pfc_isolation_verdict
from harness.checks.verdict import Status
from harness.fabric.tcpprobe import class_sample
from harness.scenarios.pfc_isolation import FLOOR_S, RR_INTERVAL_MS, RR_S

CHECKLIST = Checklist.load()
SIDE_SHARE = 0.425     # of a round's round trips on each side (3.2 s groups and gaps, 0.5 s settle, edges)
XI = 0.6               # the fitted tail
Z99 = 2.3263478740408408
STORM_FLOOR_P99 = 0.45  # the storm side's loopback p99 (module docstring)
FLOWS = [9e8 * (1 + 0.01 * k) for k in range(7)]


def _pareto(rng: np.random.Generator, p99: float, n: int) -> list[float]:
    return (p99 / 100 ** XI * (1 - rng.random(n)) ** -XI).tolist()


def _lognormal(rng: np.random.Generator, p50: float, p99: float, n: int) -> list[float]:
    return np.exp(rng.normal(math.log(p50), math.log(p99 / p50) / Z99, n)).tolist()


def simulate(ratio: float, trials: int, seed: int, *, floor_p99: float = 0.36, storm_floor_p99: float = STORM_FLOOR_P99,
             heavy: bool = True) -> dict[str, int]:
    """Final statuses of ``trials`` simulated 6.1.5 runs whose true p99 ratio is ``ratio``."""
    rng = np.random.default_rng(seed)
    most = int(CHECKLIST.threshold(ITEM_PFC_ISOLATION, "max_repeats").value)
    side = int(RR_S * 1000 / RR_INTERVAL_MS * SIDE_SHARE)
    floor_side = int(FLOOR_S * 1000 / RR_INTERVAL_MS * SIDE_SHARE)
    out: dict[str, int] = {}
    for _ in range(trials):
        calm: list[float] = []
        storm: list[float] = []
        floor: list[float] = []
        storm_floor: list[float] = []
        rounds = [0]

        def one_round() -> None:
            if heavy:
                calm.extend(_pareto(rng, 0.6, side))
                storm.extend(_pareto(rng, 0.6 * ratio, side))
            else:
                calm.extend(_lognormal(rng, 0.25, 0.6, side))
                storm.extend(_lognormal(rng, 0.25, 0.6 * ratio, side))
            floor.extend(_lognormal(rng, 0.066, floor_p99, floor_side))
            storm_floor.extend(_lognormal(rng, 0.066, storm_floor_p99, floor_side))
            rounds[0] += 1

        def more(k: int) -> None:   # InterleavedStorm.more: at most 2 rounds before judging again
            for _ in range(min(k, 2)):
                one_round()

        def judged() -> list:
            return [pfc_isolation_verdict(CHECKLIST, class_sample("calm", calm, FLOWS, 0.0, 1.0, floor),
                                          class_sample("during", storm, FLOWS, 0.0, 1.0, storm_floor), None, {})]

        (v,) = repeat_until_decided(judged, more, lambda: rounds[0], first=1, most=most, noun="rounds")
        out[v.status.value] = out.get(v.status.value, 0) + 1
    return out


def test_a_doubled_p99_fails_at_least_four_times_in_five_on_a_light_tail():
    """Planted defect: the fixed 1 ms floor under the calm p99 (the old RTT_NOISE_FLOOR_MS): it read
    this 2x ratio as 1.2 / 1.0 and never failed it. With the floor measured beside the calm side
    (0.36 ms, under the calm p99) a true ratio 2.0 must FAIL in at least 80 % of runs."""
    got = simulate(2.0, 50, seed=1, heavy=False)
    assert got.get("fail", 0) >= 40, got


def test_on_the_fitted_heavy_tail_a_doubled_p99_is_never_passed():
    """Planted defect: a floor or level that flatters the calm side into a pass. On the tail fitted
    to the recorded intervals the default pace mostly leaves a true 2x undecided at the per-look
    levels (docs/statistics.md: about 1 in 10 fails), but it must never pass."""
    got = simulate(2.0, 20, seed=3)
    assert got.get("pass", 0) == 0 and got.get("fail", 0) >= 1, got


def test_a_healthy_storm_side_never_fails():
    """Planted defect: a floor, level or ratio that reads noise as spreading. A true ratio 1.0
    must not fail (the false-fail budget of 6.1.5 is 0.15 %), on either tail."""
    for heavy in (True, False):
        got = simulate(1.0, 8, seed=2, heavy=heavy)
        assert got.get("fail", 0) == 0, (heavy, got)
