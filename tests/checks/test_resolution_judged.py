"""6.1.3's step-down time and trigger KV use, and 6.1.4's rejoin time (white-box), go through
``judge()`` with the resolution of whatever observed them: a figure within one poll (or one
rounding step) of its threshold is inconclusive, not pass or fail."""

from __future__ import annotations

import pytest

from harness.checklists import Checklist
from harness.checks.degradation import HBM_RESOLUTION, Step, degradation_verdict
from harness.checks.degradation_load import step_down_interval
from harness.checks.reschedule import rejoin_measurement
from harness.checks.verdict import Measurement, Status, judge
from harness.probes.loadgen.kv_drive import DriveResult, KvSample
from harness.probes.workers.rejoin import Rejoin

CHECKLIST = Checklist.load()
NS = 1_000_000_000
STEPS = [Step("s1", 0.8, 1, reached=1), Step("s2", 0.875, 2, reached=2), Step("s3", 0.925, 3, reached=3)]


def level(seq: int, a: int, b: int, hbm: float) -> dict:
    return {"seq": seq, "type": "degradation_level", "from_level": a, "to_level": b, "hbm": hbm, "reason": "r"}


def events(l2: float = 0.876, l3: float = 0.926) -> list[dict]:
    return [level(1, 0, 1, 0.80), level(2, 1, 2, l2), level(3, 2, 3, l3), level(4, 3, 0, 0.1)]


def measurement(v, key: str) -> dict:
    return next(m for m in v.evidence["measurements"] if m["key"] == key)


def test_a_step_down_within_one_poll_of_the_limit_is_inconclusive():
    """Planted defect: step_down_s compared as a bare point. Level 0 was seen by the poll at
    30.05 s, the poll before it (at 29.9 s) still saw a level: the step-down came in between, so
    against <= 30 s it is undecided; a bare comparison would fail it."""
    v = degradation_verdict(STEPS, events(), 30.05, CHECKLIST, step_down_after_s=29.9)
    assert v.status is Status.INCONCLUSIVE, v.reason
    m = measurement(v, "step_down_s")
    assert m["holds"] is None and m["interval"]["method"] == "measurement resolution"
    assert (m["interval"]["lo"], m["interval"]["hi"]) == pytest.approx((29.9, 30.05))
    # clear of the limit by more than the poll: decided either way
    assert degradation_verdict(STEPS, events(), 30.3, CHECKLIST, step_down_after_s=30.2).status is Status.FAIL
    assert degradation_verdict(STEPS, events(), 29.9, CHECKLIST, step_down_after_s=29.8).status is Status.PASS


def test_a_step_down_without_the_poll_before_it_is_bounded_by_the_revert():
    """Planted defect: a resolution assumed when the caller did not state one. Without the last
    poll that still saw a level, Level 0 came anywhere from the revert on: 31 s cannot fail."""
    v = degradation_verdict(STEPS, events(), 31.0, CHECKLIST)
    assert v.status is Status.INCONCLUSIVE and measurement(v, "step_down_s")["interval"]["lo"] == 0.0
    assert "not stated" in v.evidence["resolution"]["step_down_s"]


def test_kv_use_at_the_trigger_threshold_is_judged_with_its_rounding():
    """Planted defect: trigger_utilization compared as a bare point. The router records KV use
    rounded to 4 decimals: a recorded 0.85 may have been 0.84996 (entered early), so it is
    inconclusive; a bare comparison would pass it."""
    at = degradation_verdict(STEPS, events(l2=0.85), 5.0, CHECKLIST, step_down_after_s=4.9)
    assert at.status is Status.INCONCLUSIVE, at.reason
    m = measurement(at, "trigger_utilization")
    assert (m["interval"]["lo"], m["interval"]["hi"]) == pytest.approx((0.85 - HBM_RESOLUTION, 0.85 + HBM_RESOLUTION))
    early = degradation_verdict(STEPS, events(l2=0.8498), 5.0, CHECKLIST, step_down_after_s=4.9)
    assert early.status is Status.FAIL and "Level 2 was entered" in early.reason
    assert degradation_verdict(STEPS, events(l2=0.8502), 5.0, CHECKLIST, step_down_after_s=4.9).status is Status.PASS


def _drive(samples: list[tuple[float, float]], step_down: float | None, stopped: float = 20.0) -> DriveResult:
    return DriveResult([KvSample(int(t * NS), kv, 8) for t, kv in samples], [], {0: int(2 * NS)}, int(stopped * NS),
                       int((stopped + 1) * NS), step_down, "every threshold crossed and held", 2.0, 8)


def test_by_load_the_step_down_lies_between_two_kv_samples():
    """Planted defect: the by-load step-down judged as a bare point. KV use still read 0.85 at
    29.7 s after the stop and 0.2 at the next sample (read back at 30.2 s): against <= 30 s undecided."""
    drive = _drive([(5, 0.9), (20.5, 0.9), (49.7, 0.85), (50.0, 0.2)], 30.2)
    i = step_down_interval(drive, 0.8, 60.0)
    assert (i.lo, i.hi) == pytest.approx((29.7, 30.2)) and i.method == "measurement resolution"
    t = CHECKLIST.item("6.1.3").thresholds["step_down_s"]
    assert Measurement(t, 30.2, "step down", i).decision() is None
    assert Measurement(t, 30.2, "step down").decision() == "fail"   # what the bare point said
    never = step_down_interval(_drive([(5, 0.9), (25, 0.9)], None), 0.8, 60.0)
    assert never.lo == 60.0 and never.hi is None and Measurement(t, 60.0, "never", never).decision() == "fail"


def back_after(s: float, resolution_s: float | None = 0.5) -> Rejoin:
    return Rejoin("decode-1", 60.0, 1000.0, ["engine:prompt_tokens"], "the router", 1000.0 + s,
                  served_wall=1001.0, resolution_s=resolution_s)


def test_the_white_box_rejoin_time_is_judged_with_the_watchs_poll():
    """Planted defect: rejoin_limit_s compared as a bare point in checks/reschedule.py. Seen back at
    60.2 s by a watch whose previous poll was 0.5 s earlier: undecided against <= 60 s, not a fail;
    one still out after 70 s of watching fails on its lower bound alone."""
    item = CHECKLIST.item("6.1.4")
    near = rejoin_measurement(item, [back_after(3.0), back_after(60.2)])
    assert near is not None and near.decision() is None and near.value == pytest.approx(60.2)
    assert near.interval.lo == pytest.approx(60.2 - 0.501) and near.interval.hi == pytest.approx(60.201)
    assert judge(item, [near]).status is Status.INCONCLUSIVE
    assert rejoin_measurement(item, [back_after(61.0)]).decision() == "fail"
    assert rejoin_measurement(item, [back_after(58.0)]).decision() == "pass"
    never = Rejoin("decode-1", 60.0, 1000.0, ["engine:prompt_tokens"], "the router", None, watched_s=70.0)
    out = rejoin_measurement(item, [back_after(3.0), never])
    assert out.interval.hi is None and out.decision() == "fail"
    short = Rejoin("decode-1", 60.0, 1000.0, ["engine:prompt_tokens"], "the router", None, watched_s=30.0)
    assert rejoin_measurement(item, [short]).decision() is None   # still out after 30 s: not yet decided
