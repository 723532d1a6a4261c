"""Degradation Levels 0 to 5 (seed Section 4.1) with explicit triggers, hysteresis and a minimum dwell.

    L0 full service              L3 KV offload to CPU/NVMe (Section 4.3, threshold 85 %)
    L1 admission control (429)   L4 truncated context / capped max_tokens, marked in the response
    L2 speculative decoding off  L5 circuit open: new requests rejected, in-flight ones finish

Triggers read three cluster signals each evaluation: ``hbm`` (the highest KV use of any healthy
decode worker, HBM-fill reservations included), ``queue`` (requests waiting for a placement or
inside the decode workers' queues) and ``health`` (the highest Section 5.2 score). A level's
trigger holds when any of its signals reaches its enter threshold. Level 2's defaults are
Section 4.2's rule (HBM > 85 % or queue depth > 32); Level 3 enters at 90 % by default, so
offload starts only when turning speculation off did not relieve the pressure, and the worker's
offload manager then evicts down to Section 4.3's 85 %.

The controller moves ONE level per change and stays at least ``min_dwell_s`` at a level, so an
overload walks up L1, L2, L3 ... in order, each step an event with its reason. It steps down
only when no signal is within the hysteresis band of the current level's thresholds (HBM must
drop ``hbm_hysteresis`` below, the queue to ``1 - queue_hysteresis`` of its threshold, health
``health_hysteresis`` below), which keeps a signal hovering at a threshold from flapping.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from harness.engine.control.messages import Message, SetOffloadCommand, SetSpeculativeCommand
from harness.engine.core.types import GenerateRequest
from harness.engine.control.routing import EventLog, RoutingTable, RouterWorker
from harness.errors import ConfigError, InvalidRequestError
from harness.states import EventKind, WorkerRole

log = logging.getLogger(__name__)

MAX_LEVEL = 5
LEVEL_NAMES = {0: "full service", 1: "admission control", 2: "speculative decoding off", 3: "KV offload",
               4: "truncated context / capped max_tokens", 5: "circuit open (new requests rejected)"}
_INF = math.inf


@dataclass
class DegradationConfig:
    """Enter thresholds per level (index 1..5; ``None`` = this signal never triggers that level)."""

    enabled: bool = True
    hbm: tuple[float, ...] = (0.75, 0.85, 0.90, 0.95, 0.98)
    queue: tuple[float | None, ...] = (16, 32, None, 64, 128)
    health: tuple[float | None, ...] = (0.6, None, None, None, None)
    hbm_hysteresis: float = 0.05
    queue_hysteresis: float = 0.25
    health_hysteresis: float = 0.1
    min_dwell_s: float = 2.0
    # actions
    l1_queue_cap: int = 8             # L1+: a new request is answered 429 when this many already wait
    retry_after_s: int = 1
    l4_max_tokens: int = 32
    l4_max_prompt_tokens: int = 256   # longer prompts keep their last tokens

    def __post_init__(self) -> None:
        for name in ("hbm", "queue", "health"):
            values = tuple(_INF if v is None else float(v) for v in getattr(self, name))
            if len(values) != MAX_LEVEL:
                raise ConfigError(f"degradation.{name} needs {MAX_LEVEL} thresholds (Levels 1..5), got {len(values)}",
                                  fix="list one threshold per level; use null where a signal never triggers it")
            finite = [v for v in values if math.isfinite(v)]
            if any(v < 0 for v in values) or finite != sorted(finite):
                raise ConfigError(f"degradation.{name} thresholds must be non-negative and rise with the level, "
                                  f"got {list(values)}", fix="order them Level 1 <= Level 2 <= ... <= Level 5")
            setattr(self, name, values)
        for name in ("hbm_hysteresis", "queue_hysteresis", "health_hysteresis", "min_dwell_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"degradation.{name} must be >= 0, got {getattr(self, name)}", fix="use 0 or more")
        if not 0 <= self.queue_hysteresis < 1:
            raise ConfigError("degradation.queue_hysteresis is a fraction in [0, 1)", fix="use e.g. 0.25")
        for name in ("l1_queue_cap", "retry_after_s", "l4_max_tokens", "l4_max_prompt_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"degradation.{name} must be a positive integer, got {value!r}",
                                  fix=f"set {name} >= 1")

    @classmethod
    def from_dict(cls, data: dict | None) -> "DegradationConfig":
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown degradation setting(s) {sorted(unknown)}", fix=f"use {sorted(known)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


@dataclass(frozen=True)
class Signals:
    hbm: float = 0.0
    queue: float = 0.0
    health: float = 0.0


@dataclass(frozen=True)
class LevelChange:
    from_level: int
    to_level: int
    reason: str
    signals: Signals
    at: float

    def to_event(self) -> dict[str, Any]:
        return {"from_level": self.from_level, "to_level": self.to_level, "level": self.to_level,
                "name": LEVEL_NAMES[self.to_level], "reason": self.reason, "hbm": round(self.signals.hbm, 4),
                "queue": self.signals.queue, "health": round(self.signals.health, 4)}


@dataclass
class DegradationController:
    """Decides the level; ``DegradationActions`` applies each change."""

    config: DegradationConfig = field(default_factory=DegradationConfig)
    level: int = 0
    since: float = -_INF          # when the current level was entered
    history: list[LevelChange] = field(default_factory=list)
    on_change: Callable[[LevelChange], None] | None = None

    def _triggers(self, level: int, s: Signals, *, margin: bool) -> list[str]:
        """Why ``level`` holds: its thresholds reached (``margin``: minus the hysteresis band)."""
        c, i = self.config, level - 1
        hbm_t = c.hbm[i] - (c.hbm_hysteresis if margin else 0.0)
        queue_t = c.queue[i] * ((1 - c.queue_hysteresis) if margin else 1.0)
        health_t = c.health[i] - (c.health_hysteresis if margin else 0.0)
        why = []
        if math.isfinite(c.hbm[i]) and s.hbm >= hbm_t:
            why.append(f"HBM use {s.hbm:.3f} >= {hbm_t:.3f}")
        if math.isfinite(c.queue[i]) and s.queue >= queue_t:
            why.append(f"queue depth {s.queue:g} >= {queue_t:g}")
        if math.isfinite(c.health[i]) and s.health >= health_t:
            why.append(f"health score {s.health:.2f} >= {health_t:.2f}")
        return why

    def wanted(self, s: Signals) -> int:
        """The highest level whose enter trigger holds now."""
        return max([0] + [lv for lv in range(1, MAX_LEVEL + 1) if self._triggers(lv, s, margin=False)])

    def evaluate(self, s: Signals, now: float) -> LevelChange | None:
        """One step of the controller; returns the change it made, if any."""
        if not self.config.enabled or now - self.since < self.config.min_dwell_s:
            return None
        if self.wanted(s) > self.level:
            to = self.level + 1
            reason = f"L{to} trigger: " + "; ".join(self._triggers(to, s, margin=False) or
                                                     self._triggers(self.wanted(s), s, margin=False))
        elif self.level > 0 and not self._triggers(self.level, s, margin=True):
            to = self.level - 1
            reason = f"L{self.level} released: no signal within its hysteresis band"
        else:
            return None
        change = LevelChange(self.level, to, reason, s, now)
        self.level, self.since = to, now
        self.history.append(change)
        log.warning("degradation L%d -> L%d: %s", change.from_level, to, reason)
        if self.on_change is not None:
            self.on_change(change)
        return change

    def reset(self, now: float) -> LevelChange | None:
        """Back to Level 0 at once (the feature was turned off at run time)."""
        if self.level == 0:
            return None
        change = LevelChange(self.level, 0, "degradation disabled", Signals(), now)
        self.level, self.since = 0, now
        self.history.append(change)
        if self.on_change is not None:
            self.on_change(change)
        return change

    def public(self) -> dict[str, Any]:
        c = self.config
        return {"level": self.level, "name": LEVEL_NAMES[self.level], "enabled": c.enabled,
                "thresholds": {f"L{lv}": {name: _finite(getattr(c, name)[lv - 1]) for name in ("hbm", "queue", "health")}
                               for lv in range(1, MAX_LEVEL + 1)},
                "min_dwell_s": c.min_dwell_s,
                "history": [ch.to_event() | {"at": ch.at} for ch in self.history[-50:]]}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity


class DegradationActions:
    """What each level does, applied to the routing table's workers (the controller's ``on_change``):

    - L1+: admission control: a new request is answered 429 with Retry-After once
      ``l1_queue_cap`` requests already wait for a placement (``admit``);
    - L2+: speculative decoding off on every worker (restored on the way down if it was on);
    - L3+: KV offload on (``SetOffloadCommand``, threshold 85 %) unless ``offload_enabled`` is false;
    - L4+: max_tokens capped and long prompts cut to their last tokens, marked in the response;
    - L5: new requests answered 503 while in-flight ones finish.

    Workers that (re)join, or missed a command, are reconciled from their heartbeat: a worker that
    still reports speculation on at L2+ is told again."""

    def __init__(self, config: DegradationConfig, table: RoutingTable, events: EventLog, *,
                 offload_enabled: bool, offload_threshold: float) -> None:
        self.controller = DegradationController(config, on_change=self.apply)
        self.table, self.events = table, events
        self.offload_enabled, self.offload_threshold = offload_enabled, offload_threshold
        self.counters = {"rejected_429": 0, "rejected_503": 0, "degraded_requests": 0}
        self._spec_before = False

    def admit(self, request: GenerateRequest) -> tuple[GenerateRequest, str | None]:
        """Admission under the current level: raises 429/503, or returns the (capped) request and
        the marker the response carries when Level 4 changed it."""
        level, c, waiting = self.controller.level, self.controller.config, self.table.waiting
        if level >= 5:
            self.counters["rejected_503"] += 1
            raise _retry_later(f"the cluster is at degradation Level 5 (circuit open): new requests are refused "
                               f"while in-flight ones finish; retry after {c.retry_after_s} s", 503, "circuit_open",
                               c.retry_after_s)
        if level >= 1 and waiting >= c.l1_queue_cap:
            self.counters["rejected_429"] += 1
            raise _retry_later(f"admission control (degradation Level {level}): {waiting} requests "
                               f"already wait for KV capacity (cap {c.l1_queue_cap}); retry after {c.retry_after_s} s",
                               429, "overloaded", c.retry_after_s)
        if level < 4:
            return request, None
        notes = []
        params, prompt = request.params, request.prompt_token_ids
        if params.max_tokens > c.l4_max_tokens:
            notes.append(f"max_tokens capped from {params.max_tokens} to {c.l4_max_tokens}")
            params = replace(params, max_tokens=c.l4_max_tokens)
        if len(prompt) > c.l4_max_prompt_tokens and not request.resume_token_ids:
            notes.append(f"context truncated from {len(prompt)} to its last {c.l4_max_prompt_tokens} tokens")
            prompt = prompt[-c.l4_max_prompt_tokens:]
        if not notes:
            return request, None
        self.counters["degraded_requests"] += 1
        marker = f"degradation Level {level}: " + "; ".join(notes)
        return replace(request, params=params, prompt_token_ids=list(prompt)), marker

    def _send_all(self, msg: Message) -> None:
        for w in self.table.workers.values():
            w.send(msg)

    def apply(self, change: LevelChange) -> None:
        c = self.controller.config
        a, b = change.from_level, change.to_level
        actions: dict[str, Any] = {}
        if a < 2 <= b:
            self._spec_before = any(bool(w.stats.get("spec_enabled")) for w in self.table.healthy(WorkerRole.DECODE))
            self._send_all(SetSpeculativeCommand(False))
            actions["speculative"] = "off"
        elif b < 2 <= a:
            if self._spec_before:
                self._send_all(SetSpeculativeCommand(True))
            actions["speculative"] = "restored" if self._spec_before else "stays off (was off before Level 2)"
        if a < 3 <= b:
            if self.offload_enabled:
                self._send_all(SetOffloadCommand(True, self.offload_threshold))
                actions["offload"] = f"on (threshold {self.offload_threshold})"
            else:
                actions["offload"] = "NOT enabled: router.offload_enabled is false"
        elif b < 3 <= a:
            self._send_all(SetOffloadCommand(False, self.offload_threshold))
            actions["offload"] = "off"
        if b >= 1:
            actions["admission_queue_cap"] = c.l1_queue_cap
        if b >= 4:
            actions["max_tokens_cap"] = c.l4_max_tokens
            actions["max_prompt_tokens"] = c.l4_max_prompt_tokens
        if b >= 5:
            actions["new_requests"] = "rejected (503)"
        self.events.record(EventKind.DEGRADATION_LEVEL, **change.to_event(), actions=actions)

    def reconcile(self, w: RouterWorker) -> None:
        level = self.controller.level
        if level >= 2 and w.stats.get("spec_enabled"):
            w.send(SetSpeculativeCommand(False))
        offload_on = w.stats.get("offload_enabled")
        if offload_on is not None and self.offload_enabled and bool(offload_on) != (level >= 3):
            w.send(SetOffloadCommand(level >= 3, self.offload_threshold))


def _retry_later(message: str, status: int, code: str, retry_after: int) -> InvalidRequestError:
    exc = InvalidRequestError(message, status=status, code=code)
    exc.retry_after = retry_after  # the API answers it as a Retry-After header
    return exc


__all__ = ["DegradationActions", "DegradationConfig", "DegradationController", "LEVEL_NAMES", "LevelChange",
           "MAX_LEVEL", "Signals"]
