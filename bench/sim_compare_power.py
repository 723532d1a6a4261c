"""Simulated error rates and power of the figures `harness compare` judges beyond 6.2 and 6.1.4
(docs/compare.md, "Tolerances and error rates"): for each figure, at the sample counts a run has,
the share of seeded trials called regressed / within tolerance (improved counted as within) when the
truth is no change, exactly the tolerance, and twice the tolerance. Each bound at 0.5 % one-sided
(alpha 0.05 over the 10 figures of a whole main job).

    PYTHONPATH=. .venv/bin/python bench/sim_compare_power.py [--trials 200]
"""

from __future__ import annotations

import argparse
import random

from harness.compare import compare_figure
from harness.compare_samples import RttRatio

ALPHA_EACH = 0.005


def _shares(results: list[str]) -> str:
    n = len(results)
    reg = sum(r == "regressed" for r in results) / n
    ok = sum(r in ("within tolerance", "improved") for r in results) / n
    return f"{reg:.1%} / {ok:.1%}"


def _values(rng: random.Random, n: int, median: float, sigma: float) -> list[float]:
    return [median * rng.lognormvariate(0, sigma) for _ in range(n)]


def migration(trials: int, n: int, sigma: float, tol: float) -> list[str]:
    row = []
    for truth in (1.0, 1 + tol, 1 + 2 * tol):
        rng = random.Random(1)
        row.append(_shares([compare_figure("6.1.2", "ttft_delta_idle_ms", _values(rng, n, 5.0, sigma),
                                           _values(rng, n, 5.0 * truth, sigma), tol, ALPHA_EACH).status
                            for _ in range(trials)]))
    return row


def line_rate(trials: int, n: int, sigma: float, tol: float) -> list[str]:
    row = []
    for truth in (1.0, 1 - tol, 1 - 2 * tol):
        rng = random.Random(2)
        row.append(_shares([compare_figure("6.1.1", "line_rate_fraction", _values(rng, n, 0.95, sigma),
                                           _values(rng, n, 0.95 * truth, sigma), tol, ALPHA_EACH).status
                            for _ in range(trials)]))
    return row


def rtt(trials: int, n: int, sigma: float, tol: float) -> list[str]:
    row = []
    for truth in (1.0, 1 + tol, 1 + 2 * tol):
        rng = random.Random(3)

        def run(factor: float) -> RttRatio:
            return RttRatio(_values(rng, n, 0.22 * factor, sigma), _values(rng, n, 0.2, sigma), 0.0)
        row.append(_shares([compare_figure("6.1.5", "tcp_p99_latency_ratio", run(1.0), run(truth), tol,
                                           ALPHA_EACH).status for _ in range(trials)]))
    return row


def lost(trials: int, n: int, p: float, tol: float) -> list[str]:
    row = []
    for rise in (0.0, tol, 2 * tol):
        rng = random.Random(4)

        def count(q: float) -> tuple[int, int]:
            return sum(rng.random() < q for _ in range(n)), n
        row.append(_shares([compare_figure("nothing-lost", "requests_without_final_state", count(p), count(p + rise),
                                           tol, ALPHA_EACH).status for _ in range(trials)]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    t = parser.parse_args().trials
    print("| figure | samples a run | spread | tolerance | no change | at the tolerance | twice the tolerance |")
    print("|---|---|---|---|---|---|---|")
    for n, sigma in ((8, 0.3), (8, 0.6), (16, 0.3), (16, 0.6), (32, 0.3), (32, 0.6)):
        print(f"| 6.1.2 delta p50 | {n} migrations | sigma {sigma} | +50 % |", " | ".join(migration(t, n, sigma, 0.5)), "|")
    for n, sigma in ((9, 0.005), (9, 0.02), (25, 0.02)):
        print(f"| 6.1.1 line-rate fraction | {n} transfers | sigma {sigma} | -5 % |",
              " | ".join(line_rate(t, n, sigma, 0.05)), "|")
    for n, sigma in ((2000, 0.3), (5000, 0.3), (5000, 0.6)):
        print(f"| 6.1.5 p99 RTT ratio | {n} + {n} round trips | sigma {sigma} | +25 % |", " | ".join(rtt(t, n, sigma, 0.25)), "|")
    for n, p in ((700, 0.0), (3000, 0.0), (3000, 0.005)):
        print(f"| lost requests | {n} requests | baseline {p:.1%} | +1 pt |", " | ".join(lost(t, n, p, 0.01)), "|")


if __name__ == "__main__":
    main()
