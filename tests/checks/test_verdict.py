import json

import pytest

from harness.checklists import Checklist
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
    assert v.cause == {"code": "met", "key": "reschedule_p100_s", "what": "p100 rescheduling time",
                       "figure": "1.25 s", "threshold": "<= 3 s", "more_met": 1}
    assert [m["holds"] for m in v.evidence["measurements"]] == [True, True]


def test_any_missed_threshold_fails_and_headlines_it(item4):
    v = judge(item4, [_m(item4, "reschedule_p100_s", 2.0), _m(item4, "reschedule_p95_s", 3.5, "p95 time")])
    assert v.status is Status.FAIL
    assert v.measured == 3.5
    assert v.cause == {"code": "missed", "key": "reschedule_p95_s", "what": "p95 time", "figure": "3.5 s",
                       "threshold": "<= 3 s", "why": item4.why}   # why it matters
    assert "\n" not in v.reason


def test_missing_measurement_or_thin_evidence_is_inconclusive(item4):
    v = judge(item4, [_m(item4, "reschedule_p100_s", None)])
    assert v.status is Status.INCONCLUSIVE and v.measured is None
    assert (v.cause["code"], v.cause["key"]) == ("not_measured", "reschedule_p100_s")
    v = judge(item4, [_m(item4, "reschedule_p100_s", 1.0)], inconclusive_because="only 1 kill per role")
    assert v.status is Status.INCONCLUSIVE and v.cause["code"] == "thin"
    assert v.cause["because"] == "only 1 kill per role"


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


# -- measurements with intervals (harness/stats/intervals.py) ---------------------------------

def _threshold(op, value=500.0):
    from harness.checklists import Threshold
    return Threshold(item="6.2.ttft", key="ttft_p99_ms", value=value, op=op, unit="ms", origin="test")


def _iv(lo, hi, n=412):
    from harness.stats.intervals import Interval
    return Interval(lo, hi, 0.95, "order statistics", n, noun="requests")


@pytest.fixture
def ttft():
    return Checklist.load().item("6.2.ttft")


# per op: an interval wholly on the good side, one wholly beyond, one that straddles
@pytest.mark.parametrize("op, good, bad, straddling", [
    ("<", (450, 499), (500, 560), (480, 560)),
    ("<=", (450, 500), (501, 560), (480, 560)),
    (">=", (500, 560), (450, 499.9), (480, 560)),
    (">", (501, 560), (450, 500), (480, 560)),
])
def test_an_interval_passes_or_fails_only_as_a_whole(ttft, op, good, bad, straddling):
    t = _threshold(op)
    assert judge(ttft, [Measurement(t, sum(good) / 2, "p99", _iv(*good))]).status is Status.PASS
    failed = judge(ttft, [Measurement(t, sum(bad) / 2, "p99", _iv(*bad))])
    assert failed.status is Status.FAIL and failed.cause["code"] == "missed"
    assert failed.cause["figure"].endswith("95 %]")   # the figure carries its interval
    v = judge(ttft, [Measurement(t, 500.0, "client TTFT p99", _iv(*straddling))])
    assert v.status is Status.INCONCLUSIVE and v.cause["code"] == "straddles"
    assert v.evidence["undecided"][0]["key"] == "ttft_p99_ms"
    assert v.evidence["measurements"][0]["holds"] is None


@pytest.mark.parametrize("op, value, interval", [
    ("<", 300.0, (100.0, None)), ("<=", 300.0, (100.0, None)),     # all seen is good, no upper bound
    (">=", 700.0, (None, 900.0)), (">", 700.0, (None, 900.0)),     # all seen is good, no lower bound
])
def test_an_unbounded_side_never_passes(ttft, op, value, interval):
    t = _threshold(op)
    assert judge(ttft, [Measurement(t, value, "p99", _iv(*interval))]).status is Status.INCONCLUSIVE
    assert judge(ttft, [Measurement(t, value, "p99", _iv(None, None))]).status is Status.INCONCLUSIVE


def test_a_straddle_names_the_interval_and_what_would_decide(ttft):
    """Catches a reason that names the wrong branch for its data: 600 requests spread evenly over
    1-200 ms have a p99 near 198 ms, so against < 199.5 ms more requests narrow the interval onto
    the good side (a figure, checked against the extrapolation), while against < 198 ms, the
    observed p99 itself, no number within 10x ever decides."""
    from harness.stats.intervals import percentile_interval
    values = [float(v) for v in range(1, 201)] * 3   # 600 requests, p99 = 198 ms
    iv = percentile_interval(values, 99, noun="requests")
    v = judge(ttft, [Measurement(_threshold("<", 199.5), 198.0, "client TTFT p99", iv)])
    assert v.status is Status.INCONCLUSIVE
    assert v.cause["interval"] == "195-200 ms (lower 99.975 %, upper 99.5833 %, order statistics, n=600)"
    assert (v.cause["code"], v.cause["threshold"], v.cause["noun"]) == ("straddles", "< 199.5 ms", "requests")
    more = v.evidence["undecided"][0]["more_to_decide"]
    assert v.cause["more_to_decide"] == more and 600 < more < 5400 and not v.cause["resolution_bound"]
    oriented = iv.at(v.interval["alpha_lo"], v.interval["alpha_hi"])
    assert oriented.to_dict() == v.interval and Verdict.from_dict(json.loads(json.dumps(v.to_dict()))) == v
    assert oriented.extrapolate((600 + more) / 600).hi < 199.5        # that many more would pass it
    assert oriented.extrapolate((600 + more // 2) / 600).hi >= 199.5  # half as many would not
    at_p99 = judge(ttft, [Measurement(_threshold("<", 198.0), 198.0, "client TTFT p99", iv)])
    assert at_p99.status is Status.INCONCLUSIVE and at_p99.evidence["undecided"][0]["more_to_decide"] is None
    assert at_p99.cause["more_to_decide"] is None and not at_p99.cause["resolution_bound"]
    assert "more than 10x the requests would be needed to decide" in at_p99.reason   # its rendering, once


def test_a_fail_anywhere_wins_over_a_straddle_and_exact_counts_are_judged_as_before(item4):
    p100 = Measurement(item4.thresholds["reschedule_p100_s"], 2.9, "p100", _iv(2.8, 3.1))
    never = Measurement(item4.thresholds["faults_not_rescheduled"], 1, "faults never rescheduled")
    v = judge(item4, [p100, never])
    assert v.status is Status.FAIL and v.measured == 1 and v.interval is None
    v = judge(item4, [p100, Measurement(item4.thresholds["faults_not_rescheduled"], 0, "never")])
    assert v.status is Status.INCONCLUSIVE and v.interval["hi"] == 3.1
    ok = judge(item4, [Measurement(item4.thresholds["reschedule_p100_s"], 1.0, "p100", _iv(0.9, 1.1))])
    assert ok.status is Status.PASS and ok.cause["figure"] == "1 s [0.9-1.1, 95 %]"
