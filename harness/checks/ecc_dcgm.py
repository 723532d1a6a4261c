"""Item ecc on a real cluster, through DCGM: a double-bit ECC error injected into a worker's GPU
monitoring (harness/faults/dcgm.py) must get that worker drained.

**What this exercises: the cluster's GPU monitoring and health path** (DCGM -> its node agent or
health checks -> the router), **not the memory**. No byte of HBM changes, so no wrong token can
follow and none is checked; the bundled engine's ECC suite (poisoned KV pages) is where served
pages are judged.

Per injection, the worker counts as drained from the first moment that either

* its health URL (``workers[].health``) stops answering 200, or
* its own metrics (``workers[].metrics``, the engine profile's running-requests gauge) show no
  running request for ``QUIET_S`` in a row while the load keeps arriving: the router stopped sending
  it work.

The injection and its polls are made by harness/scenarios/ecc_dcgm.py (``Injection``).
Judged: every injection drained within ``drain_after_injection_s`` (the cluster's health path must
react in time), at least one injection made. A drain time is known only to the polls' resolution:
it lies between the last poll that saw the worker serving and the answers of the one that saw it
drained, counted from when the injection was confirmed, plus the time from the inject step's start
to then on the upper side (the field took effect somewhere inside it); the slowest drain is judged
with that interval (``judge``: inconclusive when it straddles the budget). Whether the worker came back after the healthy value
was restored is evidence, not judged: un-draining is the cluster's policy.
"""

from __future__ import annotations

from typing import Sequence

from harness.checklists import Checklist, Threshold
from harness.checks.verdict import Measurement, Verdict, judge
from harness.evidence.ecc_dcgm import QUIET_S, Injection
from harness.stats.interval import Interval, decide
from harness.stats.intervals import RESOLUTION

ITEM = "ecc"

WHAT_IT_EXERCISES = ("the cluster's GPU monitoring and health path (a DCGM field injection), not the memory: no KV "
                     "byte changed, so wrong tokens cannot follow and are not checked")


def _slowest(limit: Threshold, injections: Sequence[Injection]) -> Measurement:
    """The slowest drain of polled injections, with the interval their polls give: [the largest
    lower bound, the largest upper bound] (none when a worker was not seen drained). A bare
    comparison of the poll that saw a drain with the budget passes or fails drains the polls cannot
    place on either side of it."""
    what = "slowest drain after an ECC injection"
    intervals = [iv for i in injections if (iv := i.interval()) is not None]
    if not intervals:
        return Measurement(limit, None, what)
    his = [iv.hi for iv in intervals]
    hi = None if None in his else max(h for h in his if h is not None)
    value = max(i.drained_after_s if i.drained_after_s is not None else i.watched_s or 0.0 for i in injections)
    return Measurement(limit, value, what + ("" if hi is not None else " (a worker not seen drained: at least)"),
                       interval=Interval(max(iv.lo or 0.0 for iv in intervals), hi, 1.0, RESOLUTION,
                                         len(intervals), noun="injections"))


def dcgm_verdict(injections: Sequence[Injection], checklist: Checklist) -> Verdict:
    item = checklist.item(ITEM)
    t = item.thresholds
    limit = t["drain_after_injection_s"]
    budget = limit.value
    bounds = {id(i): i.interval() for i in injections}
    # missed for certain: its whole interval is beyond the budget
    missed = [i for i in injections if bounds[id(i)] is not None and decide(bounds[id(i)], budget, limit.holds) == "fail"]
    unpolled = [i for i in injections if bounds[id(i)] is None]
    measurements = [
        Measurement(t["injections_not_drained"], len(missed),
                    f"ECC injections whose worker was not drained within {budget:g} s"),
        _slowest(limit, [i for i in injections if bounds[id(i)] is not None]),
        Measurement(t["min_injections"], len(injections), "ECC injections made"),
    ]
    evidence = {"what_this_exercises": WHAT_IT_EXERCISES, "injections": [i.to_dict() for i in injections],
                "drained_by": "the worker's health URL leaving 200, or its running-requests gauge at 0 for "
                              f"{QUIET_S:g} s while the load kept arriving"}
    because = None
    if injections and all(i.problem for i in injections):
        because = injections[0].problem
    elif unpolled:
        because = f"{unpolled[0].worker} was never polled after its injection (the load ended first)"
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=because)
    if missed and verdict.status.value == "fail":
        i = missed[0]
        verdict.add("note", sep=" ", text=f"{i.worker} (GPU {i.gpu} on {i.host}) kept serving after a double-bit ECC "
                    f"error was injected into its monitoring ({WHAT_IT_EXERCISES.split(':')[0]}).")
    return verdict


__all__ = ["ITEM", "Injection", "QUIET_S", "WHAT_IT_EXERCISES", "dcgm_verdict"]
