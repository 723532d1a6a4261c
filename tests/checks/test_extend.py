"""The suites' "measure more before saying inconclusive" loop, on samples drawn here from known
distributions (seeded) and judged by the real judge()."""

from __future__ import annotations

import numpy as np

from harness.checks.extend import measure_until_decided, repeat_until_decided
from harness.stats.intervals import percentile_interval
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Status, judge

ITEM = Checklist.load().item("6.2.ttft")
P50 = ITEM.thresholds["ttft_p50_ms"]   # < 200 ms


def _judge(values):
    return lambda: [judge(ITEM, [Measurement(P50, float(np.median(values)) if values else None, "client TTFT p50",
                                             percentile_interval(values, 50, noun="requests"))])]


def test_a_straddle_is_measured_further_until_decided():
    """Catches a loop that stops at the first straddle, one whose extensions do not at least double
    the samples (the budget would not be reached within the 5 looks), and evidence that does not
    say how many looks were used."""
    rng = np.random.default_rng(1)
    values: list[float] = []
    asked = []

    def repeat(k: int) -> None:
        asked.append(k)
        values.extend(rng.normal(190.0, 30.0, k).tolist())   # true median 190 ms, 10 ms from the limit

    (v,) = repeat_until_decided(_judge(values), repeat, lambda: len(values), first=10, most=2000, noun="requests")
    assert v.status is Status.PASS and len(asked) > 1 and asked[0] == 10
    assert all(k >= sum(asked[:i]) for i, k in enumerate(asked) if i)   # each extension at least doubles
    assert v.evidence["extension"] == {"rounds": len(asked) - 1, "looks": len(asked), "most_looks": 5,
                                       "budget": "at most 2000 requests", "stopped": "decided"}
    assert v.evidence["error_control"]["looks_used"] == len(asked) <= 5
    assert v.interval["hi"] < 200 and v.interval["n"] == len(values)


def test_the_budget_ends_it_and_the_reason_says_what_would_decide():
    rng = np.random.default_rng(2)
    values: list[float] = []
    (v,) = repeat_until_decided(_judge(values), lambda k: values.extend(rng.normal(195.0, 30.0, k).tolist()),
                                lambda: len(values), first=20, most=60, noun="requests")
    assert v.status is Status.INCONCLUSIVE and len(values) == 60
    assert "straddles < 200 ms; " in v.reason and "budget spent (at most 60 requests)" in v.reason
    assert v.evidence["extension"]["stopped"] == "budget spent (at most 60 requests)"


def test_without_an_estimate_it_doubles_and_without_progress_it_stops():
    """Catches a loop that asks for fewer samples than it has when no size within 10x decides (the
    looks would run out before the budget) and one that loops when nothing more was measured."""
    calls = []
    (v,) = measure_until_decided(_judge([190.0, 210.0] * 10), lambda k: calls.append(k) or False, budget="b")
    assert calls == [20]   # the median sits on the limit: no count within 10x decides it, so as many again
    assert v.status is Status.INCONCLUSIVE and v.evidence["extension"]["stopped"] == "budget spent (b)"
    (v,) = repeat_until_decided(_judge([150.0, 250.0] * 2), lambda k: None, lambda: 4, first=2, most=100,
                                noun="requests")
    assert v.evidence["extension"]["rounds"] == 0   # repeat() measured nothing: stop, never loop
