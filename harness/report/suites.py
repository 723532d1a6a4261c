"""Which suite a moment of the run belongs to, and the names the report gives suites and items.

Suites run one after another, so a time belongs to the last suite that had started by then. A
suite's start is the earliest of: its test row's ``started`` (wall seconds, when the plugin records
it) and the start of the measurement windows its verdicts carry (``evidence.machine.windows``).
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Mapping, Sequence

BEFORE_SUITES = "before the first suite"


def suite_label(nodeid: str | None) -> str:
    """``suites/test_ecc_poisoning.py::test_x[p]`` -> ``test_ecc_poisoning.py[p]``: the file a user
    passes to pytest (one conformance test per file), with the parameters when there are any."""
    if not nodeid:
        return "?"
    path, _, test = nodeid.partition("::")
    param = test[test.index("["):] if "[" in test else ""
    return path.rsplit("/", 1)[-1] + param


def verdict_started(evidence: Mapping[str, Any]) -> float | None:
    """When the verdict's measurement began (its first machine window), if it says."""
    starts = [w["start"] for w in (evidence.get("machine") or {}).get("windows", []) if w.get("start") is not None]
    return min(starts) if starts else None


class SuiteSpans:
    """Start times of the run's suites, in order; :meth:`at` names the suite running at a time."""

    def __init__(self, starts: Mapping[str, float]) -> None:
        ordered = sorted(starts.items(), key=lambda kv: kv[1])
        self.labels = [label for label, _ in ordered]
        self.starts = [t for _, t in ordered]

    @classmethod
    def of(cls, verdicts: Iterable[Any], tests: Sequence[Mapping[str, Any]] = ()) -> "SuiteSpans":
        starts: dict[str, float] = {}

        def note(nodeid: str | None, t: float | None) -> None:
            if nodeid and t is not None:
                label = suite_label(nodeid)
                starts[label] = min(t, starts.get(label, t))

        for row in tests:
            note(row.get("nodeid"), row.get("started"))
        for v in verdicts:
            note(v.test, verdict_started(v.evidence))
        return cls(starts)

    def at(self, t: float) -> str:
        i = bisect.bisect_right(self.starts, t) - 1
        return self.labels[i] if i >= 0 else BEFORE_SUITES

    def span(self, label: str, end: float) -> tuple[float, float] | None:
        """(start, end) of one suite: until the next suite starts, or ``end``."""
        if label not in self.labels:
            return None
        i = self.labels.index(label)
        return self.starts[i], self.starts[i + 1] if i + 1 < len(self.labels) else end


STATUSES = ("pass", "fail", "inconclusive", "error", "not run")


def item_statuses(verdicts: Iterable[Any], checklist_items: Iterable[str]) -> dict[str, str]:
    """Every checklist item's status in this run: fail if any of its verdicts failed, else pass if
    one passed, else error or inconclusive; items no verdict names are "not run"."""
    by_item: dict[str, set[str]] = {}
    for v in verdicts:
        by_item.setdefault(v.item, set()).add(v.status.value)
    out = {}
    for item in list(dict.fromkeys([*checklist_items, *by_item])):
        seen = by_item.get(item)
        out[item] = next((s for s in ("fail", "pass", "error", "inconclusive") if s in (seen or ())), "not run")
    return out


def status_counts(statuses: Mapping[str, str]) -> dict[str, int]:
    return {s: sum(1 for v in statuses.values() if v == s) for s in STATUSES}
