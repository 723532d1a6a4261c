"""The soak as users run it (issue 27 acceptance, the CI-sized version): a real subprocess of
`pytest suites/test_soak.py --soak=2m --soak-faults-per-min=4 --soak-seed=24` on the real bundled
cluster, honest and with a planted KV leak (40 s of the same seed: its kill is all a leak per
recovered request needs); the real run injects the schedule a dry run of its seed plans. Seed 24 at 4 faults a minute puts all six kinds in two minutes, the kill first (its
restart has the most to do) and four of them overlapping; 3m at 2 a minute held five kinds and cost
CI two more minutes.

No override: the honest run is clusters/local.yaml under the shipped checklist (the fault rule's
3 s, soak.slo's window rule as shipped), the leaky one clusters/local-leaky.yaml. The honest cluster
deserves pass on soak.faults, soak.slo, soak.leaks and nothing-lost; the only other outcome allowed
for soak.faults is inconclusive naming the starved test machine (the machine gate,
harness/checks/machine.py). soak.slo is not always decidable at this size, on
each window or on the whole run: with the window rule's Bonferroni correction a 40 s window of ~1000
requests holding a kill can straddle the p99 limit (measured: window 3, TTFT p99 75.7 ms, interval
51.2-708.4 ms, "about 4959 more requests would decide"; in CI 54.85-716.7 ms of 956 requests,
"more than 10x the requests would be needed to decide"), and the slow requests of 8 faults in two
minutes come in bursts: the whole run's 3035 requests were 306 effective ones for its TTFT p99
(serial dependence, tau 9.91; docs/statistics.md "Dependence"), too few for an upper bound. So
soak.slo is pass, or inconclusive naming the machine, or inconclusive only through windows (the
whole run among them) that straddle a limit saying how many requests would decide it; never fail,
never a window wholly beyond a limit.

Planted defects it catches: rescheduling delayed by 4 s (the honest run on clusters/local.yaml
with the router's `reschedule_delay_s: 4`), which the old 10 s override let pass (checked:
soak.faults fails, "rescheduled in 4.03 s > 3 s"); a soak.slo that fails an honest cluster (the old any-status check
accepted it); a leak the leak check misses (the leaky run must exit 1)."""

from __future__ import annotations

import json

import pytest

from harness.checklists import Checklist
from harness.checks.machine import MachineLimits, burst_starved, gate, starved
from harness.checks.verdict import Measurement, judge
from harness.stats.intervals import measured_within
from tests.harness.test_soak_dry_run import run

SOAK = ["--soak=2m", "--soak-faults-per-min=4", "--soak-seed=24", "--live=plain"]
LEAKY_SOAK = ["--soak=40s", "--soak-faults-per-min=4", "--soak-seed=24", "--live=plain"]
HONEST = "local"


def by_item(data: dict) -> dict[str, dict]:
    return {v["item"]: v for v in data["verdicts"]}


def starved_machine(verdict: dict) -> bool:
    """Inconclusive because the test machine was CPU-starved while it was measured, read from the
    machine gate's structured evidence (harness/checks/machine.py), not from the reason's words:
    the verdict's own recorded windows are over the limits it recorded (judged again here), and
    either the gate turned a decision into inconclusive (``evidence.machine.gated``) or the verdict
    was undecided by its intervals alone (at least one measured quantity open, and each such one
    with a bounded interval that straddles its limit). Any other inconclusive -- nothing measured, too few samples to bound, an error --
    is not excused by a busy machine, and neither is a reason that merely says "starved"."""
    if verdict["status"] != "inconclusive":
        return False
    machine = (verdict.get("evidence") or {}).get("machine") or {}
    limits = MachineLimits(**machine.get("limits", {}))
    windows = machine.get("windows", [])
    named = machine.get("starved") and any(starved(w, limits) for w in windows)
    # a VM steal burst the window's mean hides (harness/checks/machine.py steal_burst): named, not a mean
    burst = machine.get("steal_burst") and any(burst_starved(w, limits) for w in windows)
    if not (named or burst):
        return False
    if machine.get("gated") is not None:
        return machine["gated"].get("from") in ("fail", "pass")
    # open and measured (an unmeasured one beside them, as soak.faults lists, decides nothing either way)
    open_ = [m for m in verdict["evidence"].get("measurements") or []
             if m.get("holds") is not True and m.get("value") is not None]
    return bool(open_) and all(m.get("holds") is None and m.get("interval") and m["interval"].get("lo") is not None
                               and m["interval"].get("hi") is not None for m in open_)


def straddles_by_size(verdict: dict) -> bool:
    """An inconclusive verdict whose reason is a straddle that more requests would decide (in either
    of judge()'s wordings), never a resolution bound or any other inconclusive: what a healthy
    cluster may get when its slow requests come in bursts and leave too few effective requests for
    a p99 bound (docs/statistics.md "Dependence")."""
    return undecided_by_size({"ttft": verdict, "tpot": {"status": "pass"}})


def undecided_by_size(window: dict) -> bool:
    """A window left inconclusive only because its intervals straddle a limit (too few requests):
    the reason names the straddle and the requests that would decide it, either "about N more
    requests would decide" or, when the figure sits so close to the limit that 10x the window's
    requests would not, "more than 10x the requests would be needed to decide" (CI, 2026-12-06:
    window 3 of 956 requests, TTFT p99 54.85-716.7 ms). A straddle that more requests would not
    narrow (a resolution bound) or any other inconclusive is not excused."""
    parts = [window.get(m) or {} for m in ("ttft", "tpot")]
    open_ = [p for p in parts if p.get("status") != "pass"]
    return bool(open_) and all(p.get("status") == "inconclusive" and "straddles" in p.get("reason", "")
                               and ("more requests would decide" in p.get("reason", "")
                                    or "requests would be needed to decide" in p.get("reason", ""))
                               for p in open_)


def check_slo(slo: dict) -> None:
    """soak.slo as the honest cluster deserves it (module docstring)."""
    windows = slo["evidence"]["windows"]
    assert windows and all(w["status"] in ("pass", "inconclusive") for w in windows), windows
    # a window whose figure is past a limit while its interval is not wholly past it is evidence, not a
    # fail (harness/checks/soak.py): on the honest cluster a fault's burst of slow requests can put a
    # window's p99 point over 500 ms (CI 2026-12-06: window 3, TTFT p99 interval 68-733 ms); it must
    # then be undecided, never passed
    assert all(w["status"] == "inconclusive" for w in windows if w.get("beyond")), windows
    whole = [w for w in windows if w["window"] == "whole run"]
    assert len(whole) == 1 and (whole[0]["status"] == "pass" or starved_machine(slo) or undecided_by_size(whole[0])), \
        (whole, slo["reason"])
    if slo["status"] == "pass" or starved_machine(slo):
        return
    assert slo["status"] == "inconclusive", slo["reason"]
    undecided = [w for w in windows if w["status"] != "pass"]
    assert undecided and all(undecided_by_size(w) for w in undecided), (slo["reason"], undecided)


def check_honest(returncode: int, data: dict, out: str) -> None:
    """The verdicts the honest bundled cluster deserves (module docstring) and the exit code they make."""
    v = by_item(data)
    assert not data["harness_errors"] and not data["revert_failures"], data["harness_errors"]
    assert v["soak.faults"]["status"] == "pass" or starved_machine(v["soak.faults"]), v["soak.faults"]["reason"]
    check_slo(v["soak.slo"])
    assert v["soak.leaks"]["status"] == "pass", v["soak.leaks"]["reason"]
    assert v["nothing-lost"]["status"] == "pass", v["nothing-lost"]["reason"]
    assert returncode == (0 if all(x["status"] == "pass" for x in v.values()) else 2), out


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(2000)
def test_a_2_minute_soak_passes_the_honest_cluster_catches_a_planted_leak_and_replays_its_schedule(tmp_path):
    honest_proc, honest = run(tmp_path, "honest", f"--cluster={HONEST}", *SOAK)
    check_honest(honest_proc.returncode, honest, honest_proc.stdout[-4000:])
    kinds = {o["kind"] for o in honest["soak"]["outcomes"] if o["status"] == "recovered"}
    assert len(kinds) >= 5, honest["soak"]["by_kind"]

    # the leak needs only a recovery to show: 40 s of the same seed hold the kill of decode-1 at +20 s,
    # whose streams decode-0 recovers, leaking 8 blocks each (two minutes cost CI 80 s more, one 20 s)
    leaky_proc, leaky = run(tmp_path, "leaky", "--cluster=local-leaky", *LEAKY_SOAK)
    lv = by_item(leaky)
    assert leaky_proc.returncode == 1, leaky_proc.stdout[-4000:]
    assert lv["soak.leaks"]["status"] == "fail" and "decode-" in lv["soak.leaks"]["reason"], lv["soak.leaks"]["reason"]
    assert [f["kind"] for f in leaky["soak"]["schedule"]["faults"]] == ["process_kill"], leaky["soak"]["schedule"]

    # the same seed on the same inventory: the real run injected the schedule a dry run of it plans,
    # each fault as planned
    _, dry = run(tmp_path, "dry", f"--cluster={HONEST}", *SOAK, "--dry-run")
    assert honest["soak"]["schedule"] == dry["soak"]["schedule"]
    for data in (honest, leaky):
        planned = [(f["kind"], f["target"], f["offset_s"]) for f in data["soak"]["schedule"]["faults"]]
        assert [(o["kind"], o["target"], o["planned_offset_s"]) for o in data["soak"]["outcomes"]] == planned
        records = {r["fault_id"]: r for r in data["faults"] if r["action"] == "inject"}
        done = [o for o in data["soak"]["outcomes"] if o["status"] != "not injected"]
        assert len(done) >= len(planned) - 1, data["soak"]["outcomes"]
        for o in done:   # the fault runner's own record of it: that kind, on that worker, near its offset
            rec = records[o["fault_id"]]
            assert rec["kind"] == o["kind"], (rec, o)
            if o["kind"] not in ("nic_flap", "pfc_storm"):   # those name the worker's NIC and namespace
                assert o["target"] in rec["target"], (rec, o)
            assert o["planned_offset_s"] <= o["offset_s"] <= o["planned_offset_s"] + 60, o


CHECKLIST = Checklist.load()
STARVED_WINDOW = {"samples": 40, "psi_some_pct": 100.0, "watched_wait_per_run_ms": 8.5, "timer_lag_p99_ms": 900.0,
                  "load_generator_wait_share_pct": 85.0}
QUIET_WINDOW = {"samples": 40, "psi_some_pct": 40.0, "watched_wait_per_run_ms": 0.5, "timer_lag_p99_ms": 20.0,
                "load_generator_wait_share_pct": 30.0}


def _ttft(value: float | None, interval=None) -> dict:
    item = CHECKLIST.item("6.2.ttft")
    return judge(item, [Measurement(item.thresholds["ttft_p50_ms"], value, "TTFT p50", interval)])


def _gated(v, window: dict) -> dict:
    return json.loads(json.dumps(gate(v, [window]).to_dict()))


def test_the_starved_machine_allowance_reads_the_gate_s_evidence_not_the_reason():
    """Planted defect: the allowance that accepted any inconclusive whose reason says "test machine
    CPU-starved" (the old check here and in tests/test_bench_scale.py). It would excuse a verdict the
    machine gate did not make (a reason copied, windows under their limits) and an item that measured
    nothing on a busy machine; each must be refused, and a true gate's verdict accepted."""
    failed = _gated(_ttft(900.0), STARVED_WINDOW)           # a TTFT fail the gate made inconclusive
    assert failed["status"] == "inconclusive" and starved_machine(failed)
    straddle = _gated(_ttft(190.0, measured_within(190.0, below=20, above=20)), STARVED_WINDOW)
    assert straddle["status"] == "inconclusive" and starved_machine(straddle)   # undecided by its interval
    copied = {**failed, "evidence": {**failed["evidence"], "machine": {**failed["evidence"]["machine"],
                                                                       "windows": [QUIET_WINDOW]}}}
    assert "test machine CPU-starved" in copied["reason"] and not starved_machine(copied)   # windows not starved
    nothing = _gated(_ttft(None), STARVED_WINDOW)           # nothing measured, on a starved machine
    assert nothing["status"] == "inconclusive" and "test machine CPU-starved" in nothing["reason"]
    assert not starved_machine(nothing)
    assert not starved_machine(_gated(_ttft(100.0), STARVED_WINDOW))   # an absolute pass stays pass
    # a VM steal burst the window's mean hides (quiet otherwise): its straddle is excused, and not once
    # the windows no longer hold the burst; a fail or a pass beside it stands
    burst = {**QUIET_WINDOW, "start": 1000.0, "steal_pct": 3.0, "steal_burst_pct": 44.0, "steal_burst_start": 1078.0}
    in_burst = _gated(_ttft(190.0, measured_within(190.0, below=20, above=20)), burst)
    assert in_burst["status"] == "inconclusive" and starved_machine(in_burst)
    assert _gated(_ttft(900.0), burst)["status"] == "fail" and not starved_machine(_gated(_ttft(100.0), burst))
    burst_copied = {**in_burst, "evidence": {**in_burst["evidence"], "machine": {**in_burst["evidence"]["machine"],
                                                                                 "windows": [QUIET_WINDOW]}}}
    assert not starved_machine(burst_copied)



def _p99_window(extrapolate) -> dict:
    """A soak window whose TTFT p99 (300 ms) straddles the 500 ms limit, judged by the real judge()."""
    from harness.stats.interval import Interval
    item = CHECKLIST.item("6.2.ttft")
    interval = Interval(55.0, 717.0, 0.95, "order statistics", 956, noun="requests", extrapolate=extrapolate)
    v = judge(item, [Measurement(item.thresholds["ttft_p99_ms"], 300.0, "client TTFT p99", interval)])
    return {"ttft": {"status": v.status.value, "reason": v.reason}, "tpot": {"status": "pass", "reason": ""}}


def test_a_window_undecided_by_its_size_is_excused_in_both_wordings_and_nothing_else():
    """The soak's honest allowance (undecided_by_size) takes a straddle that more requests would
    decide, in either wording judge() gives it ("about N more", "more than 10x"), and refuses a
    resolution-bound straddle and a pass/fail window. Planted defect: the helper requiring only the
    "about N more" wording (CI failed the honest soak on the other one, 2026-12-06); or accepting
    every inconclusive (the resolution-bound window would pass)."""
    from harness.stats.interval import Interval
    narrows = _p99_window(lambda k: Interval(250.0, 250.0 + 467.0 / k, 0.95, "order statistics", int(956 * k)))
    close = _p99_window(lambda k: Interval(55.0, 717.0, 0.95, "order statistics", int(956 * k)))
    resolution = _p99_window(None)
    assert "more requests would decide" in narrows["ttft"]["reason"] and undecided_by_size(narrows)
    assert "would be needed to decide" in close["ttft"]["reason"] and undecided_by_size(close)
    assert "resolution bound" in resolution["ttft"]["reason"] and not undecided_by_size(resolution)
    assert not undecided_by_size({"ttft": {"status": "fail", "reason": "straddles"}, "tpot": {"status": "pass"}})
    assert not undecided_by_size({"ttft": {"status": "pass"}, "tpot": {"status": "pass"}})


def test_a_window_past_a_limit_on_its_point_but_not_its_interval_is_evidence_not_a_failure_of_the_honest_run():
    """check_slo, the honest soak's rule for soak.slo: a window whose p99 point is past 500 ms while its
    interval straddles (``beyond``, undecided by its size) is allowed, as the product treats it (CI
    2026-12-06: window 3, 68-733 ms, failed the old check that forbade any such window). Planted
    defects: the same window passed although its point is past the limit; a window that failed."""
    close = _p99_window(lambda k: __import__("harness.stats.interval", fromlist=["Interval"]).Interval(
        55.0, 717.0, 0.95, "order statistics", int(956 * k)))
    beyond = {"window": 3, "status": "inconclusive", "beyond": ["TTFT p99"], **close}
    whole = {"window": "whole run", "status": "pass", "beyond": [], "ttft": {"status": "pass"}, "tpot": {"status": "pass"}}
    ok = {"status": "inconclusive", "reason": "window 3 straddles", "evidence": {"windows": [beyond, whole]}}
    check_slo(ok)
    with pytest.raises(AssertionError):
        check_slo({**ok, "evidence": {"windows": [{**beyond, "status": "pass"}, whole]}})
    with pytest.raises(AssertionError):
        check_slo({**ok, "evidence": {"windows": [{**beyond, "status": "fail"}, whole]}})
