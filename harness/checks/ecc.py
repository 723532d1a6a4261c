"""ECC poisoning (seed 5.1 Layer 2: "标记 Page 为 poison → 触发 KV Cache 重平衡"): poisoned KV
pages are quarantined and never served.

Per poisoning, while the fault is active the worker must keep every poisoned block out of service
(``kv_blocks_quarantined`` never below the count poisoned: the worker's reply to the poisoning,
then heartbeats polled through the admin API; a worker refreshes what its heartbeats say before it
replies, and the suite waits for the previous poisoning's revert to show before the next one, so
no reading predates the fault it is taken for; the
fault's own verify reads ``kv_blocks_poisoned``, which says the memory went bad, not that the
engine did anything about it), and every
request whose KV was on those blocks must still complete token-exactly (it was recomputed) or end
with a clear error. Poisoned bytes are NaN on the bundled engine, so a block served again would
turn its request's output into garbage, which the oracle comparison catches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Verdict, judge
from harness.probes.client.records import RequestRecord

ITEM = "ecc"


@dataclass
class Poisoning:
    worker: str
    blocks: list[int]
    affected: list[str]                       # attempt ids (``<request id>#<n>``) the worker recomputed
    min_quarantined: int | None = None        # lowest kv_blocks_quarantined seen while active
    quarantined_at_injection: int | None = None  # the worker's own count in its reply to the poisoning
    revert_seen: bool | None = None           # a heartbeat after the revert reached the table before the next
    outcomes: dict[str, str] = field(default_factory=dict)  # request id -> how it ended

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge_outcomes(poisonings: Sequence[Poisoning], records: Iterable[RequestRecord],
                   exact: Callable[[RequestRecord], bool | None]) -> None:
    """Fill each poisoning's ``outcomes`` from the request records (``exact``: token-exact?)."""
    by_id = {r.response_id: r for r in records if r.response_id}
    for p in poisonings:
        for attempt in p.affected:
            rid = attempt.rsplit("#", 1)[0]
            rec = by_id.get(rid)
            if rec is None:
                p.outcomes[rid] = "no client record"
            elif not rec.ok:
                p.outcomes[rid] = f"ended {rec.status}" + (" with a clear error" if rec.error_message else " silently")
            else:
                verdict = exact(rec)
                p.outcomes[rid] = {True: "completed token-exact", False: "completed WRONG",
                                   None: "completed (no oracle)"}[verdict]


def _recovered(outcome: str) -> bool:
    return outcome.startswith("completed token-exact") or outcome.startswith("completed (no oracle)") \
        or "clear error" in outcome


def ecc_verdict(poisonings: Sequence[Poisoning], checklist: Checklist) -> Verdict:
    item = checklist.item(ITEM)
    t = item.thresholds
    escaped = {i: max(0, len(p.blocks) - p.min_quarantined) for i, p in enumerate(poisonings)
               if p.min_quarantined is not None}
    reused = sum(escaped.values())
    named = "; ".join(f"{poisonings[i].worker} blocks {poisonings[i].blocks}: "
                      f"{len(poisonings[i].blocks) - n} of {len(poisonings[i].blocks)} quarantined"
                      for i, n in escaped.items() if n)
    not_recovered = [(p.worker, rid, o) for p in poisonings for rid, o in p.outcomes.items() if not _recovered(o)]
    how = Counter(o for _, _, o in not_recovered)
    biting = [p for p in poisonings if p.affected]
    measurements = [
        Measurement(t["poisoned_blocks_reused"], reused, "poisoned blocks left in service while poisoned"
                    + (f" ({named})" if named else "")),
        Measurement(t["affected_requests_not_recovered"], len(not_recovered),
                    f"requests on poisoned blocks not recovered (of {sum(len(p.affected) for p in poisonings)}"
                    + (f": {', '.join(f'{n} {o}' for o, n in how.most_common())})" if how else ")")),
    ]
    need = int(t["min_poisonings"].value)
    thin = None if len(biting) >= need else (f"only {len(biting)} poisoning(s) hit a running request (need {need}): "
                                            "raise the load or the poisoned count")
    evidence = {"poisonings": [p.to_dict() for p in poisonings],
                "samples": [{"label": f"{p.worker} blocks {p.blocks}", "value": len(p.affected),
                             "note": "; ".join(f"{rid}: {o}" for rid, o in p.outcomes.items()) or "hit no request"}
                            for p in poisonings]}
    if not_recovered:
        evidence["not_recovered"] = [f"{w} {rid}: {o}" for w, rid, o in not_recovered]
    verdict = judge(item, measurements, evidence=evidence, inconclusive_because=thin)
    # judge() words the first failing measurement only; a reader should see the others too
    failing = [m for m in measurements if m.value is not None and not m.threshold.holds(m.value)]
    if len(failing) > 1:
        verdict.add("note", text="; ".join(f"also {m.what}: {m.value:.4g} {m.threshold.unit}" for m in failing[1:]),
                    strip=True)
    return verdict


__all__ = ["ITEM", "Poisoning", "ecc_verdict", "judge_outcomes"]
