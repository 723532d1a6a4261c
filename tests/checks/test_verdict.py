import json

import pytest

from harness.checks.thresholds import Checklist
from harness.checks.verdict import ExitCode, Measurement, Status, Verdict, exit_code_for, judge
from harness.errors import ConfigError


@pytest.fixture
def item4():
    return Checklist.load().item("6.1.4")


def _m(item, key, value, what="p100 rescheduling time"):
    return Measurement(item.thresholds[key], value, what)


def test_pass_reason_says_what_and_against_what(item4):
    v = judge(item4, [_m(item4, "reschedule_p100_s", 1.25), _m(item4, "reschedule_p95_s", 1.0, "p95")])
    assert v.status is Status.PASS
    assert (v.measured, v.threshold, v.unit, v.op) == (1.25, 3.0, "s", "<=")
    assert "1.25 s" in v.reason and "<= 3 s" in v.reason
    assert [m["holds"] for m in v.evidence["measurements"]] == [True, True]


def test_any_missed_threshold_fails_and_headlines_it(item4):
    v = judge(item4, [_m(item4, "reschedule_p100_s", 2.0), _m(item4, "reschedule_p95_s", 3.5, "p95 time")])
    assert v.status is Status.FAIL
    assert v.measured == 3.5 and "p95 time was 3.5 s, required <= 3 s" in v.reason
    assert item4.why in v.reason  # why it matters
    assert "\n" not in v.reason


def test_missing_measurement_or_thin_evidence_is_inconclusive(item4):
    v = judge(item4, [_m(item4, "reschedule_p100_s", None)])
    assert v.status is Status.INCONCLUSIVE and v.measured is None
    v = judge(item4, [_m(item4, "reschedule_p100_s", 1.0)], inconclusive_because="only 1 kill per role")
    assert v.status is Status.INCONCLUSIVE and "only 1 kill" in v.reason


def test_verdict_round_trips_through_json(item4):
    v = judge(item4, [_m(item4, "reschedule_p100_s", 1.0)], evidence={"kills": [{"worker": "decode-0"}]})
    again = Verdict.from_dict(json.loads(json.dumps(v.to_dict())))
    assert again == v and again.status is Status.PASS


def test_verdict_rejects_multiline_reason_and_nan():
    with pytest.raises(ConfigError):
        Verdict(item="x", title="t", status="pass", reason="a\nb")
    with pytest.raises(ConfigError):
        Verdict(item="x", title="t", status="pass", reason="r", measured=float("nan"))
    with pytest.raises(ValueError):
        Verdict(item="x", title="t", status="great", reason="r")


def _v(status):
    return Verdict(item="i", title="t", status=status, reason="r")


@pytest.mark.parametrize("statuses, harness_error, revert_failed, code", [
    (["pass", "pass"], False, False, ExitCode.CONFORMANT),
    (["pass", "fail", "inconclusive"], False, False, ExitCode.NOT_CONFORMANT),
    (["pass", "inconclusive"], False, False, ExitCode.INCONCLUSIVE),
    ([], False, False, ExitCode.INCONCLUSIVE),
    (["pass", "error"], False, False, ExitCode.HARNESS_ERROR),
    (["fail"], True, False, ExitCode.HARNESS_ERROR),
    (["fail", "error"], True, True, ExitCode.REVERT_FAILED),
])
def test_exit_code_precedence(statuses, harness_error, revert_failed, code):
    assert exit_code_for([_v(s) for s in statuses], harness_error=harness_error,
                         revert_failed=revert_failed) is code
