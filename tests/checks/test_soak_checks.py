"""soak.faults and soak.slo verdicts from synthetic outcomes and records (pure checks)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from harness.checklists import Checklist
from harness.checks.reschedule import RescheduleSample
from harness.checks.soak import faults_verdict, judge_fault, slo_windows_verdict, window_edges
from harness.probes.client.record_digest import RecordDigest
from harness.checks.verdict import Status
from harness.probes.workers.rejoin import Rejoin
from harness.evidence.fault_marks import FaultMark
from harness.evidence.soak import ScheduledFault, SoakOutcome
from tests.checks.test_slo import rec

CHECKLIST = Checklist.load()


def outcome(i, kind="hbm_fill", target="decode-0", back_s=1.0, healthy=True, **kw):
    sf = ScheduledFault(i, 30.0 + i, kind, target, "decode", 5.0, 50.0 + i)
    o = SoakOutcome(sf, started_offset_s=30.0 + i, fault_id=f"f{i}", inject_wall=1000.0 + 60 * i, inject_s=0.01,
                    reverted_wall=1005.0 + 60 * i, **kw)
    if healthy:
        o.rejoin = Rejoin(target, 60.0, 1006.0 + 60 * i, watched=["kv_transfer events of the router"])
        if back_s is not None:
            o.rejoin.serving_wall = o.rejoin.healthy_wall + back_s
    return o


def sample(o, total_s):
    s = RescheduleSample(FaultMark(o.fault_id, o.fault.kind, o.fault.target, "decode", o.inject_wall, 0.01))
    s.detected_s, s.total_s = min(total_s, 1.0), total_s
    return s


def test_every_fault_recovered_by_its_rule_passes():
    outs = [outcome(i, kind=k) for i, k in enumerate(["hbm_fill", "process_kill", "ecc_poison", "process_hang",
                                                      "nic_flap", "pfc_storm"])]
    samples = [sample(o, 0.4) for o in outs if o.fault.kind.startswith("process")]
    v, judged = faults_verdict(CHECKLIST, outs, samples)
    assert v.status == Status.PASS, v.reason
    assert v.cause["code"] == "faults_recovered" and v.cause["summary"].startswith("6 of 6 scheduled faults injected (6 kinds")
    assert v.evidence["by_kind"]["process_kill"] == {"scheduled": 1, "recovered": 1, "not recovered": 0,
                                                     "undecided": 0, "not injected": 0}
    assert [j.reschedule_s for j in judged if j.outcome.fault.kind == "process_kill"] == [0.4]


def test_a_slow_reschedule_or_a_worker_never_back_fails_naming_it():
    outs = [outcome(i) for i in range(5)] + [outcome(5, kind="process_kill", target="decode-1")]
    v, _ = faults_verdict(CHECKLIST, outs, [sample(outs[-1], 4.2)])
    assert v.status == Status.FAIL and v.cause["code"] == "faults_not_recovered", v.reason
    assert v.cause["first"] == "#6 process_kill decode-1" and v.cause["why"].startswith("rescheduled in 4.20 s > 3 s")
    outs = [outcome(i) for i in range(5)] + [outcome(5, back_s=None)]
    v, _ = faults_verdict(CHECKLIST, outs, [])
    assert v.status == Status.FAIL and "decode-0 never carried traffic again" in v.cause["why"], v.reason
    outs = [outcome(i) for i in range(5)] + [outcome(5, back_s=75.0)]
    v, _ = faults_verdict(CHECKLIST, outs, [])
    assert v.status == Status.FAIL and "75.0 s after it was healthy (> 60 s)" in v.cause["why"], v.reason


def test_too_few_faults_or_a_stopped_schedule_is_inconclusive_never_a_pass():
    outs = [outcome(i) for i in range(3)] + [outcome(3, not_injected="decode-0 was not healthy and free within 120 s")]
    v, _ = faults_verdict(CHECKLIST, outs, [])
    assert v.status == Status.INCONCLUSIVE and v.cause["code"] == "undecided"
    assert v.cause["because"].startswith("3 faults injected, 5 needed") and "not healthy" in v.cause["because"]
    v, _ = faults_verdict(CHECKLIST, [outcome(i) for i in range(6)], [], stopped="stopped: a revert failed")
    assert v.status == Status.INCONCLUSIVE and "a revert failed" in v.reason


def test_judge_fault_straddling_reschedule_is_undecided():
    o = outcome(0, kind="process_hang")
    # the fault took effect somewhere in a 0.2 s inject step: 3.1 s measured is 2.9-3.1 s, across 3 s
    s = RescheduleSample(FaultMark("f0", "process_hang", "decode-0", "decode", o.inject_wall, 0.2))
    s.detected_s, s.total_s = 0.5, 3.1
    j = judge_fault(o, s, 3.0, 60.0)
    assert j.status == "undecided" and "straddles 3 s" in j.why, j.why


def test_windows_split_requests_by_send_time_and_a_slow_window_fails_soak_slo():
    # 400 requests a window: a p99 needs 368 for an upper bound
    fast = [rec(i, ttft_ms=50, tpot_ms=10) for i in range(0, 800)]
    slow = [rec(i, ttft_ms=900, tpot_ms=10) for i in range(800, 1200)]
    records = fast + slow
    t0 = min(r.start_wall_ns() for r in records) / 1e9
    t1 = max(r.start_wall_ns() for r in records) / 1e9 + 1
    digest = RecordDigest().add(records)
    assert [digest.client_samples(a, b)[0] for a, b in window_edges(t0, t1, 400)] == [400, 400, 400]
    v = slo_windows_verdict(CHECKLIST, records, t0, t1, 400)
    assert v.status == Status.FAIL and v.cause["code"] == "windows_missed", v.reason
    assert v.cause["where"] == "window 3 (+800-1200 s)" and "TTFT" in v.cause["first_reason"]
    assert [w["status"] for w in v.evidence["windows"]][:2] == ["pass", "pass"]
    v = slo_windows_verdict(CHECKLIST, fast, t0, t0 + 800, 400)
    assert v.status == Status.PASS and (v.cause["code"], v.cause["windows"]) == ("windows_met", 2), v.reason


def test_soak_windows_leave_out_the_requests_in_a_steal_burst_as_6_2_does_and_a_slow_cluster_still_fails():
    """A VM steal burst over 120 s of window 2 (600 s windows) (its requests at TTFT 900 ms) fails soak.slo when
    ignored; given the burst's span, the requests in flight then are left out of that window and of
    the whole run (counted per row and said in the reason) and the rest passes, as 6.2 judges
    (harness/checks/slo.py outside_bursts). A cluster slow everywhere still fails with the same span.
    Planted defects it fails on: the span not passed on to the windows (fail); the digest leaving out
    a request sent before the burst that was still in flight in it, or one that ended before it
    (the rows' counts would differ); leaving requests out turning a slow cluster's fail into a pass."""
    def run(base_ms):
        return [rec(i, ttft_ms=900 if 700 <= i < 820 else base_ms, tpot_ms=10) for i in range(0, 1800)]
    records = run(50)
    t0 = min(r.start_wall_ns() for r in records) / 1e9
    t1 = max(r.start_wall_ns() for r in records) / 1e9 + 1
    assert slo_windows_verdict(CHECKLIST, records, t0, t1, 600).status == Status.FAIL
    span = [(t0 + 699.1, t0 + 819.5)]
    digest = RecordDigest().add(records)
    # in flight touching the span: the 120 sent in it, and the one sent at 699 s (it ends at 699.2 s);
    # the one sent at 698 s ended at 698.2 s: kept
    assert digest.left_out(span) == 121 == len(records) - digest.client_samples(leave_out=span)[0]
    v = slo_windows_verdict(CHECKLIST, digest, t0, t1, 600, steal_bursts=span)
    assert v.status == Status.PASS, v.reason
    rows = v.evidence["windows"]
    assert [(w["requests"], w["left_out"]) for w in rows] == [(600, 0), (479, 121), (600, 0), (1679, 121)]
    assert v.evidence["steal_bursts"]["left_out"] == 121 and v.evidence["steal_bursts"]["requests"] == 1800
    assert "121 of 1800 requests left out" in v.reason
    slow = slo_windows_verdict(CHECKLIST, run(700), t0, t1, 600, steal_bursts=span)
    assert slow.status == Status.FAIL, slow.reason
    plain = slo_windows_verdict(CHECKLIST, records[:600], t0, t0 + 600, 600, steal_bursts=())
    assert "steal_bursts" not in plain.evidence and "left out" not in plain.reason


def test_on_a_starved_machine_a_slow_recovery_is_inconclusive_but_a_worker_never_back_still_fails():
    from harness.checks.machine import gate
    from tests.checks.test_machine_gate import STARVED

    outs = [outcome(i) for i in range(5)] + [outcome(5, kind="process_kill", target="decode-1")]
    slow, _ = faults_verdict(CHECKLIST, outs, [sample(outs[-1], 4.2)])
    assert slow.status == Status.FAIL
    gated = gate(slow, [STARVED])
    assert gated.status == Status.INCONCLUSIVE and gated.layer("machine")["would"] == "would have failed", gated.reason
    never, _ = faults_verdict(CHECKLIST, [outcome(i) for i in range(5)] + [outcome(5, back_s=None)], [])
    assert {m["key"]: m["holds"] for m in never.evidence["measurements"]}["faults_not_recovered"] is False
    assert gate(never, [STARVED]).status == Status.FAIL


class _Drawn(RecordDigest):
    """A digest whose client samples are drawn, per window, from a known distribution: the real
    slo_windows_verdict judges them (only the records are simulated)."""

    def __init__(self, rng, windows, per_window, ttft_median_ms):
        super().__init__()
        self.rows = [(rng.lognormal(np.log(ttft_median_ms), 0.3, per_window), rng.lognormal(np.log(20.0), 0.3, per_window))
                     for _ in range(windows)]

    def client_samples(self, start_wall=-np.inf, end_wall=np.inf, leave_out=()):
        assert not leave_out   # drawn samples have no send or end times to leave out by
        picked = [r for k, r in enumerate(self.rows) if start_wall <= k * 300.0 < end_wall]
        ttft = np.concatenate([a for a, _ in picked]) if picked else np.array([])
        tpot = np.concatenate([b for _, b in picked]) if picked else np.array([])
        return len(ttft), ttft.tolist(), tpot.tolist()


def _soak_statuses(trials, windows, ttft_median_ms, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        v = slo_windows_verdict(CHECKLIST, _Drawn(rng, windows, 400, ttft_median_ms), 0.0, windows * 300.0, 300.0)
        out.append(v)
    return out


@pytest.mark.timeout(120)
def test_soak_slo_false_fails_over_30_windows_stay_within_the_items_budget():
    """TTFT p50 exactly at its 200 ms target in each of 30 windows of 400 requests (a pass): the
    old rule (a window fails when its 95 % interval is wholly beyond) failed about half of such
    runs (issue 33: 0.51 at 600 a window). Catches windows judged at the single-measurement level instead of Bonferroni over
    (windows + whole run) x 4 percentiles, and a row that fails on its point figure.

    60 trials (was 150: 26 s on a loaded machine, now ~5 s): at the budget 0.12 wrong fails are
    expected and at most 2 allowed (P(3 or more) ~ 3e-4); planted, each window's fail-side bound
    at 2.5 % (the old 95 % rule) failed 31 of these 60, a row failing on its point figure every
    one. A Bonferroni divisor that is merely too small (budget / 4) fails ~1 run in 70 here, too
    few to see: the exact divisor is asserted from the evidence instead."""
    trials = 60
    verdicts = _soak_statuses(trials, 30, 200.0, seed=27)
    fails = sum(v.status is Status.FAIL for v in verdicts)
    budget = CHECKLIST.threshold("soak.slo", "false_fail_alpha").value
    assert fails <= budget * trials + 3 * math.sqrt(trials * budget) + 1, fails   # 0.3 expected at the budget: <= 2
    control = verdicts[0].evidence["error_control"]
    assert control["tests"] == 31 * 4 and control["fail_alpha"] == pytest.approx(budget / 124)
    assert "Bonferroni over 30 windows" in control["method"]
    beyond = sum(bool(w["beyond"]) for v in verdicts for w in v.evidence["windows"])
    assert beyond > trials * 30 * 0.3   # about half the windows' p50s are beyond: evidence, not fails


@pytest.mark.timeout(60)
def test_soak_slo_still_fails_a_slow_window_among_many():
    """A window 40 % over its TTFT p50 target among 30 still fails the controlled verdict, naming
    it: Bonferroni over 124 tests costs samples, not the power to see a slow window of 600 requests.
    Catches a correction so strict that no window can fail."""
    rng = np.random.default_rng(5)
    digest = _Drawn(rng, 30, 600, 100.0)
    digest.rows[12] = (rng.lognormal(np.log(280.0), 0.3, 600), digest.rows[12][1])
    v = slo_windows_verdict(CHECKLIST, digest, 0.0, 9000.0, 300.0)
    assert v.status == Status.FAIL and v.cause["where"] == "window 13 (+3600-3900 s)", v.reason


def test_soak_slo_counts_the_planned_windows_fixed_before_the_run():
    """The Bonferroni divisor comes from the soak's planned length (--soak), not from the windows
    the run happened to fill: a 2-hour soak (24 windows of 300 s) that stopped after 40 minutes
    still judges every bound at the budget / ((24 + 1) x 4); one that overran its plan counts the
    windows it has. Catches W counted after the run (a run that stopped early would spend a larger
    share per window than the plan fixed)."""
    rng = np.random.default_rng(8)
    budget = CHECKLIST.threshold("soak.slo", "false_fail_alpha").value
    short = slo_windows_verdict(CHECKLIST, _Drawn(rng, 8, 400, 100.0), 0.0, 2400.0, 300.0, planned_s=7200.0)
    control = short.evidence["error_control"]
    assert len(short.evidence["windows"]) == 9 and control["windows_planned"] == 24   # 8 windows + the whole run
    assert control["tests"] == 25 * 4 and control["fail_alpha"] == pytest.approx(budget / 100)
    over = slo_windows_verdict(CHECKLIST, _Drawn(rng, 8, 400, 100.0), 0.0, 2400.0, 300.0, planned_s=1200.0)
    assert over.evidence["error_control"]["tests"] == 9 * 4   # ran longer than planned: its 8 windows count
