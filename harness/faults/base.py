"""The Fault contract, the kind registry and the activity record.

A fault is one effect on one target on one host. Its life is inject -> verify -> revert ->
verify_reverted, each step run by :class:`harness.faults.runner.FaultRunner` with the executor of
the fault's host. Adding a fault is one subclass: a ``@dataclass`` with a unique ``kind`` and the
five methods below; its dataclass fields are what the ledger stores, so a fresh process (the next
run after a SIGKILL, or ``python -m harness revert``) can rebuild it with :meth:`Fault.from_ledger`
and revert it. Fields that cannot be stored (Python callables) carry ``metadata={"ledger": False}``.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness.errors import FaultError
from harness.hosts import Executor

LEDGER_FIELD = "ledger"  # dataclass field metadata key: False keeps a field out of the ledger


class Action(str, enum.Enum):
    """One activity in a fault's life; each becomes one FaultRecord."""

    INJECT = "inject"
    VERIFY = "verify"
    REVERT = "revert"
    VERIFY_REVERTED = "verify_reverted"


class RecordStatus(str, enum.Enum):
    """Fixed vocabulary for how an activity ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DRY_RUN = "dry_run"    # printed, not run


@dataclass
class FaultRecord:
    """One activity (inject, verify, revert, verify_reverted) of one fault, for report and timeline."""

    fault_id: str
    kind: str
    target: str
    action: Action
    started_wall: float       # time.time()
    started_mono: float       # time.monotonic(), to line up with load records of the same process
    ended_wall: float = 0.0
    ended_mono: float = 0.0
    status: RecordStatus = RecordStatus.SUCCEEDED
    output: str = ""
    error: str | None = None

    @property
    def duration_s(self) -> float:
        return max(0.0, self.ended_mono - self.started_mono)

    @classmethod
    def start(cls, fault: Fault, action: Action) -> FaultRecord:
        return cls(fault.fault_id, fault.kind, fault.target, action, time.time(), time.monotonic())

    def finish(self, status: RecordStatus, output: str = "", error: str | None = None) -> FaultRecord:
        self.ended_wall, self.ended_mono = time.time(), time.monotonic()
        self.status, self.output, self.error = status, output, error
        return self

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["action"] = self.action.value
        d["status"] = self.status.value
        d["duration_s"] = self.duration_s
        return d


class Fault(ABC):
    """Base of every fault. Subclasses are dataclasses that set ``kind`` and implement the steps.

    Each step takes the :class:`~harness.hosts.Executor` for ``self.host`` and returns a
    one-line description of what it did (the record's output). ``verify`` and ``verify_reverted``
    raise :class:`FaultError` when the effect (or its absence) cannot be proven; ``revert`` must be
    idempotent and must never touch anything but the original target (a reused pid, say).
    """

    kind: ClassVar[str]
    registry: ClassVar[dict[str, type[Fault]]] = {}
    # every subclass dataclass defines these two fields:
    host: str        # executor key: "localhost" or a host the cluster's ExecutorPool knows
    fault_id: str    # field(default_factory=new_fault_id)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:  # an intermediate abstract class
            return
        other = Fault.registry.get(kind)
        # the same class defined again (a module reload) may re-register; another class may not
        if other is not None and (other.__module__, other.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"fault kind {kind!r} is already registered by {other.__module__}.{other.__qualname__}")
        Fault.registry[kind] = cls

    @property
    @abstractmethod
    def target(self) -> str:
        """Human description of what the fault hits, e.g. ``decode-0 pid 4242 @ localhost``."""

    def prepare(self, executor: Executor) -> str:
        """Resolve what a safe revert needs (e.g. the process start time) before the ledger entry is written."""
        return ""

    @abstractmethod
    def inject(self, executor: Executor) -> str: ...

    @abstractmethod
    def verify(self, executor: Executor) -> str: ...

    @abstractmethod
    def revert(self, executor: Executor) -> str: ...

    @abstractmethod
    def verify_reverted(self, executor: Executor) -> str: ...

    @abstractmethod
    def plan(self) -> list[str]:
        """Exactly the commands and actions inject..verify_reverted would run, one line each."""

    def to_ledger(self) -> dict[str, Any]:
        if not dataclasses.is_dataclass(self):
            raise TypeError(f"{type(self).__name__} must be a dataclass (or override to_ledger/from_ledger)")
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get(LEDGER_FIELD, True)}
        return {"kind": self.kind, **data}

    @classmethod
    def from_ledger(cls, data: dict[str, Any]) -> Fault:
        """Rebuild a fault of any registered kind from its :meth:`to_ledger` dict."""
        kind = data.get("kind")
        sub = Fault.registry.get(kind)  # type: ignore[arg-type]
        if sub is None:
            raise FaultError(f"ledger entry has unknown fault kind {kind!r} (known: {sorted(Fault.registry)})",
                             fix="revert it with the harness version that injected it, or by hand")
        return sub._from_fields({k: v for k, v in data.items() if k != "kind"})

    @classmethod
    def _from_fields(cls, fields: dict[str, Any]) -> Fault:
        names = {f.name for f in dataclasses.fields(cls) if f.metadata.get(LEDGER_FIELD, True)}  # type: ignore[arg-type]
        unknown = set(fields) - names
        if unknown:
            raise FaultError(f"ledger entry for {cls.kind!r} has unknown fields {sorted(unknown)}",
                             fix="revert it with the harness version that injected it, or by hand")
        return cls(**fields)


def no_ledger(**kwargs: Any) -> Any:
    """A dataclass field that stays out of the ledger (e.g. a Python callable hook)."""
    return field(metadata={LEDGER_FIELD: False}, **kwargs)
