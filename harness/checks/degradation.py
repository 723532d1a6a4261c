"""Checklist item 6.1.3, "降级策略测试：模拟 KV Cache 超载，验证 Level 2/3 正确触发".

The suite raises KV use step by step (HBM fill on every decode worker, under light load) to just
below Level 2's threshold, between Level 2's and Level 3's, and above Level 3's, then reverts the
fill. From the router's ``degradation_level`` events and what the workers report, this check
judges:

- Level 2 triggered at its threshold: the KV use recorded when L2 was entered is at least the
  threshold (not early) and at most ``trigger_tolerance`` above it (not late);
- Level 3 likewise against ``level3_trigger_utilization``, and after Level 2 (in order);
- each level's action took effect on every decode worker: speculative decoding off at L2 (when it
  was on before), KV offload on at L3;
- after the revert the cluster stepped back to Level 0 within ``step_down_s``.

Neither figure is exact, and each is judged with its resolution (``measured_within``): the KV use
the router recorded is rounded to HBM_RESOLUTION; the step-down time is read by polling the
router's level, so Level 0 came after the last poll that still saw a level above it
(``step_down_after_s``) and before the one that saw 0. A figure within its resolution of the
threshold is inconclusive, not pass or fail.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Verdict, judge
from harness.states import EventKind
from harness.stats.intervals import Interval, measured_within

ITEM = "6.1.3"
HBM_RESOLUTION = 0.5e-4   # the router's degradation event rounds KV use to 4 decimals


@dataclass
class Step:
    """One plateau of KV use the suite held."""

    name: str
    target_hbm: float                 # the KV use the fill aimed at (max over decode workers)
    expect_level: int                 # the level this plateau should reach and not exceed
    reached: int = 0                  # highest level seen while holding it
    hbm_seen: float = 0.0             # highest KV-use signal the router reported meanwhile
    actions_missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def level_entries(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Upward ``degradation_level`` events, in order."""
    return [e for e in sorted(events, key=lambda e: e["seq"])
            if e["type"] == EventKind.DEGRADATION_LEVEL and e["to_level"] > e["from_level"]]


def hbm_interval(value: float | None) -> Interval | None:
    """Where the KV use the router recorded lies, given its rounding."""
    return None if value is None else measured_within(value, below=HBM_RESOLUTION, above=HBM_RESOLUTION)


def step_down_interval(step_down_s: float | None, after_s: float | None) -> Interval | None:
    """The step-down time as the polls bound it: Level 0 came after ``after_s`` (the last poll
    that still saw a level above 0, seconds from the revert; None: not stated, so any time since
    the revert) and by ``step_down_s`` (the poll that saw 0)."""
    if step_down_s is None:
        return None
    lo = 0.0 if after_s is None else min(max(after_s, 0.0), step_down_s)
    return measured_within(step_down_s, below=step_down_s - lo, above=0.0, noun="polls")


def degradation_verdict(steps: Sequence[Step], events: Iterable[dict[str, Any]], step_down_s: float | None,
                        checklist: Checklist, *, controller_enabled: bool = True,
                        step_down_after_s: float | None = None) -> Verdict:
    """``step_down_s``: from the revert until a poll saw Level 0 (the timeout when none did);
    ``step_down_after_s``: when the last poll before it still saw a level above 0 (from the revert)."""
    item = checklist.item(ITEM)
    t = item.thresholds
    events = list(events)
    ups = level_entries(events)
    first = {}
    for e in ups:
        first.setdefault(e["to_level"], e)
    l2, l3 = first.get(2), first.get(3)
    problems = [f"Level {lv} was never entered" for lv in (2, 3) if lv not in first]
    if l2 and l3 and l3["seq"] < l2["seq"]:
        problems.append("Level 3 was entered before Level 2")
    for s in steps:
        if s.reached < s.expect_level:
            problems.append(f"{s.name}: reached Level {s.reached}, expected Level {s.expect_level}")
    actions = [a for s in steps for a in s.actions_missing]
    l2_value = l2["hbm"] if l2 else None
    l3_value = l3["hbm"] if l3 else None
    past = None if l2_value is None else max(0.0, l2_value - t["trigger_utilization"].value)
    measurements = [
        Measurement(t["trigger_utilization"], l2_value, "KV use when Level 2 was entered", hbm_interval(l2_value)),
        Measurement(t["trigger_tolerance"], past, "how far past its threshold KV use was when Level 2 was entered",
                    hbm_interval(past)),
        Measurement(t["level3_trigger_utilization"], l3_value, "KV use when Level 3 was entered",
                    hbm_interval(l3_value)),
        Measurement(t["levels_not_reached"], len(problems), "levels not reached, reached out of order or on the wrong step"),
        Measurement(t["actions_not_applied"], len(actions), "level actions not seen on every decode worker"),
        Measurement(t["step_down_s"], step_down_s, "time from the fill's revert until Level 0",
                    step_down_interval(step_down_s, step_down_after_s)),
    ]
    evidence: dict[str, Any] = {
        "steps": [s.to_dict() for s in steps],
        "level_changes": [{k: e.get(k) for k in ("wall_time", "from_level", "to_level", "reason", "hbm", "queue",
                                                  "health", "actions")}
                          for e in events if e["type"] == EventKind.DEGRADATION_LEVEL],
        "resolution": {"kv_use": f"+-{HBM_RESOLUTION:g} (the router's event rounds KV use to 4 decimals)",
                       "step_down_s": "between the last poll of the router's level that saw a level above 0 and the "
                                      "first that saw 0" if step_down_after_s is not None else
                                      "not stated by the caller: any time from the revert until the poll that saw 0"},
        "samples": [{"label": s.name, "value": s.reached, "note": f"aimed at KV use {s.target_hbm:.3f}, router saw "
                     f"{s.hbm_seen:.3f}; expected Level {s.expect_level}"} for s in steps],
    }
    if problems:
        evidence["problems"] = problems
    if actions:
        evidence["actions_missing"] = actions
    if not controller_enabled:
        evidence["note"] = "the cluster's degradation controller is disabled (router.degradation_enabled: false)"
    verdict = judge(item, measurements, evidence=evidence)
    if verdict.status.value == "inconclusive" and (problems or not controller_enabled):
        # a level that never came is a failure of the cluster, not missing evidence
        verdict = judge(item, [m for m in measurements if m.value is not None], evidence=evidence)
    if verdict.status.value == "fail" and (problems or actions):
        verdict.add("note", sep=" First problem: ", text=f"{(problems + actions)[0]}"
                    + ("" if controller_enabled else " (router.degradation_enabled is false)"))
    return verdict


__all__ = ["ITEM", "Step", "degradation_verdict", "level_entries"]
