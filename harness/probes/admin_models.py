"""Typed results of the bundled engine's admin API (harness/probes/admin.py's AdminClient).

Each result is a frozen dataclass with the fields the harness reads, checked when the answer is
parsed (a missing or mistyped field is a ProbeError naming the endpoint and the field, not a
KeyError three calls later), plus ``raw``: the whole JSON object as the engine sent it, for
evidence (it serialises as is) and for fields the dataclass does not name.

The results also read like the JSON objects they came from (``w["id"]``, ``w.get("num_running",
0)``): the suites and checks written against the plain dicts keep working while they move to the
attributes. Events are different: an event log is open-ended (every event type has its own
fields) and every check consumes it as dicts, so events stay dicts, typed as ``EngineEvent``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict, TypeVar

from harness.errors import ProbeError

R = TypeVar("R", bound="AdminRecord")

_NOT_OURS_FIX = ("point the admin URL at the bundled engine's PD router (endpoints.admin), or leave it unset "
                 "for an engine without that API")


class EngineEvent(TypedDict, total=False):
    """One entry of ``GET /admin/events`` (``Router.record_event``): these four keys always, then
    the event type's own fields (``worker``, ``reason``, ``request_id``, ...)."""

    seq: int
    type: str
    wall_time: float
    monotonic: float


@dataclass(frozen=True)
class AdminRecord(Mapping):
    """Base of the typed results: named fields parsed from ``raw``, read-only dict access to ``raw``."""

    raw: dict[str, Any] = field(repr=False, compare=False)
    #: field name -> accepted JSON types; the fields without a default must be present
    _types: ClassVar[dict[str, tuple[type, ...]]] = {}

    @classmethod
    def parse(cls: type[R], payload: Any, endpoint: str) -> R:
        if not isinstance(payload, dict):
            raise ProbeError(f"{endpoint} answered {type(payload).__name__}, not a JSON object", fix=_NOT_OURS_FIX)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "raw":
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if f.name not in payload or payload[f.name] is None:
                if required:
                    raise ProbeError(f"{endpoint}: the answer has no {f.name!r} (keys: {sorted(payload)[:12]})",
                                     fix=_NOT_OURS_FIX)
                continue
            value, types = payload[f.name], cls._types.get(f.name)
            if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                raise ProbeError(f"{endpoint}: {f.name!r} is {value!r}, expected "
                                 f"{' or '.join(t.__name__ for t in types)}", fix=_NOT_OURS_FIX)
            values[f.name] = value
        return cls(raw=payload, **values)

    # read-only mapping over the JSON object
    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


_STR, _INT, _NUM, _BOOL = (str,), (int,), (int, float), (bool,)


@dataclass(frozen=True)
class Worker(AdminRecord):
    """One row of ``GET /admin/workers``."""

    id: str
    role: str
    health: str
    pid: int | None = None
    down_reason: str | None = None
    queue_depth: int = 0
    active_requests: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_used_ratio: float | None = None
    kv_blocks_poisoned: int = 0
    kv_blocks_quarantined: int = 0
    spec_enabled: bool = False
    heartbeat_age_s: float | None = None
    _types: ClassVar[dict[str, tuple[type, ...]]] = {
        "id": _STR, "role": _STR, "health": _STR, "pid": _INT, "queue_depth": _INT, "active_requests": _INT,
        "num_running": _INT, "kv_blocks_used": _INT, "kv_blocks_total": _INT, "kv_used_ratio": _NUM,
        "kv_blocks_poisoned": _INT, "kv_blocks_quarantined": _INT, "spec_enabled": _BOOL, "heartbeat_age_s": _NUM}

    @property
    def healthy(self) -> bool:
        return self.health == "healthy"

    @property
    def busy(self) -> bool:
        """Serving at least one request (placed on it, or running in its engine)."""
        return self.active_requests > 0 or self.num_running > 0


@dataclass(frozen=True)
class DegradationState(AdminRecord):
    """``GET /admin/degradation``: the level, its thresholds, the signals that drive it, its history."""

    level: int
    name: str = ""
    enabled: bool = True
    thresholds: dict = field(default_factory=dict)
    signals: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    _types: ClassVar[dict[str, tuple[type, ...]]] = {
        "level": _INT, "name": _STR, "enabled": _BOOL, "thresholds": (dict,), "signals": (dict,),
        "history": (list,), "counters": (dict,)}


@dataclass(frozen=True)
class FaultState(AdminRecord):
    """A fault hook's state (``/admin/faults*``): the worker's ``fault_state`` answer. ``error`` is set
    when the worker refused the fault (the HTTP answer is still 200)."""

    fault_id: str
    kind: str | None = None
    worker: str | None = None
    active: bool = False
    error: str | None = None
    kv_used_ratio: float | None = None
    _types: ClassVar[dict[str, tuple[type, ...]]] = {
        "fault_id": _STR, "kind": _STR, "worker": _STR, "active": _BOOL, "error": _STR, "kv_used_ratio": _NUM}

    @property
    def blocks(self) -> Any:
        """Block count (HBM fill) or block ids (ECC poisoning), as the worker reports them."""
        return self.raw.get("blocks")

    @property
    def affected(self) -> list[str]:
        return list(self.raw.get("affected") or [])


@dataclass(frozen=True)
class MigrationResult(AdminRecord):
    """``POST /admin/migrate``: the router's ``migration_done`` event for the request it moved."""

    request_id: str
    source: str
    target: str
    reason: str = ""
    total_s: float = 0.0
    num_tokens: int = 0
    _types: ClassVar[dict[str, tuple[type, ...]]] = {
        "request_id": _STR, "source": _STR, "target": _STR, "reason": _STR, "total_s": _NUM, "num_tokens": _INT}


@dataclass(frozen=True)
class DrainResult(AdminRecord):
    """``POST /admin/drain``: what moved off the worker, what failed to, what was left on it."""

    worker: str
    migrated: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    left: list = field(default_factory=list)
    _types: ClassVar[dict[str, tuple[type, ...]]] = {
        "worker": _STR, "migrated": (list,), "failed": (list,), "left": (list,)}


def event_list(payload: Any, endpoint: str) -> list[EngineEvent]:
    """Check ``GET /admin/events``'s answer: a list of objects, each with an int ``seq`` and a ``type``."""
    items = payload.get("events") if isinstance(payload, dict) else payload
    if not isinstance(items, list):
        raise ProbeError(f"{endpoint} did not return a list (got {type(items).__name__})", fix=_NOT_OURS_FIX)
    for e in items:
        if not isinstance(e, dict) or not isinstance(e.get("seq"), int) or not isinstance(e.get("type"), str):
            raise ProbeError(f"{endpoint}: an entry is not an event with an int 'seq' and a 'type': {e!r:.200}",
                             fix=_NOT_OURS_FIX)
    return items  # type: ignore[return-value]


__all__ = ["AdminRecord", "DegradationState", "DrainResult", "EngineEvent", "FaultState", "MigrationResult",
           "Worker", "event_list"]
