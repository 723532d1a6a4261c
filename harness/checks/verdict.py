"""Verdicts: what a check concluded about one checklist item, and the run's exit code.

A verdict is JSON-able and self-explaining: measured value, threshold, unit, evidence and a
one-line reason that says what was measured, against what, and why it matters. The exit code
of a whole run follows from its verdicts plus two harness-level facts (a harness error, a
failed revert); see ``docs/exit-codes.md``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from harness.checks.thresholds import ChecklistItem, Threshold
from harness.errors import ConfigError


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"  # not enough evidence to decide (too few samples, skipped)
    ERROR = "error"                # the check itself could not run


class ExitCode(enum.IntEnum):
    CONFORMANT = 0
    NOT_CONFORMANT = 1
    INCONCLUSIVE = 2
    HARNESS_ERROR = 3
    REVERT_FAILED = 4  # a fault could not be undone: the cluster may be dirty


@dataclass
class Verdict:
    item: str                 # checklist item id, e.g. "6.1.4"
    title: str
    status: Status
    reason: str               # one line: measured what, against what, why it matters
    measured: float | None = None
    threshold: float | None = None
    unit: str = ""
    op: str = ""              # how measured compares with threshold when it passes ("<=", ">=", ...)
    evidence: dict[str, Any] = field(default_factory=dict)
    test: str | None = None   # pytest node id that recorded it

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        if not self.item or not self.title:
            raise ConfigError("a verdict needs an item id and a title", fix="pass item= and title=")
        if "\n" in self.reason:
            raise ConfigError(f"verdict {self.item}: reason must be one line, got {self.reason!r}",
                              fix="put details in evidence, keep reason to one line")
        if self.measured is not None and not math.isfinite(float(self.measured)):
            raise ConfigError(f"verdict {self.item}: measured value {self.measured!r} is not finite",
                              fix="report an inconclusive verdict with measured=None instead")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Verdict":
        return cls(**data)


def inconclusive(checklist: Any, item_id: str, reason: str, **evidence: Any) -> Verdict:
    """The verdict of an item that was not measured (a dry run, a cluster too small for it);
    ``checklist``: the cluster's thresholds (harness.checks.thresholds.Checklist)."""
    return Verdict(item=item_id, title=checklist.item(item_id).title, status=Status.INCONCLUSIVE, reason=reason,
                   evidence=evidence)


def exit_code_for(verdicts: Iterable[Verdict], *, harness_error: bool = False,
                  revert_failed: bool = False) -> ExitCode:
    """Precedence: revert failed (4) > harness error (3) > not conformant (1) > inconclusive (2) > 0.

    A run with no verdict at all proved nothing, so it is inconclusive, not conformant.
    """
    if revert_failed:
        return ExitCode.REVERT_FAILED
    statuses = [v.status for v in verdicts]
    if harness_error or Status.ERROR in statuses:
        return ExitCode.HARNESS_ERROR
    if Status.FAIL in statuses:
        return ExitCode.NOT_CONFORMANT
    if not statuses or Status.INCONCLUSIVE in statuses:
        return ExitCode.INCONCLUSIVE
    return ExitCode.CONFORMANT


@dataclass(frozen=True)
class Measurement:
    """One measured quantity judged against one threshold; ``value`` None means not measured."""

    threshold: Threshold
    value: float | None
    what: str  # e.g. "p100 rescheduling time over 6 kills"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.threshold.key, "what": self.what, "value": self.value,
                "threshold": self.threshold.value, "op": self.threshold.op, "unit": self.threshold.unit,
                "holds": None if self.value is None else self.threshold.holds(self.value),
                "threshold_origin": self.threshold.origin, "threshold_from_article": self.threshold.article}


def judge(item: ChecklistItem, measurements: Sequence[Measurement], *,
          evidence: dict[str, Any] | None = None, inconclusive_because: str | None = None) -> Verdict:
    """Fail if any measurement misses its threshold; else inconclusive if any is missing (or the
    caller says the evidence is too thin); else pass. The headline is the first failing
    measurement, or the first one."""
    if not measurements:
        raise ConfigError(f"judge({item.id}) needs at least one measurement", fix="pass the measured values")
    failing = [m for m in measurements if m.value is not None and not m.threshold.holds(m.value)]
    missing = [m for m in measurements if m.value is None]
    head = failing[0] if failing else (missing[0] if missing else measurements[0])
    t = head.threshold
    ev = {"measurements": [m.to_dict() for m in measurements], **(evidence or {})}
    if failing:
        status = Status.FAIL
        reason = (f"{head.what} was {head.value:.4g} {t.unit}, required {t.describe()}: {item.why}")
    elif missing or inconclusive_because:
        status = Status.INCONCLUSIVE
        because = inconclusive_because or f"{head.what} could not be measured"
        reason = f"inconclusive: {because} (required {t.describe()})"
    else:
        status = Status.PASS
        reason = f"{head.what} was {head.value:.4g} {t.unit}, within {t.describe()}"
        if len(measurements) > 1:
            reason += f" (and {len(measurements) - 1} more threshold(s) met)"
    return Verdict(item=item.id, title=item.title, status=status, reason=" ".join(reason.split()),
                   measured=head.value, threshold=t.value, unit=t.unit, op=t.op, evidence=ev)
