"""ecc through DCGM: when a worker counts as drained after an injected ECC error, and the verdict."""

from harness.checks.ecc_dcgm import QUIET_S, Injection, dcgm_verdict
from harness.checklists import Checklist
from harness.checks.verdict import Status


def injection() -> Injection:
    return Injection("decode-0", "gpu-node-0", 0, "ecc_dbe_volatile", 1, t_inject=1000.0)


def test_a_health_url_leaving_200_or_not_answering_is_a_drain():
    i = injection()
    i.observe(0.5, 200, None, True)
    i.observe(1.0, 503, None, True)
    assert (i.drained_after_s, i.drained_how) == (1.0, "its health URL answered 503")
    gone = injection()
    gone.observe(2.0, 0, None, True)
    assert gone.drained_how == "its health URL stopped answering"


def test_no_running_request_for_the_quiet_time_counts_from_when_it_went_quiet():
    i = injection()
    for t, running in ((0.0, 3), (0.5, 1), (1.0, 0), (2.0, 0), (1.0 + QUIET_S - 0.1, 0)):
        i.observe(t, 200, running, True)
    assert i.drained_after_s is None  # not quiet long enough yet
    i.observe(1.0 + QUIET_S, 200, 0, True)
    assert i.drained_after_s == 1.0 and "no running request" in i.drained_how
    idle = injection()  # idle before the injection: a quiet gauge proves nothing
    for t in range(10):
        idle.observe(float(t), 200, 0, False)
    assert idle.drained_after_s is None


def test_drained_within_the_budget_passes_and_a_worker_still_serving_fails_naming_it():
    checklist = Checklist.load()
    ok = injection()
    ok.observe(12.0, 503, None, True)
    assert dcgm_verdict([ok], checklist).status == Status.PASS
    stuck = injection()
    stuck.observe(61.0, 200, 2, True)
    verdict = dcgm_verdict([stuck], checklist)
    assert verdict.status == Status.FAIL and "decode-0 (GPU 0 on gpu-node-0) kept serving" in verdict.reason
    assert "not the memory" in verdict.evidence["what_this_exercises"]
    late = injection()
    late.observe(74.5, 200, None, True)  # still serving after the 60 s budget (polls every 0.5 s)
    late.observe(75.0, 503, None, True)  # drained, but after it
    assert dcgm_verdict([late], checklist).status == Status.FAIL
    alone = injection()
    alone.observe(75.0, 503, None, True)  # drained by the first poll: any time in [0, 75] s
    assert dcgm_verdict([alone], checklist).status == Status.INCONCLUSIVE


def test_the_drain_time_is_judged_at_the_polls_resolution_not_as_a_bare_point():
    """Planted defect: the slowest drain compared as a point with the 60 s budget (its interval
    dropped). A drain the polls place in [59.0, 61.0] s (a poll 2 s apart: a slow health URL) is
    neither a pass nor a fail; one first seen at 60.0 s whose injection took effect up to 1 s before the clock started may have taken 61 s."""
    checklist = Checklist.load()
    slow_polls = injection()
    slow_polls.observe(59.0, 200, None, True)
    slow_polls.observe(61.0, 503, None, True)  # the point (61 s) would fail
    verdict = dcgm_verdict([slow_polls], checklist)
    assert verdict.status == Status.INCONCLUSIVE, verdict.reason
    m = next(m for m in verdict.evidence["measurements"] if m["key"] == "drain_after_injection_s")
    assert (m["interval"]["lo"], m["interval"]["hi"]) == (59.0, 61.0)
    long_inject = Injection("decode-0", "gpu-node-0", 0, "ecc_dbe_volatile", 1, t_inject=1000.0, effect_window_s=1.0)
    long_inject.observe(59.5, 200, None, True)
    long_inject.observe(60.0, 503, None, True, answered=60.2)  # the point (60 s) would pass
    assert dcgm_verdict([long_inject], checklist).status == Status.INCONCLUSIVE
    clear = injection()
    clear.observe(61.5, 200, None, True)
    clear.observe(62.0, 503, None, True)
    assert dcgm_verdict([clear], checklist).status == Status.FAIL
    quick = Injection("decode-0", "gpu-node-0", 0, "ecc_dbe_volatile", 1, t_inject=1000.0, effect_window_s=1.0)
    quick.observe(11.5, 200, None, True)
    quick.observe(12.0, 503, None, True, answered=12.1)
    assert dcgm_verdict([quick], checklist).status == Status.PASS


def test_a_quiet_gauge_drain_lies_between_the_last_busy_poll_and_the_first_quiet_one():
    """Planted defect: the quiet path's interval starting at the poll before the first quiet one
    when that poll's gauge was not read (a failed scrape says nothing about running requests)."""
    i = injection()
    for t, running in ((0.0, 3), (0.5, None), (1.0, 0), (1.0 + QUIET_S, 0)):
        i.observe(t, 200, running, True)
    assert i.drained_after_s == 1.0 and i.drained_within == (0.0, 1.0)
