"""The states and kinds the engine and the checks share: worker health, worker role, event kind.

Each is an ``enum.StrEnum``: a member *is* its string (``WorkerHealth.HEALTHY == "healthy"``,
``json.dumps`` writes ``"healthy"``), so the admin API's wire form, the event log's JSON and code
that still compares against the plain strings all stay the same. A leaf: imports nothing of the
harness.
"""

from __future__ import annotations

import enum


class WorkerHealth(enum.StrEnum):
    """A worker as the router counts it (``/admin/workers`` ``health``)."""
    HEALTHY = "healthy"
    DEAD = "dead"          # its control connection closed, or it missed heartbeats/progress


class WorkerRole(enum.StrEnum):
    """What a worker does: one half of the disaggregated pipeline, or both (a cluster file's
    aggregated worker; the emulated engine runs only the two halves, ``PD_ROLES``)."""
    PREFILL = "prefill"
    DECODE = "decode"
    AGGREGATED = "aggregated"


PD_ROLES: tuple[WorkerRole, ...] = (WorkerRole.PREFILL, WorkerRole.DECODE)


class TransferEventKind(enum.StrEnum):
    """What a KV sender reports about one transfer (the ``event`` of a TransferEvent message)."""
    STREAM_ERROR = "stream_error"
    FALLBACK = "fallback"
    RETRY = "retry"


class EventKind(enum.StrEnum):
    """The ``type`` of an entry in the router's event log (``/admin/events``)."""
    WORKER_UP = "worker_up"
    WORKER_DOWN = "worker_down"
    RESCHEDULE = "reschedule"
    RESCHEDULE_FAILED = "reschedule_failed"
    RESUMED = "resumed"
    KV_TRANSFER = "kv_transfer"
    TRANSFER_STREAM_ERROR = "transfer_stream_error"
    TRANSFER_FALLBACK = "transfer_fallback"
    TRANSFER_RETRY = "transfer_retry"
    TRANSFER_CONFIG = "transfer_config"
    FAULT_HOOK = "fault_hook"
    FAULT_STATE = "fault_state"
    HEALTH_DECISION = "health_decision"
    SPECULATIVE = "speculative"
    DEGRADATION_LEVEL = "degradation_level"
    MIGRATION_STARTED = "migration_started"
    MIGRATION_DONE = "migration_done"
    MIGRATION_FAILED = "migration_failed"
    MIGRATION_MOOT = "migration_moot"
    MIGRATION_RESUMED = "migration_resumed"
    DRAIN_STARTED = "drain_started"
    DRAIN_DONE = "drain_done"
    DRAIN_ENDED = "drain_ended"

    @classmethod
    def of_transfer(cls, kind: TransferEventKind | str) -> EventKind:
        """The event-log kind a worker's TransferEvent is recorded under."""
        return cls(f"transfer_{TransferEventKind(kind)}")


__all__ = ["PD_ROLES", "EventKind", "TransferEventKind", "WorkerHealth", "WorkerRole"]
