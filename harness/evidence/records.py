"""The fault records scenarios return and checks judge (harness/evidence/: the layer below both)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientFault:
    """One fault as the client-view measurement needs it: wall time (time.time()) and victims."""

    wall: float
    victims: tuple[str, ...]
    role: str | None = None      # "prefill", "decode", "aggregated" or None: for the report and the counts per role
    label: str = ""
    inject_s: float = 0.0        # how long the inject step took: the fault took effect somewhere inside it


@dataclass(frozen=True)
class KillWindow:
    """One kill: its phase ("idle" or "loaded"), the fault (wall time, victim), and the rise of the
    engine's migration counter over the kill's window (None: the engine has no counter)."""

    phase: str
    fault: ClientFault
    migrations: float | None = None
    window_s: float = 5.0        # how long after the kill a stream's switch is looked for
    counter: str | None = None   # what ``migrations`` counted, e.g. 'dynamo_frontend_model_migration{migration_type="ongoing_request"}'


__all__ = ["ClientFault", "KillWindow"]
