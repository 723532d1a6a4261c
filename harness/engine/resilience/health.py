"""Delta-based health score per decode worker (seed Section 5.2) and the migration decision
flow of Section 5.3.

The detector looks at trends, not absolute values: over a window of heartbeats (20, at least 5
before it says anything) it compares the newest snapshot with the oldest one and weighs

    0.30 * TPOT p99 growth (relative)      0.25 * queue growth (relative)
    0.25 * HBM growth / 0.3 (30 points = fully sick)      0.20 * retransmission rate / 0.05

into a score from 0.0 (healthy) to 1.0 (sick). Above 0.6 the worker should shed load: Section
5.3 migrates ``ceil(active x (score - 0.6))`` requests, lowest priority and least recently active
first, each to the least-loaded decode worker with free KV above 1.2 x the victim's KV. The
article's pseudo-code misspells ``tpot`` and ``hbm``; the intent is implemented here.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from harness.errors import ConfigError


@dataclass(frozen=True)
class HealthSnapshot:
    """One heartbeat's view of a decode worker (the inputs of Section 5.2)."""

    timestamp: float
    tpot_p99_ms: float
    queue_depth: int
    hbm_used_ratio: float
    retrans_rate: float

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], timestamp: float) -> "HealthSnapshot":
        """From a worker heartbeat's ``stats`` (fields named in docs/pd.md); missing ones count as 0."""
        used = stats.get("kv_used_ratio")
        if used is None:  # a worker without the fill-aware ratio: derive it from block counts
            total = float(stats.get("kv_blocks_total") or 0)
            used = float(stats.get("kv_blocks_used") or 0) / total if total else 0.0
        queue = stats.get("queue_depth")
        if queue is None:
            queue = int(stats.get("num_waiting") or 0)
        return cls(timestamp, float(stats.get("tpot_p99_ms") or 0.0), int(queue), float(used),
                   float(stats.get("retrans_rate") or 0.0))


@dataclass(frozen=True)
class HealthConfig:
    window: int = 20
    min_snapshots: int = 5
    threshold: float = 0.6
    w_tpot: float = 0.30
    w_queue: float = 0.25
    w_hbm: float = 0.25
    w_retrans: float = 0.20
    hbm_full_trend: float = 0.3      # HBM up 30 points counts as fully sick
    retrans_full_rate: float = 0.05  # 5 % retransmissions counts as fully sick

    def __post_init__(self) -> None:
        if self.window < 2 or not 1 <= self.min_snapshots <= self.window:
            raise ConfigError(f"health window {self.window} / min_snapshots {self.min_snapshots} are inconsistent",
                              fix="use window >= 2 and 1 <= min_snapshots <= window (the article: 20 and 5)")
        if not 0 < self.threshold < 1:
            raise ConfigError(f"health threshold must be in (0, 1), got {self.threshold}", fix="use 0.6")
        if self.hbm_full_trend <= 0 or self.retrans_full_rate <= 0:
            raise ConfigError("hbm_full_trend and retrans_full_rate must be positive", fix="use 0.3 and 0.05")


class DeltaHealthDetector:
    """Section 5.2 for one worker: feed snapshots, read ``score()``."""

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self.snapshots: deque[HealthSnapshot] = deque(maxlen=self.config.window)

    def ingest(self, snapshot: HealthSnapshot) -> None:
        self.snapshots.append(snapshot)

    def components(self) -> dict[str, float]:
        """Each weighted term before summing (0 for all while the window has too few snapshots)."""
        c = self.config
        if len(self.snapshots) < c.min_snapshots:
            return {"tpot": 0.0, "queue": 0.0, "hbm": 0.0, "retrans": 0.0}
        base, last = self.snapshots[0], self.snapshots[-1]
        # TPOT 0 means "no token in the worker's window" (idle), not "infinitely fast": an idle
        # worker that starts serving would otherwise look sick. The baseline is the first
        # snapshot that measured TPOT at all.
        tpot_base = next((s.tpot_p99_ms for s in self.snapshots if s.tpot_p99_ms > 0), 0.0)
        tpot_trend = ((last.tpot_p99_ms - tpot_base) / max(tpot_base, 1.0)
                      if tpot_base > 0 and last.tpot_p99_ms > 0 else 0.0)
        queue_trend = (last.queue_depth - base.queue_depth) / max(base.queue_depth, 1)
        hbm_trend = last.hbm_used_ratio - base.hbm_used_ratio
        return {"tpot": c.w_tpot * max(0.0, tpot_trend),
                "queue": c.w_queue * max(0.0, queue_trend),
                "hbm": c.w_hbm * max(0.0, hbm_trend / c.hbm_full_trend),
                "retrans": c.w_retrans * max(0.0, last.retrans_rate / c.retrans_full_rate)}

    def score(self) -> float:
        """0.0 (healthy) .. 1.0 (sick); 0.0 while fewer than ``min_snapshots`` were seen."""
        return min(1.0, sum(self.components().values()))

    def should_migrate(self) -> bool:
        return self.score() > self.config.threshold


# ---------------------------------------------------------------- Section 5.3 decision flow


@dataclass(frozen=True)
class Candidate:
    """A request running on the sick worker."""

    request_id: str
    priority: int         # higher = more important (kept longest)
    last_active: float    # monotonic time of its last token
    kv_bytes: int


@dataclass(frozen=True)
class TargetWorker:
    worker_id: str
    load: float           # active requests (the router's load factor)
    free_kv_bytes: int


@dataclass(frozen=True)
class MigrationPlan:
    request_id: str
    target: str
    reason: str


@dataclass
class Decision:
    score: float
    evict_count: int
    plans: list[MigrationPlan] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)  # victims no worker had headroom for


def evict_count(active: int, score: float, threshold: float = 0.6) -> int:
    """Step 1: ``active x (score - threshold)`` requests, rounded up so that a worker over the
    threshold always sheds at least one; 0 at or below the threshold."""
    if score <= threshold or active <= 0:
        return 0
    return min(active, math.ceil(active * (score - threshold) - 1e-9))


def order_victims(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Step 2: lowest priority first, then least recently active."""
    return sorted(candidates, key=lambda c: (c.priority, c.last_active, c.request_id))


def pick_target(targets: Sequence[TargetWorker], kv_bytes: int, headroom: float = 1.2) -> TargetWorker | None:
    """Step 3: the least-loaded worker whose free KV exceeds ``headroom`` x the victim's KV."""
    fits = [t for t in targets if t.free_kv_bytes > headroom * kv_bytes]
    return min(fits, key=lambda t: (t.load, t.worker_id)) if fits else None


def decide(score: float, candidates: Sequence[Candidate], targets: Sequence[TargetWorker], *,
           threshold: float = 0.6, headroom: float = 1.2) -> Decision:
    """Steps 1-3 for one sick worker; each placement charges the target so that several victims
    spread out instead of all landing on the same worker."""
    n = evict_count(len(candidates), score, threshold)
    decision = Decision(score, n)
    pool = {t.worker_id: t for t in targets}
    for victim in order_victims(candidates)[:n]:
        target = pick_target(list(pool.values()), victim.kv_bytes, headroom)
        if target is None:
            decision.unplaced.append(victim.request_id)
            continue
        decision.plans.append(MigrationPlan(victim.request_id, target.worker_id,
                                            f"health score {score:.2f} > {threshold}"))
        pool[target.worker_id] = TargetWorker(target.worker_id, target.load + 1,
                                              target.free_kv_bytes - victim.kv_bytes)
    return decision


__all__ = ["Candidate", "Decision", "DeltaHealthDetector", "HealthConfig", "HealthSnapshot", "MigrationPlan",
           "TargetWorker", "decide", "evict_count", "order_victims", "pick_target"]
