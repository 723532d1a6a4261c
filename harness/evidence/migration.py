"""One watched hot-migration attempt (6.1.2): what harness/scenarios/migration.py observed and
harness/checks/migration.py judges."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OUTCOMES = ("migrated", "refused", "unobservable")


@dataclass
class MigrationAttempt:
    phase: str
    index: int
    outcome: str                      # one of OUTCOMES
    detail: str = ""
    source: str | None = None         # the worker the stream ran on when the migration was asked
    request_id: str | None = None     # the engine's id of the stream (SSE ``id``)
    at_tokens: int | None = None      # tokens the client had when the migration was asked
    done: dict[str, Any] | None = field(default=None, repr=False)  # the router's migration_done event

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["MigrationAttempt", "OUTCOMES"]
