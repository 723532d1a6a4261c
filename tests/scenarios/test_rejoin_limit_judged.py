"""6.1.4's ``rejoin_limit_s`` on a black-box cluster goes through ``judge()`` with the rejoin watch's
resolution: a worker is seen back at a poll, so the true time lies up to one poll interval (the
``resolution_s`` the watch measured) before it; still out when the watch gave up, it was out at
least that long (no upper bound)."""

from __future__ import annotations

import pytest

from harness.checklists import Checklist
from harness.checks.reschedule_blackbox import client_view_verdict, rejoin_interval, rejoin_measurement
from harness.checks.verdict import Status
from harness.probes.workers.rejoin import Rejoin
from tests.checks.test_reschedule_blackbox import T0, quick_faults


def back_after(s: float, resolution_s: float | None = 0.5, worker: str = "vllm-1") -> Rejoin:
    return Rejoin(worker, 60.0, T0, ["vllm:prompt_tokens on URL"], "vllm-router", T0 + s, served_wall=T0 + 1.0,
                  resolution_s=resolution_s)


def test_a_time_within_one_poll_of_the_limit_is_undecided_not_a_fail():
    """Planted defect: the bare point comparison (60.2 s > 60 s: fail) where the watch, polling
    every 0.5 s, saw the worker back at a poll up to 0.5 s after it was."""
    v = client_view_verdict(quick_faults(), Checklist.load(), rejoins=[("kill vllm-1", back_after(60.2))])
    assert v.status is Status.INCONCLUSIVE, v.reason
    [m] = [m for m in v.evidence["measurements"] if m["key"] == "rejoin_limit_s"]
    assert m["holds"] is None and m["interval"]["method"] == "measurement resolution"
    assert m["interval"]["lo"] == pytest.approx(60.2 - 0.501) and m["interval"]["hi"] == pytest.approx(60.201)


def test_clear_of_the_limit_by_more_than_a_poll_passes_or_fails():
    """Planted defect: an interval that ignores the resolution either way would still decide these;
    one wider than the poll period (e.g. the whole watch) would leave them undecided."""
    ok = client_view_verdict(quick_faults(), Checklist.load(), rejoins=[("kill vllm-1", back_after(58.0))])
    assert ok.status is Status.PASS, ok.reason
    out = client_view_verdict(quick_faults(), Checklist.load(), rejoins=[("kill vllm-1", back_after(61.0))])
    assert out.status is Status.FAIL and "kept vllm-1 out for 61 s" in out.reason


def test_a_worker_never_taken_back_fails_on_its_lower_bound_alone():
    """Planted defect: a worker still out when the watch gave up given an upper bound (its watched time)
    or left out of the measurement: the fail would become undecided, or a pass on the others."""
    never = Rejoin("vllm-1", 60.0, T0, ["vllm:prompt_tokens on URL"], "vllm-router", None, watched_s=150.0)
    i = rejoin_interval(never)
    assert i is not None and i.hi is None and i.lo == pytest.approx(150.0, abs=0.01)
    checklist = Checklist.load()
    m = rejoin_measurement(checklist.item("6.1.4"), [back_after(3.0), never])
    assert m is not None and m.decision() == "fail" and m.value == 150.0 and m.interval.hi is None
    # without a measured resolution, one poll period of the watch
    assert rejoin_interval(back_after(10.0, resolution_s=None)).lo == pytest.approx(10.0 - 0.501)
