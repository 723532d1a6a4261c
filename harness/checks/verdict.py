"""Verdicts: what a check concluded about one checklist item, and the run's exit code.

A verdict is JSON-able and self-explaining: measured value, threshold, unit, evidence and a
one-line reason that says what was measured, against what, and why it matters. The reason is
data first (``causes``: codes plus fields, harness/checks/reasons.py) and its text is rendered
from them, once. The status is decided in one place and order: :func:`judge` (or, for an item
not measured, :func:`inconclusive`), then the extension loop (harness/checks/extend.py), then the
machine gate (harness/checks/machine.py); each adds its layer of causes. The exit code
of a whole run follows from its verdicts plus two harness-level facts (a harness error, a
failed revert); see ``docs/exit-codes.md``.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

from harness.stats import levels
from harness.stats.intervals import Interval, decide, more_to_decide
from harness.checklists import ChecklistItem, Threshold
from harness.checks import reasons
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
    """``causes`` (harness/checks/reasons.py) say why, as data: a head, then layers; ``reason`` is
    their rendering, set here and by :meth:`add` only. A verdict built with ``reason`` alone (a
    user's own suite, a results.json older than causes) keeps those words as a ``summary`` head;
    the harness's own code always passes causes (a test checks)."""

    item: str                 # checklist item id, e.g. "6.1.4"
    title: str
    status: Status
    reason: str = ""          # one line, rendered from causes: measured what, against what, why it matters
    measured: float | None = None
    threshold: float | None = None
    unit: str = ""
    op: str = ""              # how measured compares with threshold when it passes ("<=", ">=", ...)
    evidence: dict[str, Any] = field(default_factory=dict)
    test: str | None = None   # pytest node id that recorded it
    interval: dict[str, Any] | None = None   # the headline measurement's Interval.to_dict(), when it has one
    causes: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        if not self.item or not self.title:
            raise ConfigError("a verdict needs an item id and a title", fix="pass item= and title=")
        if "\n" in self.reason:
            raise ConfigError(f"verdict {self.item}: reason must be one line, got {self.reason!r}",
                              fix="put details in evidence, keep reason to one line")
        if not self.causes:
            if not self.reason.strip():
                raise ConfigError(f"verdict {self.item}: no reason", fix="pass causes= (harness/checks/reasons.py) or reason=")
            causes: Any = (reasons.cause("summary", text=self.reason),)
        else:
            causes = self.causes
        causes = reasons.check(causes)
        rendered = reasons.render(causes)
        if self.reason and " ".join(self.reason.split()) != rendered:
            raise ConfigError(f"verdict {self.item}: reason {self.reason!r} is not what its causes say ({rendered!r})",
                              fix="change the causes (Verdict.add, Verdict.restated), never the text")
        self._check_status(causes)
        object.__setattr__(self, "causes", causes)
        object.__setattr__(self, "reason", rendered)
        if self.measured is not None and not math.isfinite(float(self.measured)):
            raise ConfigError(f"verdict {self.item}: measured value {self.measured!r} is not finite",
                              fix="report an inconclusive verdict with measured=None instead")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("reason", "causes") and "causes" in self.__dict__ and isinstance(self.__dict__["causes"], tuple) \
                and self.__dict__.get("reason"):
            raise AttributeError(f"verdict {self.item}: the reason is rendered from its causes once; "
                                 "add a layer with Verdict.add() or restate the head with Verdict.restated()")
        super().__setattr__(name, value)

    def _check_status(self, causes: tuple[dict[str, Any], ...]) -> None:
        """The status is the one its causes say (judge's outcome, or the machine gate's): one path."""
        implied = reasons.implied_status(causes)
        if implied is not None and implied != self.status.value:
            raise ConfigError(f"verdict {self.item}: status {self.status.value} but its causes say {implied} "
                              f"({[c['code'] for c in causes]})", fix="decide the status through judge() and its layers")

    @property
    def cause(self) -> dict[str, Any]:
        """The head cause: what decided the verdict (``code`` and its fields)."""
        return self.causes[0]

    def layer(self, code: str) -> dict[str, Any] | None:
        """The last layer of ``code`` ("extended", "machine", "note"), or None."""
        return next((c for c in reversed(self.causes[1:]) if c["code"] == code), None)

    def add(self, code: str, **fields: Any) -> "Verdict":
        """Add a layer (extension, machine gate, a detail the item adds) and render the reason again."""
        causes = reasons.check((*self.causes, reasons.cause(code, **fields)))
        self._check_status(causes)
        object.__setattr__(self, "causes", causes)
        object.__setattr__(self, "reason", reasons.render(causes))
        return self

    def restated(self, code: str, **fields: Any) -> "Verdict":
        """A copy whose head is ``code`` (the item says the same outcome in its own terms: a
        nothing-lost pass names its counts); the layers are kept."""
        causes = reasons.check((reasons.cause(code, **fields), *self.causes[1:]))
        return replace(self, causes=causes, reason=reasons.render(causes))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["causes"] = [dict(c) for c in self.causes]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Verdict":
        """A verdict read back (a results.json older than causes keeps its text as a ``summary``)."""
        return cls(**data)


def inconclusive(checklist: Any, item_id: str, reason: str, *, code: str = "not_judged", **evidence: Any) -> Verdict:
    """The verdict of an item that was not measured (a dry run, a cluster too small for it, a fault
    that could not be made); ``checklist``: the cluster's thresholds (harness.checklists.Checklist);
    ``code``: which of those (harness/checks/reasons.py), ``reason`` its words."""
    if code not in reasons.NOT_MEASURED_CODES:
        raise ConfigError(f"inconclusive({item_id!r}): code {code!r} is not one for an item not measured",
                          fix=f"use one of {', '.join(reasons.NOT_MEASURED_CODES)}")
    return Verdict(item=item_id, title=checklist.item(item_id).title, status=Status.INCONCLUSIVE,
                   causes=(reasons.cause(code, text=" ".join(reason.split())),), evidence=evidence)


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
    """One measured quantity judged against one threshold; ``value`` None means not measured.
    A timing measurement carries the ``interval`` its samples give (harness/stats/intervals.py):
    it then passes or fails only when the whole interval does; exact counts carry none."""

    threshold: Threshold
    value: float | None
    what: str  # e.g. "p100 rescheduling time over 6 kills"
    interval: Interval | None = None

    def decision(self) -> str | None:
        """"pass", "fail", or None: not measured, or its interval straddles the threshold."""
        if self.value is None:
            return None
        if self.interval is None:
            return "pass" if self.threshold.holds(self.value) else "fail"
        return decide(self.interval, self.threshold.value, self.threshold.holds)

    def more_to_decide(self) -> int | None:
        """About how many more samples would decide a straddling interval (None: not within 10x)."""
        return self._more

    @functools.cached_property
    def _more(self) -> int | None:   # computed once: judge() asks three times
        return None if self.interval is None else more_to_decide(self.interval, self.threshold.value,
                                                                 self.threshold.holds)

    def figure(self) -> str:
        """``480 ms [450-510, 95 %]``: the value with its interval beside it."""
        text = "not measured" if self.value is None else f"{self.value:.4g} {self.threshold.unit}".strip()
        return text if self.interval is None or self.value is None else f"{text} {self.interval.brackets()}"

    def straddles(self) -> dict[str, Any]:
        """The ``straddles`` cause: what straddles which threshold and what would decide it."""
        i = self.interval
        assert i is not None
        return reasons.cause("straddles", key=self.threshold.key, what=self.what,
                             interval=i.describe(self.threshold.unit), threshold=self.threshold.describe(),
                             more_to_decide=self.more_to_decide(), noun=i.noun,
                             resolution_bound=i.extrapolate is None)

    def to_dict(self) -> dict[str, Any]:
        decision = self.decision()
        out = {"key": self.threshold.key, "what": self.what, "value": self.value,
               "threshold": self.threshold.value, "op": self.threshold.op, "unit": self.threshold.unit,
               "holds": None if decision is None else decision == "pass",
               "threshold_origin": self.threshold.origin, "threshold_from_article": self.threshold.article,
               "interval": None if self.interval is None else self.interval.to_dict()}
        if self.interval is not None and self.value is not None and decision is None:
            out["more_to_decide"] = self.more_to_decide()
        return out


def controlled(item: ChecklistItem, measurements: Sequence[Measurement]) -> tuple[list[Measurement], dict | None]:
    """The measurements with their intervals at the one-sided levels this judgment may spend
    (harness/stats/levels.py): for an item with a ``false_fail_alpha`` budget, each interval that
    can be recomputed gets its fail-side bound at the item's budget / its interval-judged
    measurements / the looks, and its pass-side bound at ``false_pass_alpha`` / the looks (or a
    soak window's override). Returns them and ``evidence["error_control"]`` (None: not controlled)."""
    t = item.thresholds
    # every measurement whose interval can be re-levelled shares the budget, measured yet or not
    # (6.1.2's loaded median before its phase ran): its share must not grow when another is missing
    judged = [i for i, m in enumerate(measurements) if m.interval is not None and m.interval.relevel is not None]
    if levels.FALSE_FAIL_KEY not in t or not judged:
        return list(measurements), None
    spend = levels.current()
    item_fail = t[levels.FALSE_FAIL_KEY].value
    item_pass = t[levels.FALSE_PASS_KEY].value if levels.FALSE_PASS_KEY in t else levels.DEFAULT_FALSE_PASS_ALPHA
    fail_a, pass_a = spend.alphas(item_fail, item_pass, len(judged))
    out = list(measurements)
    for i in judged:
        m = out[i]
        out[i] = replace(m, interval=m.interval.at(*levels.one_sided(m.threshold.op, fail_a, pass_a)))  # type: ignore[union-attr]
    return out, spend.to_dict(fail_a, pass_a, item_false_fail_alpha=item_fail, false_pass_alpha=item_pass,
                              measurements=[measurements[i].threshold.key for i in judged])


def judge(item: ChecklistItem, measurements: Sequence[Measurement], *,
          evidence: dict[str, Any] | None = None, inconclusive_because: str | None = None) -> Verdict:
    """Fail if any measurement misses its threshold (its whole interval, when it has one); else
    inconclusive if any is missing, straddles its threshold, or the caller says the evidence is
    too thin; else pass. The headline is the first failing measurement, else the first undecided
    one, else the first. Straddling measurements are listed in ``evidence["undecided"]``. Intervals
    are first put at the levels the item's error budget allows (:func:`controlled`); the evidence's
    ``error_control`` says which method and levels decided."""
    if not measurements:
        raise ConfigError(f"judge({item.id}) needs at least one measurement", fix="pass the measured values")
    measurements, control = controlled(item, measurements)
    decisions = [m.decision() for m in measurements]
    failing = [m for m, d in zip(measurements, decisions) if d == "fail"]
    undecided = [m for m, d in zip(measurements, decisions) if d is None]
    straddling = [m for m in undecided if m.value is not None]
    head = failing[0] if failing else (undecided[0] if undecided else measurements[0])
    t = head.threshold
    ev = {"measurements": [m.to_dict() for m in measurements], **(evidence or {})}
    if control is not None:
        ev["error_control"] = control
    if straddling:
        ev["undecided"] = [{"key": m.threshold.key, "more_to_decide": m.more_to_decide(), "noun": m.interval.noun,
                            "n": m.interval.n} for m in straddling if m.interval is not None]
    if failing:
        status = Status.FAIL
        head_cause = reasons.cause("missed", key=t.key, what=head.what, figure=head.figure(),
                                   threshold=t.describe(), why=item.why)
    elif undecided or inconclusive_because:
        status = Status.INCONCLUSIVE
        if inconclusive_because:
            head_cause = reasons.cause("thin", key=t.key, because=inconclusive_because, threshold=t.describe())
        elif head.value is None:
            head_cause = reasons.cause("not_measured", key=t.key, what=head.what, threshold=t.describe())
        else:
            head_cause = head.straddles()
    else:
        status = Status.PASS
        head_cause = reasons.cause("met", key=t.key, what=head.what, figure=head.figure(), threshold=t.describe(),
                                   more_met=len(measurements) - 1)
    return Verdict(item=item.id, title=item.title, status=status, causes=(head_cause,),
                   measured=head.value, threshold=t.value, unit=t.unit, op=t.op, evidence=ev,
                   interval=None if head.interval is None else head.interval.to_dict())


def undecided(verdict: Verdict) -> list[dict[str, Any]]:
    """The measurements of an inconclusive verdict whose intervals straddled their thresholds
    (``key``, ``more_to_decide``, ``noun``, ``n``): what more samples could decide; [] otherwise."""
    if verdict.status is not Status.INCONCLUSIVE:
        return []
    return list(verdict.evidence.get("undecided") or [])
