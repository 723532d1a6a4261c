"""The control protocol's framing and validation: the only way messages go on and come off the wire.

Each control connection (worker -> router's control port) carries frames of a 4-byte big-endian
length and a JSON object ``{"v": VERSION, "type": KIND, ...fields}``. ``encode`` and ``decode``
are the only way in and out: a frame that is not JSON, names an unknown kind or another protocol
version, lacks a required field, carries an unknown one or a value of the wrong type is refused
with ``MessageError`` naming what is wrong; the reading side logs it and drops that frame (it never
takes the router or the worker down).

A kind's fields are checked by a pydantic ``TypeAdapter`` built once per kind from the dataclass'
annotations, in strict mode: an int is not a bool, a string is not a number, a float field takes an
int. Messages are built unvalidated on the sending side (they come from this code); only what
arrives is checked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import typing
from dataclasses import MISSING, fields
from typing import Any

import typing_extensions
from pydantic import ConfigDict, TypeAdapter, ValidationError

from harness.engine.control.messages import KINDS, Message
from harness.errors import EngineError

log = logging.getLogger(__name__)

VERSION = 1
_LEN = struct.Struct("!I")
MAX_MSG_BYTES = 64 << 20


class MessageError(EngineError):
    """A control frame that is not a valid message of this protocol version."""


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
    checker = _checker(cls)
    values = {k: v for k, v in data.items() if k not in ("v", "type")}
    try:
        return cls(**checker.adapter.validate_python(values))
    except ValidationError as exc:
        raise _refusal(kind, checker, exc) from None


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


class _Checker(typing.NamedTuple):
    adapter: TypeAdapter
    hints: dict[str, Any]   # field name -> its annotation as written (for the error's fix)


_CHECKERS: dict[type, _Checker] = {}


def _checker(cls: type[Message]) -> _Checker:
    """``cls``' fields as a strict, closed TypedDict (fields with a default may be left out)."""
    if cls not in _CHECKERS:
        hints = typing.get_type_hints(cls, include_extras=True)
        spec = {f.name: (hints[f.name] if f.default is MISSING and f.default_factory is MISSING
                         else typing_extensions.NotRequired[hints[f.name]]) for f in fields(cls)}
        shape = typing_extensions.TypedDict(f"{cls.__name__}Fields", spec)
        shape.__pydantic_config__ = ConfigDict(strict=True, extra="forbid")
        written = {f.name: f.type for f in fields(cls)}
        _CHECKERS[cls] = _Checker(TypeAdapter(shape), written)
    return _CHECKERS[cls]


def _refusal(kind: str, checker: _Checker, exc: ValidationError) -> MessageError:
    """One MessageError for pydantic's findings: unknown fields first, then the first missing or
    mistyped one, named as ``kind.field``."""
    errors = exc.errors()
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return MessageError(f"{kind}: unknown field(s) {unknown}", fix=f"{kind} has fields {sorted(checker.hints)}")
    first = errors[0]
    name = str(first["loc"][0])
    if first["type"] == "missing":
        return MessageError(f"{kind}: required field {name!r} is missing", fix=f"send {name}")
    where = name + "".join(f"[{part}]" for part in first["loc"][1:] if isinstance(part, int))  # list items
    return MessageError(f"{kind}.{where}: {first['input']!r} is not of type {checker.hints[name]} ({first['msg']})",
                        fix=f"send {name} as {checker.hints[name]}")


__all__ = ["MAX_MSG_BYTES", "MessageError", "VERSION", "decode", "encode", "frame", "from_dict",
           "read_frame", "read_message", "read_raw", "to_dict"]
