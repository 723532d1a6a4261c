"""The router <-> worker control protocol's message kinds: each a dataclass, registered by its wire
``type`` (``KINDS``); ``codec`` frames, validates and decodes them.

Router -> worker: ``Welcome`` / ``Refused`` (answer to ``Register``), ``Import``, ``Prefill``,
``Abort``, ``SetSpeculativeCommand``, ``SetOffloadCommand``, ``CorruptFrames``, the fault hooks
``HbmFillCommand``, ``HbmReleaseCommand``, ``EccPoisonCommand``, ``EccClearCommand``, and live
migration's ``MigrateIn`` / ``MigrateOut``.
Worker -> router: ``Register``, ``Heartbeat``, ``Progress``, ``Tokens``, ``TransferEvent``,
``ImportReady`` / ``ImportFailed``, ``PrefillDone`` / ``PrefillFailed``, ``FaultStateReport``, and
``MigrateReady``, ``MigrateCommitted``, ``Migrated``, ``MigrateFailed``.

The fault-hook and settings kinds end in ``Command``/``Report`` so that they are never mistaken for
``harness.faults``' classes of the same idea (``HbmFill`` there is the fault, ``HbmFillCommand`` here
the message that sets it); the wire ``type`` strings are unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, ClassVar

from pydantic import Strict

from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.states import TransferEventKind


@dataclass
class Message:
    TYPE: ClassVar[str] = ""


KINDS: dict[str, type[Message]] = {}


def _kind(name: str):
    """Class decorator: a dataclass message of wire type ``name``, registered for decoding."""
    def register(cls: type[Message]) -> type[Message]:
        cls = dataclass(cls)
        cls.TYPE = name
        KINDS[name] = cls
        return cls
    return register


# ---------------------------------------------------------------- handshake


@_kind("register")
class Register(Message):
    id: str
    role: str
    pid: int
    kv_addr: list
    control_addr: list
    kv_blocks_total: int
    block_size: int


@_kind("welcome")
class Welcome(Message):
    heartbeat_interval_s: float
    progress_interval_s: float = 0.0


@_kind("refused")
class Refused(Message):
    error: str


# ---------------------------------------------------------------- worker -> router: liveness


@_kind("heartbeat")
class Heartbeat(Message):
    stats: dict
    transfer: dict
    queue_depth: int = 0


@_kind("progress")
class Progress(Message):
    steps: int


# ---------------------------------------------------------------- router -> worker: requests


@_kind("import")
class Import(Message):
    """Decode worker: reserve blocks for ``rid``'s KV and wait for it."""
    rid: str
    prompt_token_ids: list[int]
    resume_token_ids: list[int]
    params: dict    # SamplingParams fields
    attempt: int = 0   # the request's placement: 0 the first, n > 0 re-placed after a lost or hung worker

    def request(self) -> GenerateRequest:
        return GenerateRequest(self.rid, list(self.prompt_token_ids), sampling_params(self.params),
                               resume_token_ids=list(self.resume_token_ids))


@_kind("prefill")
class Prefill(Import):
    """Prefill worker: compute ``rid``'s KV and send it to ``target`` ({"kv": [host, port], "control": ...})."""
    transfer: dict = field(default_factory=dict)   # TransferConfig fields
    target: dict = field(default_factory=dict)


@_kind("abort")
class Abort(Message):
    rid: str


@_kind("set_speculative")
class SetSpeculativeCommand(Message):
    enabled: bool


@_kind("set_offload")
class SetOffloadCommand(Message):
    enabled: bool
    threshold: float | None = None


@_kind("fault")
class CorruptFrames(Message):
    """Fault hook: corrupt the next ``corrupt_frames`` KV frames this prefill worker sends."""
    corrupt_frames: int = 0


# ---------------------------------------------------------------- fault hooks (answered by FaultStateReport)


@_kind("hbm_fill")
class HbmFillCommand(Message):
    fault_id: str = ""
    share: float = 0.0


@_kind("hbm_release")
class HbmReleaseCommand(Message):
    fault_id: str = ""


@_kind("ecc_poison")
class EccPoisonCommand(Message):
    fault_id: str = ""
    count: int | None = None
    blocks: list[int] | None = None


@_kind("ecc_clear")
class EccClearCommand(Message):
    fault_id: str = ""


FAULT_COMMANDS = (HbmFillCommand, HbmReleaseCommand, EccPoisonCommand, EccClearCommand)


@_kind("fault_state")
class FaultStateReport(Message):
    fault_id: str
    kind: str                       # "hbm_fill" | "ecc_poison"
    active: bool
    kv_used_ratio: float
    kv_blocks_poisoned: int
    kv_blocks_quarantined: int
    error: str | None = None
    blocks: Any = None              # hbm: how many held; ecc: which block ids
    requested_blocks: int | None = None
    device_bytes: int | None = None
    affected: list | None = None
    ecc_handling: bool | None = None
    restored: int | None = None

    def public(self) -> dict:
        """The reply as the admin API shows it: its type and the fields that are set."""
        return {"type": self.TYPE, **{f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}}


# ---------------------------------------------------------------- worker -> router: requests


@_kind("import_ready")
class ImportReady(Message):
    rid: str


@_kind("import_failed")
class ImportFailed(Message):
    rid: str
    error: str


@_kind("prefill_failed")
class PrefillFailed(Message):
    rid: str
    error: str


@_kind("prefill_done")
class PrefillDone(Message):
    rid: str
    prefill_s: float
    path: str
    bytes: int
    seconds: float
    retries: int
    fallback: bool


@_kind("tokens")
class Tokens(Message):
    rid: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    error: str | None = None


@_kind("transfer_event")
class TransferEvent(Message):
    rid: str
    event: Annotated[TransferEventKind, Strict(False)]   # the wire carries the kind's string
    detail: dict = field(default_factory=dict)


# ---------------------------------------------------------------- live migration (worker_migration.py)


@_kind("migrate_in")
class MigrateIn(Message):
    rid: str
    request: dict       # GenerateRequest fields (request_dict)
    num_tokens: int
    generated: list[int]


@_kind("migrate_out")
class MigrateOut(Message):
    rid: str
    num_tokens: int
    target_kv: list
    max_kv_tokens: int | None = None
    target_id: str | None = None
    target_control: list | None = None
    transfer: dict = field(default_factory=dict)


@_kind("migrate_ready")
class MigrateReady(Message):
    rid: str
    num_tokens: int
    max_kv_tokens: int


@_kind("migrate_committed")
class MigrateCommitted(Message):
    rid: str
    import_s: float


@_kind("migrated")
class Migrated(Message):
    rid: str
    source: str
    target: str | None
    export_s: float
    transfer_s: float
    bytes: int
    path: str
    retries: int
    fallback: bool
    extra_tokens: int


@_kind("migrate_failed")
class MigrateFailed(Message):
    rid: str
    error: str
    side: str = ""          # "source" | "target"
    resumed: bool | None = None


MIGRATION_REPLIES = (MigrateReady, MigrateCommitted, Migrated, MigrateFailed)


# ---------------------------------------------------------------- request helpers


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """``params`` as Import, Prefill and MigrateIn carry them (JSON types only)."""
    return {**asdict(params), "stop": list(params.stop)}


def sampling_params(data: dict) -> SamplingParams:
    params = dict(data or {})
    params["stop"] = tuple(params.get("stop", ()))
    return SamplingParams(**params)


def request_dict(req: GenerateRequest, rid: str) -> dict[str, Any]:
    """``req`` as MigrateIn carries it, under attempt id ``rid``."""
    return {"request_id": rid, "prompt_token_ids": list(req.prompt_token_ids), "params": params_dict(req.params),
            "resume_token_ids": list(req.resume_token_ids), "arrival_time": req.arrival_time}


def request_from_dict(data: dict, rid: str) -> GenerateRequest:
    return GenerateRequest(rid, list(data["prompt_token_ids"]), sampling_params(data.get("params") or {}),
                           resume_token_ids=list(data.get("resume_token_ids", ())))


__all__ = ["FAULT_COMMANDS", "KINDS", "MIGRATION_REPLIES", "Message", "params_dict", "request_dict",
           "request_from_dict", "sampling_params", *(c.__name__ for c in KINDS.values())]
