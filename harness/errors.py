"""One error root for the whole project, with specific subclasses.

Every error a user can see says what went wrong and how to fix it. Raise the most
specific subclass; add a new one here rather than raising bare exceptions.
"""

from __future__ import annotations


class HarnessError(Exception):
    """Root of every error this project raises on purpose."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.fix = fix
        self.message = message  # without the fix: for a caller that states its own
        super().__init__(f"{message} (fix: {fix})" if fix else message)


class ConfigError(HarnessError):
    """A configuration input (cluster file, checklist, CLI option) is invalid."""


class EngineError(HarnessError):
    """The reference engine failed in a way the caller must handle."""


class InvalidRequestError(EngineError, ValueError):
    """A client request is malformed, unsupported or too large (answered with 4xx)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        self.param = param
        self.code = code
        self.status = status
        super().__init__(message)


class KVIntegrityError(EngineError):
    """A KV block or transfer frame failed its checksum or shape check; it must not be used."""


class KVTransferError(EngineError):
    """KV could not be delivered to a decode worker on any path (primary retries and fallback spent)."""


class KVCapacityError(EngineError):
    """The KV block pool has too few free blocks for what was asked (wait, free or offload)."""


class WorkerDeadError(EngineError):
    """A worker process died or stopped answering; its requests must be rescheduled."""


class FaultError(HarnessError):
    """A fault could not be injected, or did not take effect when verified."""


class RevertError(FaultError):
    """A fault could not be reverted: the cluster may be dirty (exit code 4)."""


class ExecutorError(HarnessError):
    """A command could not be run on a host (local or SSH)."""


class ProbeError(HarnessError):
    """A measurement could not be taken."""
