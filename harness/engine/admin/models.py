"""Typed results of the bundled engine's admin API (harness/engine/admin/client.py's AdminClient).

Each result is a frozen dataclass with the fields the harness reads, checked when the answer is
parsed by a pydantic ``TypeAdapter`` of the dataclass: its annotations (strict types: no "5" for an
int, no true for 1) are the one statement of each field's type, and a missing or mistyped field is
a ProbeError naming the endpoint and the field, not a KeyError three calls later. ``raw`` keeps the
whole JSON object as the engine sent it, for evidence (it serialises as is) and for fields the
dataclass does not name.

The results also read like the JSON objects they came from (``w["id"]``, ``w.get("num_running",
0)``): the suites and checks written against the plain dicts keep working while they move to the
attributes. Events are different: an event log is open-ended (every event type has its own
fields) and every check consumes it as dicts, so events stay dicts, typed as ``EngineEvent``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError

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

    @classmethod
    def parse(cls: type[R], payload: Any, endpoint: str) -> R:
        if not isinstance(payload, dict):
            raise ProbeError(f"{endpoint} answered {type(payload).__name__}, not a JSON object", fix=_NOT_OURS_FIX)
        named = (f.name for f in dataclasses.fields(cls) if f.name != "raw")
        values = {name: payload[name] for name in named if payload.get(name) is not None}  # null: the default
        try:
            return _adapter(cls).validate_python({**values, "raw": payload})
        except ValidationError as exc:
            raise ProbeError(_first_problem(exc, endpoint, payload), fix=_NOT_OURS_FIX) from None

    # read-only mapping over the JSON object
    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


@functools.cache
def _adapter(cls: type[R]) -> TypeAdapter[R]:
    return TypeAdapter(cls)


# pydantic's error type -> the JSON type the field wanted, as the message says it
_EXPECTED = {"int_type": "int", "float_type": "int or float", "bool_type": "bool", "string_type": "str",
             "dict_type": "dict", "list_type": "list"}


def _first_problem(exc: ValidationError, endpoint: str, payload: dict[str, Any]) -> str:
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else "?"
    if error["type"] == "missing":
        return f"{endpoint}: the answer has no {name!r} (keys: {sorted(payload)[:12]})"
    expected = _EXPECTED.get(error["type"], error["msg"])
    return f"{endpoint}: {name!r} is {error.get('input')!r}, expected {expected}"


@dataclass(frozen=True)
class AdminWorker(AdminRecord):
    """One row of ``GET /admin/workers``."""

    id: StrictStr
    role: StrictStr
    health: StrictStr
    pid: StrictInt | None = None
    down_reason: StrictStr | None = None
    queue_depth: StrictInt = 0
    active_requests: StrictInt = 0
    num_running: StrictInt = 0
    kv_blocks_used: StrictInt = 0
    kv_blocks_total: StrictInt = 0
    kv_used_ratio: StrictFloat | None = None
    kv_blocks_poisoned: StrictInt = 0
    kv_blocks_quarantined: StrictInt = 0
    spec_enabled: StrictBool = False
    heartbeat_age_s: StrictFloat | None = None

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

    level: StrictInt
    name: StrictStr = ""
    enabled: StrictBool = True
    thresholds: dict = field(default_factory=dict)
    signals: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FaultState(AdminRecord):
    """A fault hook's state (``/admin/faults*``): the worker's ``fault_state`` answer. ``error`` is set
    when the worker refused the fault (the HTTP answer is still 200)."""

    fault_id: StrictStr
    kind: StrictStr | None = None
    worker: StrictStr | None = None
    active: StrictBool = False
    error: StrictStr | None = None
    kv_used_ratio: StrictFloat | None = None

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

    request_id: StrictStr
    source: StrictStr
    target: StrictStr
    reason: StrictStr = ""
    total_s: StrictFloat = 0.0
    num_tokens: StrictInt = 0


@dataclass(frozen=True)
class DrainResult(AdminRecord):
    """``POST /admin/drain``: what moved off the worker, what failed to, what was left on it."""

    worker: StrictStr
    migrated: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    left: list = field(default_factory=list)


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
           "AdminWorker", "event_list"]
