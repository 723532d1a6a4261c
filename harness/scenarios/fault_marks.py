"""The fault runner's record of a fault's inject step, which the process-fault scenarios read to mark
each injected fault (:class:`~harness.evidence.fault_marks.FaultMark`, in harness/evidence/: what the
checks judge)."""

from __future__ import annotations

from harness.evidence.fault_marks import FaultMark  # noqa: F401  (scenarios build marks beside injection())
from harness.faults.base import Action, Fault, FaultRecord
from harness.faults.runner import FaultRunner


def injection(faults: FaultRunner, fault: Fault) -> FaultRecord:
    """The fault runner's record of ``fault``'s inject step: its ``started_wall`` is when the fault
    began to take effect, its ``duration_s`` how long that took."""
    return next(r for r in faults.records if r.fault_id == fault.fault_id and r.action is Action.INJECT)


__all__ = ["injection"]
