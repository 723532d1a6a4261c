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
    late.observe(75.0, 503, None, True)  # drained, but after the 60 s budget
    assert dcgm_verdict([late], checklist).status == Status.FAIL
