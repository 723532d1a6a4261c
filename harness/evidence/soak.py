"""A soak's scheduled fault and what happened to it: planned by harness/scenarios/soak_schedule.py,
executed by harness/scenarios/soak.py, judged by harness/checks/soak.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from harness.evidence.fault_marks import FaultMark
from harness.probes.workers.rejoin import Rejoin


@dataclass(frozen=True)
class ScheduledFault:
    """One fault of the schedule. ``offset_s`` counts from the start of the soak's load."""

    index: int
    offset_s: float
    kind: str
    target: str          # worker id
    role: str
    hold_s: float
    planned_until_s: float   # offset + hold + planned recovery: the blast radius counts it until then

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        return (f"#{self.index + 1:<3} +{self.offset_s:7.1f} s  {self.kind:<13} {self.target:<10} "
                f"held {self.hold_s:4.1f} s")


@dataclass
class SoakOutcome:
    """What happened to one scheduled fault."""

    fault: ScheduledFault
    started_offset_s: float | None = None   # when its inject began, from the start of the load
    fault_id: str | None = None
    inject_wall: float | None = None
    inject_s: float = 0.0
    reverted_wall: float | None = None
    rejoin: Rejoin | None = None
    detail: str = ""                        # the inject step's own words (what it did)
    not_injected: str | None = None         # why it never took effect (the harness's, not the cluster's)
    error: str | None = None                # the fault failed in a way that is the cluster's doing

    @property
    def injected(self) -> bool:
        return self.inject_wall is not None and self.not_injected is None

    def mark(self) -> FaultMark | None:
        if not self.injected or self.fault.kind not in ("process_kill", "process_hang"):
            return None
        return FaultMark(self.fault_id or "", self.fault.kind, self.fault.target, self.fault.role,
                         self.inject_wall or 0.0, inject_s=self.inject_s)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("fault", "rejoin")}
        d["fault"] = self.fault.to_dict()
        d["rejoin"] = None if self.rejoin is None else {
            "back": self.rejoin.back, "after_healthy_s": self.rejoin.after_healthy_s,
            "healthy_wall": self.rejoin.healthy_wall, "serving_wall": self.rejoin.serving_wall,
            "watched_s": self.rejoin.watched_s}
        return d


__all__ = ["ScheduledFault", "SoakOutcome"]
