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
react in time), at least one injection made. Whether the worker came back after the healthy value
was restored is evidence, not judged: un-draining is the cluster's policy.
"""

from __future__ import annotations

from typing import Sequence

from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Verdict, judge
from harness.scenarios.ecc_dcgm import QUIET_S, Injection

ITEM = "ecc"

WHAT_IT_EXERCISES = ("the cluster's GPU monitoring and health path (a DCGM field injection), not the memory: no KV "
                     "byte changed, so wrong tokens cannot follow and are not checked")


def dcgm_verdict(injections: Sequence[Injection], checklist: Checklist) -> Verdict:
    item = checklist.item(ITEM)
    t = item.thresholds
    budget = t["drain_after_injection_s"].value
    missed = [i for i in injections if i.drained_after_s is None or i.drained_after_s > budget]
    drained = [i.drained_after_s for i in injections if i.drained_after_s is not None]
    measurements = [
        Measurement(t["injections_not_drained"], len(missed),
                    f"ECC injections whose worker was not drained within {budget:g} s"),
        Measurement(t["drain_after_injection_s"], max(drained) if drained else None,
                    "slowest drain after an ECC injection"),
        Measurement(t["min_injections"], len(injections), "ECC injections made"),
    ]
    evidence = {"what_this_exercises": WHAT_IT_EXERCISES, "injections": [i.to_dict() for i in injections],
                "drained_by": "the worker's health URL leaving 200, or its running-requests gauge at 0 for "
                              f"{QUIET_S:g} s while the load kept arriving"}
    because = None
    if injections and all(i.problem for i in injections):
        because = injections[0].problem
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=because)
    if missed and verdict.status.value == "fail":
        i = missed[0]
        verdict.reason += (f" {i.worker} (GPU {i.gpu} on {i.host}) kept serving after a double-bit ECC error was "
                           f"injected into its monitoring ({WHAT_IT_EXERCISES.split(':')[0]}).")
    return verdict


__all__ = ["ITEM", "Injection", "QUIET_S", "WHAT_IT_EXERCISES", "dcgm_verdict"]
