"""Soak verdicts (checklist items ``soak.faults`` and ``soak.slo``): every fault of a long run judged
by its item's rule, and the 6.2 latency targets judged per window and over the whole run.

Rules per fault (harness/scenarios/soak.py records what happened):
- every kind: after its revert the router serves through the worker again (moves a request's KV
  through it) within ``rejoin_limit_s`` of its being healthy; a worker never back is not recovered;
- ``process_kill`` / ``process_hang``: besides, 6.1.4's rescheduling (worker declared down, every
  affected request re-placed, a new request served) within ``reschedule_p100_s``, judged on the
  interval its clocks give (harness/checks/reschedule.py); on a cluster without router events, 6.1.4's
  client-view measurement instead (the streams on the victim ended, a new request served, from the
  client's records alone: harness/checks/soak_client_view.py);
- a worker whose way back cannot be observed (no metrics of it, no router view) is undecided, never passed;
- a fault the harness could not inject (its target never healthy and free, the engine refused an
  ECC poisoning with nothing in use) is not judged and is named: too few judged faults is inconclusive.

Pure: records and thresholds in, verdicts out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from harness.checklists import Checklist
from harness.checks.reschedule import RescheduleSample
from harness.checks.machine import LIMITS
from harness.checks.slo import BURST_RULE, slo_verdicts_of
from harness.checks import reasons
from harness.checks.verdict import Measurement, Status, Verdict, judge
from harness.stats import levels
from harness.stats.intervals import across
from harness.probes.client.record_digest import RecordDigest
from harness.probes.client.records import RequestRecord
from harness.evidence.soak import SoakOutcome

FAULTS_ITEM, SLO_ITEM = "soak.faults", "soak.slo"


@dataclass
class FaultJudgement:
    outcome: SoakOutcome
    status: str            # "recovered", "not recovered", "undecided", "not injected"
    why: str
    reschedule_s: float | None = None
    cause: str | None = None   # of a fault not recovered: the threshold key it missed (a timing) or None

    def to_dict(self) -> dict[str, Any]:
        f = self.outcome.fault
        r = self.outcome.rejoin
        return {"index": f.index + 1, "fault_id": self.outcome.fault_id, "kind": f.kind, "target": f.target, "planned_offset_s": f.offset_s,
                "offset_s": self.outcome.started_offset_s, "hold_s": f.hold_s, "status": self.status,
                "why": self.why, "reschedule_s": self.reschedule_s, "inject_wall": self.outcome.inject_wall,
                "reverted_wall": self.outcome.reverted_wall,
                "back_after_healthy_s": None if r is None else r.after_healthy_s, "detail": self.outcome.detail}


def judge_fault(o: SoakOutcome, sample: RescheduleSample | None, limit_s: float, rejoin_limit_s: float) -> FaultJudgement:
    f = o.fault
    if not o.injected:
        return FaultJudgement(o, "not injected", o.not_injected or o.error or "never injected")
    if o.error:
        return FaultJudgement(o, "not recovered", o.error)
    resched = None
    undecided = None
    if sample is not None:
        resched = sample.total_s
        iv = sample.interval
        if resched is None:   # a client-view sample names its problem (a stream cut, nothing served after)
            problem = getattr(sample, "problem", None)
            return FaultJudgement(o, "not recovered", "rescheduling never completed: "
                                  + (f"{problem} ({sample.breakdown})" if problem else sample.breakdown))
        if iv is not None and iv.lo is not None and iv.lo > limit_s:
            return FaultJudgement(o, "not recovered", f"rescheduled in {resched:.2f} s > {limit_s:g} s "
                                  f"({sample.breakdown})", resched, cause="reschedule_p100_s")
        if iv is not None and (iv.hi is None or iv.hi > limit_s):
            undecided = f"rescheduled in {resched:.2f} s {iv.brackets()} straddles {limit_s:g} s"
    r = o.rejoin
    if r is not None and not r.observable:   # no metrics of the worker nor a router view of it: unknown, not failed
        return FaultJudgement(o, "undecided", r.sentence(), resched)
    if r is None or not r.back:
        watched = "" if r is None else f" (watched {r.watched_s:.0f} s)"
        return FaultJudgement(o, "not recovered", f"{f.target} never carried traffic again{watched}", resched)
    back = r.after_healthy_s or 0.0
    if back > rejoin_limit_s:
        return FaultJudgement(o, "not recovered", f"{f.target} carried traffic {back:.1f} s after it was healthy "
                              f"(> {rejoin_limit_s:g} s)", resched, cause="rejoin_limit_s")
    if undecided:
        return FaultJudgement(o, "undecided", undecided, resched)
    why = f"served through again {back:.1f} s after healthy"
    if resched is not None:
        why = f"rescheduled in {resched:.2f} s; " + why
    return FaultJudgement(o, "recovered", why, resched)


def faults_verdict(checklist: Checklist, outcomes: Sequence[SoakOutcome], samples: Sequence[RescheduleSample], *,
                   stopped: str | None = None, schedule: dict[str, Any] | None = None,
                   by_fault_id: Mapping[str, Any] | None = None,
                   judged_by: str = "router events") -> tuple[Verdict, list[FaultJudgement]]:
    """``soak.faults``: ``samples`` are 6.1.4's measurements of the kill and hang faults from the
    router's events (their marks carry the fault id); ``by_fault_id``: fault id -> the client-view
    measurement instead (harness/checks/soak_client_view.py, a cluster without router events)."""
    item = checklist.item(FAULTS_ITEM)
    t = item.thresholds
    limit_s, rejoin_s = t["reschedule_p100_s"].value, t["rejoin_limit_s"].value
    by_id = {s.fault.fault_id: s for s in samples} | dict(by_fault_id or {})
    judged = [judge_fault(o, by_id.get(o.fault_id or ""), limit_s, rejoin_s) for o in outcomes]
    by_kind: dict[str, dict[str, int]] = {}
    for j in judged:
        row = by_kind.setdefault(j.outcome.fault.kind, {"scheduled": 0, "recovered": 0, "not recovered": 0,
                                                        "undecided": 0, "not injected": 0})
        row["scheduled"] += 1
        row[j.status] += 1
    failed = [j for j in judged if j.status == "not recovered"]
    undecided = [j for j in judged if j.status == "undecided"]
    injected = [j for j in judged if j.status != "not injected"]
    missing = [j for j in judged if j.status == "not injected"]
    need = int(t["min_faults"].value)
    kinds = sorted({j.outcome.fault.kind for j in injected})
    summary = (f"{len(injected)} of {len(judged)} scheduled faults injected ({len(kinds)} kinds: {', '.join(kinds)}), "
               f"{len(injected) - len(failed) - len(undecided)} recovered")
    # the status comes from judge() on three measurements (each fault's rule is one of them):
    # the slowest rescheduling on the faults' resolution bounds (p100 across them: it fails when one
    # fault's lower bound is beyond, passes when every upper bound is within), the longest wait for
    # traffic after healthy, and the faults never recovered from (an error, never back, never rescheduled)
    times = [(j.reschedule_s, iv) for j in injected if j.reschedule_s is not None
             and (iv := getattr(by_id.get(j.outcome.fault_id or ""), "interval", None)) is not None]
    backs = [b for j in injected if j.outcome.rejoin is not None and (b := j.outcome.rejoin.after_healthy_s) is not None]
    never = sum(j.cause is None for j in failed)
    slowest = max((s for s, _ in times), default=None)
    measurements = [
        Measurement(t["reschedule_p100_s"], None if slowest is None else round(slowest, 3),
                    "slowest rescheduling of a kill or hang",
                    across([iv for _, iv in times], 100, noun="faults") if times else None),
        Measurement(t["rejoin_limit_s"], None if not backs else round(max(backs), 3),
                    "longest wait for traffic through a recovered worker after it was healthy"),
        Measurement(t["faults_not_recovered"], float(never), "faults never recovered from")]
    because = None
    if stopped:
        because = f"the schedule {stopped}; {summary}"
    elif len(injected) < need:
        because = (f"{len(injected)} faults injected, {need} needed"
                   + (f"; not injected: {missing[0].why}" if missing else ""))
    elif undecided:
        because = f"#{undecided[0].outcome.fault.index + 1} {undecided[0].why}; {summary}"
    evidence = {"by_kind": by_kind, "faults": [j.to_dict() for j in judged],
                "schedule": schedule or {}, "kill_and_hang_judged_by": judged_by,
                "rules": {"reschedule_p100_s": limit_s, "rejoin_limit_s": rejoin_s}}
    judged_verdict = judge(item, [m for m in measurements if m.value is not None], evidence=evidence,
                           inconclusive_because=because)
    judged_verdict.evidence["measurements"] = [m.to_dict() for m in measurements]   # the unmeasured too (holds None)
    status = judged_verdict.status
    if status is Status.FAIL and failed:
        worst = failed[0]
        why = reasons.cause("faults_not_recovered", failed=len(failed), why=worst.why, summary=summary, item_why=item.why,
                            first=f"#{worst.outcome.fault.index + 1} {worst.outcome.fault.kind} {worst.outcome.fault.target}")
        causes: tuple[dict[str, Any], ...] = (why,)
    elif status is not Status.PASS:   # a fail no fault's rule names cannot happen; judge()'s own words then
        causes = ((reasons.cause("undecided", because=because),) if because and status is Status.INCONCLUSIVE
                  else judged_verdict.causes)
    else:
        causes = (reasons.cause("faults_recovered", summary=summary, reschedule_limit_s=limit_s, rejoin_limit_s=rejoin_s,
                                not_injected=len(missing)),)
    verdict = Verdict(item=FAULTS_ITEM, title=item.title, status=status, causes=causes,
                      measured=float(len(failed)), threshold=t["faults_not_recovered"].value,
                      unit=t["faults_not_recovered"].unit, op=t["faults_not_recovered"].op,
                      evidence=judged_verdict.evidence)
    return verdict, judged


def window_edges(start_wall: float, end_wall: float, window_s: float) -> list[tuple[float, float]]:
    """The windows of a run: [start + k*window_s, + window_s); the last may be shorter (at least
    half a window, else merged into the one before) and takes every request sent after the end."""
    edges = [start_wall]
    while edges[-1] + window_s < end_wall:
        edges.append(edges[-1] + window_s)
    if len(edges) > 1 and end_wall - edges[-1] < window_s / 2:
        edges.pop()
    edges.append(max(end_wall, edges[-1]))
    return list(zip(edges, edges[1:]))


def slo_windows_verdict(checklist: Checklist, records: Sequence[RequestRecord] | RecordDigest, start_wall: float,
                        end_wall: float, window_s: float, *, planned_s: float | None = None,
                        steal_bursts: Sequence[tuple[float, float]] = ()) -> Verdict:
    """``soak.slo``: 6.2's TTFT and TPOT targets in every window and over the whole run; a window
    fails on a percentile whose whole interval misses its target. ``records``: the run's records,
    or the digest a soak kept of them while it streamed them from disk.

    Error control (docs/statistics.md): every row (the windows and the whole run) judges 4
    percentiles, each bound that can fail it at soak.slo's ``false_fail_alpha`` / ((W + 1) x 4),
    W the windows of the run's planned length ``planned_s`` (``--soak``, fixed before the run; a
    run that ran longer: its windows), each bound that can pass it at ``false_pass_alpha``
    (Bonferroni: the chance that any row fails a healthy cluster stays within the item's budget
    however many windows a soak has, and a run that stopped early judges at the planned level). A window whose figure is beyond a target but whose interval is
    not wholly beyond at that level is evidence (``beyond``), not a fail.

    ``steal_bursts``: wall-clock spans of VM steal bursts (MachineMonitor.steal_spans): the requests in
    flight during one are left out of every row's percentiles as 6.2 leaves them out (BURST_RULE,
    harness/checks/slo.py), counted per row (``left_out``) and said in the verdict."""
    item = checklist.item(SLO_ITEM)
    digest = records if isinstance(records, RecordDigest) else RecordDigest().add(records)
    rows: list[dict[str, Any]] = []
    spans = window_edges(start_wall, end_wall, window_s)
    spans = [(a, b if k < len(spans) - 1 else math.inf) for k, (a, b) in enumerate(spans)] + [(-math.inf, math.inf)]
    planned = 0 if planned_s is None else len(window_edges(0.0, planned_s, window_s))
    windows_counted = max(len(spans) - 1, planned)   # fixed before the run, unless the run overran it
    tests = (windows_counted + 1) * 4   # (windows + the whole run) x (TTFT, TPOT) x (p50, p99)
    budget = item.thresholds[levels.FALSE_FAIL_KEY].value
    pass_alpha = item.thresholds[levels.FALSE_PASS_KEY].value
    control = levels.Spending(fail_alpha=budget / tests, pass_alpha=pass_alpha,
                              method=f"Bonferroni over {windows_counted} windows + the whole run x 4 percentiles")
    for k, (a, b) in enumerate(spans):
        whole = k == len(spans) - 1
        requests, ttft_ms, tpot_ms = digest.client_samples(a, b, leave_out=steal_bursts)
        with levels.spending(look=None, fail_alpha=control.fail_alpha, pass_alpha=pass_alpha, method=control.method):
            ttft, tpot = slo_verdicts_of(requests, ttft_ms, tpot_ms, checklist)
        shown_a, shown_b = (start_wall, end_wall) if whole else (a, min(b, end_wall))
        row = {"window": "whole run" if whole else k + 1, "start_s": round(shown_a - start_wall, 1),
               "end_s": round(shown_b - start_wall, 1), "requests": requests}
        if steal_bursts:
            row["left_out"] = digest.left_out(steal_bursts, a, b)
        for name, v in (("ttft", ttft), ("tpot", tpot)):
            row[name] = {"status": v.status.value, "reason": v.reason,
                         "p50_ms": next((m["value"] for m in v.evidence["measurements"] if m["key"].endswith("p50_ms")), None),
                         "p99_ms": next((m["value"] for m in v.evidence["measurements"] if m["key"].endswith("p99_ms")), None)}
        row["beyond"] = [f"{name} {m['key'].rsplit('_', 2)[1]}" for name, v in (("TTFT", ttft), ("TPOT", tpot))
                         for m in v.evidence["measurements"] if m["value"] is not None and m["holds"] is not True
                         and not checklist.threshold(v.item, m["key"]).holds(m["value"])]
        row["status"] = ("fail" if "fail" in (row["ttft"]["status"], row["tpot"]["status"]) else
                         "pass" if row["ttft"]["status"] == row["tpot"]["status"] == "pass" else "inconclusive")
        rows.append(row)
    windows = rows[:-1]
    failed = [r for r in rows if r["status"] == "fail"]
    open_ = [r for r in rows if r["status"] == "inconclusive"]
    t = item.thresholds["windows_failed"]
    if failed:
        w = failed[0]
        which = "ttft" if w["ttft"]["status"] == "fail" else "tpot"
        status = Status.FAIL
        label = "the whole run" if w["window"] == "whole run" else f"window {w['window']} (+{w['start_s']:.0f}-{w['end_s']:.0f} s)"
        why = reasons.cause("windows_missed", failed=len(failed), windows=len(rows), where=label,
                            first_reason=w[which]["reason"])
    elif open_:
        w = open_[0]
        which = "ttft" if w["ttft"]["status"] == "inconclusive" else "tpot"
        label = "the whole run" if w["window"] == "whole run" else f"window {w['window']}"
        status = Status.INCONCLUSIVE
        why = reasons.cause("undecided", because=f"{label}: {w[which]['reason'].removeprefix('inconclusive: ')}")
    else:
        whole = rows[-1]
        status = Status.PASS
        why = reasons.cause("windows_met", windows=len(windows), window_s=window_s, ttft_p99_ms=whole["ttft"]["p99_ms"],
                            tpot_p99_ms=whole["tpot"]["p99_ms"], requests=whole["requests"])
    verdict = Verdict(item=SLO_ITEM, title=item.title, status=status, causes=(why,),
                      measured=float(len([r for r in windows if r["status"] == "fail"])), threshold=t.value,
                      unit=t.unit, op=t.op,
                      evidence={"window_s": window_s, "windows": rows,
                                "error_control": control.to_dict(control.fail_alpha, pass_alpha,
                                                                 item_false_fail_alpha=budget, tests=tests,
                                                                 windows_planned=planned or None)})
    if steal_bursts:
        left_out, whole = rows[-1]["left_out"], rows[-1]
        seconds = sum(b - a for a, b in steal_bursts)
        verdict.evidence["steal_bursts"] = {
            "spans": [[round(a, 3), round(b, 3)] for a, b in steal_bursts], "seconds": round(seconds, 1),
            "left_out": left_out, "requests": whole["requests"] + left_out, "limit_pct": LIMITS.steal_leave_out_pct,
            "rule": BURST_RULE}
        if left_out:
            verdict.add("note", text=f"{left_out} of {whole['requests'] + left_out} requests left out: in flight "
                                     f"during {seconds:.0f} s of VM steal bursts (over {LIMITS.steal_leave_out_pct:g} % "
                                     "of the test machine's CPUs over 5 s)")
    return verdict
