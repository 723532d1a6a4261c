"""The router <-> worker control protocol: every message kind as a typed dataclass, one framing.

Each control connection (worker -> router's control port) carries frames of a 4-byte big-endian
length and a JSON object ``{"v": VERSION, "type": KIND, ...fields}``. ``encode`` and ``decode``
are the only way in and out: a frame that is not JSON, names an unknown kind or another protocol
version, lacks a required field, carries an unknown one or a value of the wrong type is refused
with ``MessageError`` naming what is wrong; the reading side logs it and drops that frame (it never
takes the router or the worker down).

Router -> worker: ``Welcome`` / ``Refused`` (answer to ``Register``), ``Import``, ``Prefill``,
``Abort``, ``SetSpeculative``, ``SetOffload``, ``CorruptFrames``, the fault hooks ``HbmFill``,
``HbmRelease``, ``EccPoison``, ``EccClear``, and live migration's ``MigrateIn`` / ``MigrateOut``.
Worker -> router: ``Register``, ``Heartbeat``, ``Progress``, ``Tokens``, ``TransferEvent``,
``ImportReady`` / ``ImportFailed``, ``PrefillDone`` / ``PrefillFailed``, ``FaultState``, and
``MigrateReady``, ``MigrateCommitted``, ``Migrated``, ``MigrateFailed``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Union

from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.errors import EngineError

log = logging.getLogger(__name__)

VERSION = 1
_LEN = struct.Struct("!I")
MAX_MSG_BYTES = 64 << 20


class MessageError(EngineError):
    """A control frame that is not a valid message of this protocol version."""


@dataclass
class Message:
    TYPE: ClassVar[str] = ""


KINDS: dict[str, type[Message]] = {}


def _kind(name: str):
    """Class decorator: a dataclass message of wire type ``name``, registered for ``decode``."""
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
class SetSpeculative(Message):
    enabled: bool


@_kind("set_offload")
class SetOffload(Message):
    enabled: bool
    threshold: float | None = None


@_kind("fault")
class CorruptFrames(Message):
    """Fault hook: corrupt the next ``corrupt_frames`` KV frames this prefill worker sends."""
    corrupt_frames: int = 0


# ---------------------------------------------------------------- fault hooks (answered by FaultState)


@_kind("hbm_fill")
class HbmFill(Message):
    fault_id: str = ""
    share: float = 0.0


@_kind("hbm_release")
class HbmRelease(Message):
    fault_id: str = ""


@_kind("ecc_poison")
class EccPoison(Message):
    fault_id: str = ""
    count: int | None = None
    blocks: list[int] | None = None


@_kind("ecc_clear")
class EccClear(Message):
    fault_id: str = ""


FAULT_COMMANDS = (HbmFill, HbmRelease, EccPoison, EccClear)


@_kind("fault_state")
class FaultState(Message):
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
        """The reply as the admin API shows it: the fields that are set."""
        return {k: v for k, v in to_dict(self).items() if k != "v" and v is not None}


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
    event: str
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


# ---------------------------------------------------------------- encode / decode


def to_dict(msg: Message) -> dict[str, Any]:
    return {"v": VERSION, "type": msg.TYPE, **{f.name: getattr(msg, f.name) for f in fields(msg)}}


def from_dict(data: Any) -> Message:
    """The typed message in ``data``; MessageError names what is wrong with it."""
    if not isinstance(data, dict):
        raise MessageError(f"a control message must be a JSON object, got {type(data).__name__}",
                           fix="send {\"v\": %d, \"type\": ..., fields}" % VERSION)
    kind = data.get("type")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown control message type {kind!r}", fix=f"use one of {sorted(KINDS)}")
    if data.get("v") != VERSION:
        raise MessageError(f"{kind}: protocol version {data.get('v')!r} is not {VERSION}",
                           fix="run the router and the workers from the same harness version")
    hints = _hints(cls)
    values = {k: v for k, v in data.items() if k not in ("v", "type")}
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise MessageError(f"{kind}: unknown field(s) {unknown}", fix=f"{kind} has fields {sorted(hints)}")
    for f in fields(cls):
        if f.name not in values:
            if f.default is MISSING and f.default_factory is MISSING:
                raise MessageError(f"{kind}: required field {f.name!r} is missing", fix=f"send {f.name}")
            continue
        if not _fits(values[f.name], hints[f.name]):
            raise MessageError(f"{kind}.{f.name}: {values[f.name]!r} is not of type {hints[f.name]}",
                               fix=f"send {f.name} as {hints[f.name]}")
    return cls(**values)


def frame(data: dict) -> bytes:
    """Length-prefixed JSON (the framing only; ``encode`` is the typed way in)."""
    body = json.dumps(data, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def encode(msg: Message) -> bytes:
    return frame(to_dict(msg))


def decode(body: bytes) -> Message:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise MessageError(f"control frame is not JSON: {exc}", fix="send length-prefixed JSON") from None
    return from_dict(data)


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One frame's body, or None when the peer closed the connection. An oversized length cannot
    be skipped safely (the stream has lost its framing): MessageError, and the caller hangs up."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if n > MAX_MSG_BYTES:
            raise MessageError(f"control frame of {n} bytes exceeds {MAX_MSG_BYTES}",
                               fix="the peer does not speak this protocol")
        return await reader.readexactly(n)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


async def read_message(reader: asyncio.StreamReader, peer: str = "peer") -> Message | None:
    """The next valid message, or None when the connection closed. Invalid frames are refused
    (logged with the reason) and skipped."""
    while (body := await read_frame(reader)) is not None:
        try:
            return decode(body)
        except MessageError as exc:
            log.warning("refused a control message from %s: %s (%s)", peer, exc, body[:200])
    return None


async def read_raw(reader: asyncio.StreamReader) -> dict | None:
    """The next frame as a plain dict (test peers that speak the wire format directly)."""
    body = await read_frame(reader)
    return None if body is None else json.loads(body)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k != "TYPE"}
    return _HINTS[cls]


def _fits(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)




__all__ = ["KINDS", "MAX_MSG_BYTES", "Message", "MessageError", "VERSION", "decode",
           "encode", "frame", "from_dict", "read_message", "read_raw", "to_dict",
           *(c.__name__ for c in KINDS.values())]
