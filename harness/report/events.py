"""The report's event timeline: each event once, counted per kind and per suite; bulk kinds (one
event per request, such as ``kv_transfer``) shown as rates instead of listed.

Rows of ``RunResult.timeline`` are ``{"t", "source", "kind", "detail"}`` with the detail flattened
to ``k=v, ...`` text. An engine event carries its router sequence number (``seq=N``) in it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Sequence

from harness.report.suites import BEFORE_SUITES, SuiteSpans

BULK_KINDS = frozenset({"kv_transfer"})
BULK_AT = 200  # a kind with more events than this is summarised as rates too
_SEQ = re.compile(r"(?:^|, )(?:seq|id|event_id)=(\d+)(?:,|$)")


def event_key(e: Mapping[str, Any]) -> str:
    """Identity of one event. An engine event is its source's sequence number at its time (a
    restarted router numbers from 1 again, so the number alone is not enough); any other entry is
    its whole content."""
    detail = str(e.get("detail") or "")
    seq = _SEQ.search(detail)
    if seq:
        return f"{e.get('source')}:{e.get('kind')}:{seq.group(1)}@{float(e['t']):.3f}"
    return f"{e.get('source')}:{e.get('kind')}@{float(e['t']):.6f}:{detail}"


def unique_events(timeline: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The timeline with every event once (first occurrence kept), in time order."""
    seen: set[str] = set()
    out = []
    for e in timeline:
        key = event_key(e)
        if key not in seen:
            seen.add(key)
            out.append(dict(e))
    out.sort(key=lambda e: e["t"])
    return out


def event_summary(timeline: Sequence[Mapping[str, Any]], spans: SuiteSpans | None = None,
                  run_end: float | None = None) -> dict[str, Any]:
    """Events (unique) per kind and per suite: ``{"suites": [labels], "kinds": [row]}``, each row
    ``{"kind", "sources", "count", "per_suite": {label: n}, "rates": {label: per s}, "bulk",
    "first", "last", "events"}`` (``events`` empty for bulk kinds: their raw events stay in
    results.json)."""
    spans = spans or SuiteSpans({})
    events = unique_events(timeline)
    end = run_end if run_end is not None else (events[-1]["t"] if events else 0.0)
    kinds: dict[str, dict[str, Any]] = {}
    used: list[str] = []
    for e in events:
        suite = spans.at(e["t"])
        if suite not in used:
            used.append(suite)
        k = kinds.setdefault(e["kind"], {"kind": e["kind"], "sources": set(), "count": 0, "per_suite": {},
                                         "events": [], "first": e["t"]})
        k["sources"].add(e["source"])
        k["count"] += 1
        k["per_suite"][suite] = k["per_suite"].get(suite, 0) + 1
        k["last"] = e["t"]
        k["events"].append({**e, "suite": suite, "id": event_key(e)})
    suites = [s for s in [BEFORE_SUITES, *spans.labels] if s in used]
    rows = sorted(kinds.values(), key=lambda k: (k["kind"] in BULK_KINDS or k["count"] > BULK_AT, -k["count"], k["kind"]))
    for k in rows:
        k["sources"] = ", ".join(sorted(k["sources"]))
        k["bulk"] = k["kind"] in BULK_KINDS or k["count"] > BULK_AT
        k["rates"] = {s: n / _length(spans, s, k, end) for s, n in k["per_suite"].items()}
        if k["bulk"]:
            k["events"] = []
    return {"suites": suites, "kinds": rows, "total": len(events)}


def _length(spans: SuiteSpans, suite: str, kind: Mapping[str, Any], end: float) -> float:
    """Seconds a suite ran (the kind's first-to-last span for events outside any suite)."""
    span = spans.span(suite, end)
    seconds = (span[1] - span[0]) if span else (kind["last"] - kind["first"])
    return max(seconds, 1.0)
