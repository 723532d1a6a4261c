"""KV transfer wire format and what both ends share: frames, checksums, pooled host buffers
and per-path counters (seed Section 3.2); writing frames (checksummed while sent, gathered) is
wire_send.py. The protocol that moves frames is in transfer.py (sender) and receiver.py (receiver).

Wire format of one frame (network byte order)::

    fixed   magic "KVF1", version, kind, flags, dtype code, ndim, reserved,
            layer_start, layer_end, request-id length, payload length, raw length,
            aux (END: first token id)
    var     shape (ndim x u32), request id (utf-8)
    u32     crc32c of fixed + var
    payload payload length bytes (zstd-compressed when flags has FLAG_ZSTD)
    u32     crc32c of the payload (a trailer, so the sender checksums while it sends)
"""

from __future__ import annotations

import bisect
import enum
import itertools
import json
import math
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Callable

import crc32c
import torch
import zstandard

from harness.errors import KVIntegrityError

MAGIC = b"KVF1"
VERSION = 1
FLAG_ZSTD = 0x01
PATH_FABRIC = "fabric"    # primary: the KV/fabric NIC (the RDMA analog)
PATH_CONTROL = "control"  # fallback: relayed over the control network

_FIXED = struct.Struct("!4sBBBBBBHHHQQq")
U32 = struct.Struct("!I")  # the header's and the payload's crc32c
_MAX_RID_BYTES = 256
_SMALL_FRAME = 64 << 10  # payloads up to this size are read in one go into fresh memory
_LAND_IOV = 64  # views one read lands in at most: 1 MiB of 16 KiB views, about the L2 cache, measured best
SLICE_BYTES = 1 << 20  # slices: the socket timeout means "no progress", and each is checksummed while cached

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
                torch.int8: 5, torch.uint8: 6}
_DTYPES = {code: dt for dt, code in _DTYPE_CODES.items()}
_NUMPY_DTYPES = frozenset(_DTYPE_CODES) - {torch.bfloat16}


class FrameKind(enum.IntEnum):
    DATA = 1   # KV of layers [layer_start, layer_end): tensor [layers, 2 (k, v), tokens, kv_heads, head_dim]
    QUERY = 2  # sender asks which layers the receiver still misses
    END = 3    # every layer was sent; aux = first token id; the receiver commits when complete
    REPLY = 4  # receiver's answer to QUERY / END; payload is JSON


class CorruptFrameError(KVIntegrityError):
    """A frame failed a checksum or consistency check. ``in_sync`` says whether the stream is
    still aligned on frame boundaries (payload damage) or must be closed (header damage)."""

    def __init__(self, message: str, *, reason: str, in_sync: bool) -> None:
        self.reason = reason
        self.in_sync = in_sync
        super().__init__(message)


class TruncatedFrameError(KVIntegrityError):
    """The stream ended inside a frame."""


@dataclass
class Frame:
    kind: FrameKind
    request_id: str
    layer_start: int = 0
    layer_end: int = 0
    dtype: torch.dtype = torch.uint8
    shape: tuple[int, ...] = (0,)
    # raw (uncompressed) bytes, or a list of parts sent back to back (scatter-gather: the sender
    # hands each layer's K and V tensors' own memory, with no staging copy)
    payload: bytes | bytearray | memoryview | list = b""
    aux: int = 0
    buffer: torch.Tensor | None = None  # pooled memory under ``payload``, given back when consumed
    landed: bool = False  # DATA whose verified payload went straight to its destination (``read_frame``)

    @classmethod
    def from_tensor(cls, request_id: str, layer_start: int, kv: torch.Tensor) -> "Frame":
        """kv: [layers, 2, tokens, kv_heads, head_dim], any device; copied to host bytes."""
        if kv.dtype not in _DTYPE_CODES:
            raise KVIntegrityError(f"dtype {kv.dtype} cannot be sent; supported: {sorted(map(str, _DTYPE_CODES))}")
        raw, host, _ = host_buffer(tuple(kv.shape), kv.dtype)
        host.copy_(kv.detach())  # the only copy on the send side: device/strided -> wire bytes
        return cls(FrameKind.DATA, request_id, layer_start, layer_start + kv.shape[0], kv.dtype,
                   tuple(kv.shape), raw)

    @classmethod
    def reply(cls, request_id: str, body: dict) -> "Frame":
        data = json.dumps(body).encode()
        return cls(FrameKind.REPLY, request_id, shape=(len(data),), payload=data)

    def tensor(self) -> torch.Tensor:
        buf = self.payload if isinstance(self.payload, (bytearray, memoryview)) else bytearray(self.payload)
        if not len(buf):
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def body(self) -> dict:
        return json.loads(bytes(self.payload).decode())


class BufferPool:
    """Reusable host buffers. Fresh memory page-faults on first touch, which halves loopback
    throughput on a receive (measured: bench/bench_transfer.py); recycled buffers do not."""

    def __init__(self, max_free_bytes: int = 512 << 20) -> None:
        self._free: list[torch.Tensor] = []  # flat uint8
        self._lock = threading.Lock()
        self.max_free_bytes = max_free_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel())
            while sum(b.numel() for b in self._free) > self.max_free_bytes:
                self._free.pop(0)  # drop the smallest: big buffers are the costly ones to fault in


SEND_POOL = BufferPool()


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype,
                pool: BufferPool | None = None) -> tuple[memoryview, torch.Tensor, torch.Tensor]:
    """Host memory as wire bytes and as a tensor of ``shape`` viewing them, so a tensor copy lands
    straight in the frame payload; returns (bytes, tensor, underlying buffer for ``pool.give``)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flat = pool.take(nbytes) if pool is not None else torch.empty(max(nbytes, 1), dtype=torch.uint8)
    used = flat[:nbytes]
    return memoryview(used.numpy()), used.view(dtype).view(shape), flat


def encode_frame(frame: Frame, compressor: zstandard.ZstdCompressor | None = None) -> tuple[bytes, bytes]:
    """Return (header, wire payload); the header ends with the crc32c of itself. A payload given
    as a list of parts stays a list (``send_frame`` sends them in order) unless compressed."""
    raw = frame.payload
    wire, flags = raw, 0
    if compressor is not None and payload_len(raw):
        wire, flags = compressor.compress(b"".join(raw) if isinstance(raw, list) else raw), FLAG_ZSTD
    rid = frame.request_id.encode()
    if len(rid) > _MAX_RID_BYTES:
        raise KVIntegrityError(f"request id is {len(rid)} bytes; at most {_MAX_RID_BYTES} fit in a frame")
    head = _FIXED.pack(MAGIC, VERSION, int(frame.kind), flags, _DTYPE_CODES[frame.dtype], len(frame.shape), 0,
                       frame.layer_start, frame.layer_end, len(rid), payload_len(wire), payload_len(raw), frame.aux)
    head += struct.pack(f"!{len(frame.shape)}I", *frame.shape) + rid
    return head + U32.pack(crc32c.crc32c(head)), wire


def payload_len(payload) -> int:
    return sum(map(len, payload)) if isinstance(payload, list) else len(payload)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous (any dtype, bfloat16 too)."""
    if t.is_contiguous() and t.dim() and t.is_cpu and not t.requires_grad:  # the common case
        if t.dtype in _NUMPY_DTYPES:
            return t.numpy().data.cast("B")  # a third of the time of going through a uint8 view
        return memoryview(t.view(torch.uint8).numpy()).cast("B")  # bfloat16: no numpy dtype
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, n: int, *, at_boundary: bool = False) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if at_boundary and got == 0:
                return None
            raise TruncatedFrameError(f"connection closed after {got} of {n} bytes of a frame")
        got += k
    return buf


def _recv_payload(sock: socket.socket, n: int, buf: torch.Tensor | None) -> tuple[memoryview, int]:
    """Receive n payload bytes into ``buf`` (flat uint8, fresh memory when None), checksumming
    each slice while it is still in cache; returns (bytes, crc32c)."""
    if buf is None:
        buf = torch.empty(max(n, 1), dtype=torch.uint8)
    view = memoryview(buf[:n].numpy())
    got, crc = 0, 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, SLICE_BYTES))
        if k == 0:
            raise TruncatedFrameError(f"connection closed after {got} of {n} payload bytes")
        crc = crc32c.crc32c(view[got:got + k], crc)
        got += k
    return view, crc


def read_frame(sock: socket.socket, max_frame_bytes: int = 1 << 31, pool: BufferPool | None = None,
               into: Callable | None = None) -> Frame | None:
    """Read and verify one frame; None on a clean end of stream between frames. With ``pool``,
    the payload lands in a pooled buffer (``frame.buffer``) that the caller gives back. With
    ``into``, an uncompressed DATA frame asks ``into(rid, layer_start, layer_end, dtype, shape,
    nbytes)`` for its destination once the header verified: (views, done) receives the payload
    straight into the views, in order, and calls ``done(crc_ok)``; the frame returns ``landed``."""
    fixed = _recv_exact(sock, _FIXED.size, at_boundary=True)
    if fixed is None:
        return None
    magic, version, kind, flags, dtype_code, ndim, _, ls, le, rid_len, wire_len, raw_len, aux = _FIXED.unpack(fixed)
    if magic != MAGIC or version != VERSION:
        raise CorruptFrameError(f"bad magic/version {magic!r}/{version}", reason="header", in_sync=False)
    if rid_len > _MAX_RID_BYTES or ndim > 8:
        raise CorruptFrameError("header field out of range", reason="header", in_sync=False)
    var = _recv_exact(sock, 4 * ndim + rid_len + U32.size)
    (head_crc,) = U32.unpack(var[-4:])
    if crc32c.crc32c(bytes(fixed) + bytes(var[:-4])) != head_crc:
        raise CorruptFrameError("header crc32c mismatch", reason="header", in_sync=False)
    if wire_len > max_frame_bytes or raw_len > max_frame_bytes:
        raise CorruptFrameError(f"frame of {max(wire_len, raw_len)} bytes exceeds max_frame_bytes={max_frame_bytes}",
                                reason="too_large", in_sync=False)
    shape = struct.unpack(f"!{ndim}I", bytes(var[:4 * ndim]))
    rid = bytes(var[4 * ndim:4 * ndim + rid_len]).decode(errors="replace")
    if into is not None and kind == FrameKind.DATA and not flags & FLAG_ZSTD and dtype_code in _DTYPES \
            and wire_len == raw_len:
        landing = into(rid, ls, le, _DTYPES[dtype_code], shape, raw_len)
        if landing is not None:
            return _land(sock, landing, rid, ls, le, _DTYPES[dtype_code], shape, wire_len, aux)
    if wire_len <= _SMALL_FRAME:  # END, QUERY, REPLY: payload and trailer in one read, no pooled buffer
        rest = _recv_exact(sock, wire_len + U32.size)
        payload = memoryview(rest)[:wire_len]
        return _verify(kind, flags, dtype_code, ls, le, rid, shape, payload, crc32c.crc32c(payload),
                       U32.unpack_from(rest, wire_len)[0], raw_len, aux, None)
    buffer = pool.take(wire_len) if pool is not None else None
    try:
        payload, crc = _recv_payload(sock, wire_len, buffer)
        (payload_crc,) = U32.unpack(_recv_exact(sock, U32.size))
    except BaseException:
        if buffer is not None:
            pool.give(buffer)
        raise
    try:
        frame = _verify(kind, flags, dtype_code, ls, le, rid, shape, payload, crc, payload_crc, raw_len, aux, buffer)
    except CorruptFrameError:
        if buffer is not None:
            pool.give(buffer)
        raise
    if buffer is not None and frame.buffer is None:
        pool.give(buffer)
    return frame


def _land(sock: socket.socket, landing: tuple[list[memoryview], Callable[[bool], None]], rid: str, ls: int,
          le: int, dtype: torch.dtype, shape: tuple[int, ...], n: int, aux: int) -> Frame:
    views, done = landing
    ok = False
    try:
        trailer = bytearray(U32.size)
        bufs = [*views, memoryview(trailer)]  # the payload's crc32c trailer comes in the last read
        ends = list(itertools.accumulate(map(len, bufs)))  # where each buffer ends in the payload
        total, i, crc, summed = 0, 0, 0, 0
        while total < ends[-1]:
            start = total - (ends[i - 1] if i else 0)  # into buffer i, partly filled by the last read
            got = sock.recvmsg_into([bufs[i][start:], *bufs[i + 1:i + _LAND_IOV]] if start
                                    else bufs[i:i + _LAND_IOV])[0]
            if got == 0:
                raise TruncatedFrameError(f"connection closed after {total} of {n} payload bytes")
            total += got
            i = bisect.bisect_right(ends, total)  # buffers filled so far
            # checksum the views filled so far, whole, while the sender still sends and they are
            # in cache (a partly filled view waits for the next read)
            for view in views[summed:i]:
                crc = crc32c.crc32c(view, crc)
            summed = i
        ok = crc == U32.unpack(trailer)[0]
    finally:
        done(ok)
    if not ok:
        raise CorruptFrameError(f"payload crc32c mismatch in DATA frame of {rid} layers {ls}-{le}",
                                reason="crc", in_sync=True)
    return Frame(FrameKind.DATA, rid, ls, le, dtype, shape, b"", aux, landed=True)


def _verify(kind, flags, dtype_code, ls, le, rid, shape, payload, crc, payload_crc, raw_len, aux, buffer) -> Frame:
    try:
        kind, dtype = FrameKind(kind), _DTYPES[dtype_code]
    except (ValueError, KeyError):
        raise CorruptFrameError(f"unknown kind {kind} or dtype code {dtype_code}", reason="header",
                                in_sync=True) from None
    if crc != payload_crc:
        raise CorruptFrameError(f"payload crc32c mismatch in {kind.name} frame of {rid} layers {ls}-{le}",
                                reason="crc", in_sync=True)
    if flags & FLAG_ZSTD:
        try:
            payload = memoryview(bytearray(zstandard.ZstdDecompressor().decompress(payload,
                                                                                     max_output_size=raw_len)))
            buffer = None  # the payload lives apart from the wire buffer now
        except zstandard.ZstdError as exc:
            raise CorruptFrameError(f"zstd: {exc}", reason="codec", in_sync=True) from exc
    if len(payload) != raw_len or raw_len != math.prod(shape) * dtype.itemsize:
        raise CorruptFrameError(f"payload of {len(payload)} bytes does not match shape {shape} {dtype}",
                                reason="shape", in_sync=True)
    return Frame(kind, rid, ls, le, dtype, shape, payload, aux, buffer)


@dataclass(frozen=True)
class KVLayout:
    """What the decode side expects for one request (from its import handle)."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def close_socket(sock: socket.socket) -> None:
    """Shut down both directions first, so a thread blocked on this socket wakes up."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()

