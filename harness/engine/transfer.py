"""KV transfer data plane between a prefill and a decode worker (seed Sections 3.2 and 3.3).

A prefill worker streams each request's KV to the chosen decode worker over TCP, layer by layer
while later layers still compute (``mode="layerwise"``), or all at once after prefill
(``mode="whole"``, kept for comparison). Every frame carries the request id, layer range, dtype,
shape and crc32c checksums of its header and payload; the receiver verifies both and never hands
a corrupt or truncated frame to the engine. The sender asks the receiver which layers are still
missing, resends them with exponential backoff (tenacity), and when the primary path (the
fabric NIC) is spent, delivers over the fallback path (the decode worker's listener on the
control network). Bytes, seconds, retries, failures and fallbacks are counted per path.

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

import collections
import enum
import json
import logging
import math
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import crc32c
import torch
import zstandard
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from harness.errors import ConfigError, KVIntegrityError, KVTransferError

log = logging.getLogger(__name__)

MAGIC = b"KVF1"
VERSION = 1
FLAG_ZSTD = 0x01
PATH_FABRIC = "fabric"    # primary: the KV/fabric NIC (the RDMA analog)
PATH_CONTROL = "control"  # fallback: relayed over the control network

_FIXED = struct.Struct("!4sBBBBBBHHHQQq")
_U32 = struct.Struct("!I")
_MAX_RID_BYTES = 256
_SEND_SLICE = 1 << 20  # slices: the socket timeout means "no progress", and each is checksummed while cached

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
                torch.int8: 5, torch.uint8: 6}
_DTYPES = {code: dt for dt, code in _DTYPE_CODES.items()}


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
    payload: bytes | bytearray | memoryview = b""  # raw (uncompressed) bytes
    aux: int = 0
    buffer: torch.Tensor | None = None  # pooled memory under ``payload``, given back when consumed

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
    """Return (header, wire payload); the header ends with the crc32c of itself."""
    raw = frame.payload
    wire, flags = raw, 0
    if compressor is not None and raw:
        wire, flags = compressor.compress(raw), FLAG_ZSTD
    rid = frame.request_id.encode()
    if len(rid) > _MAX_RID_BYTES:
        raise KVIntegrityError(f"request id is {len(rid)} bytes; at most {_MAX_RID_BYTES} fit in a frame")
    head = _FIXED.pack(MAGIC, VERSION, int(frame.kind), flags, _DTYPE_CODES[frame.dtype], len(frame.shape), 0,
                       frame.layer_start, frame.layer_end, len(rid), len(wire), len(raw), frame.aux)
    head += struct.pack(f"!{len(frame.shape)}I", *frame.shape) + rid
    return head + _U32.pack(crc32c.crc32c(head)), wire


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
        k = sock.recv_into(view[got:], min(n - got, _SEND_SLICE))
        if k == 0:
            raise TruncatedFrameError(f"connection closed after {got} of {n} payload bytes")
        crc = crc32c.crc32c(view[got:got + k], crc)
        got += k
    return view, crc


def read_frame(sock: socket.socket, max_frame_bytes: int = 1 << 31, pool: BufferPool | None = None) -> Frame | None:
    """Read and verify one frame; None on a clean end of stream between frames. With ``pool``,
    the payload lands in a pooled buffer (``frame.buffer``) that the caller gives back."""
    fixed = _recv_exact(sock, _FIXED.size, at_boundary=True)
    if fixed is None:
        return None
    magic, version, kind, flags, dtype_code, ndim, _, ls, le, rid_len, wire_len, raw_len, aux = _FIXED.unpack(fixed)
    if magic != MAGIC or version != VERSION:
        raise CorruptFrameError(f"bad magic/version {magic!r}/{version}", reason="header", in_sync=False)
    if rid_len > _MAX_RID_BYTES or ndim > 8:
        raise CorruptFrameError("header field out of range", reason="header", in_sync=False)
    var = _recv_exact(sock, 4 * ndim + rid_len + _U32.size)
    (head_crc,) = _U32.unpack(var[-4:])
    if crc32c.crc32c(bytes(fixed) + bytes(var[:-4])) != head_crc:
        raise CorruptFrameError("header crc32c mismatch", reason="header", in_sync=False)
    if wire_len > max_frame_bytes or raw_len > max_frame_bytes:
        raise CorruptFrameError(f"frame of {max(wire_len, raw_len)} bytes exceeds max_frame_bytes={max_frame_bytes}",
                                reason="too_large", in_sync=False)
    shape = struct.unpack(f"!{ndim}I", bytes(var[:4 * ndim]))
    rid = bytes(var[4 * ndim:4 * ndim + rid_len]).decode(errors="replace")
    buffer = pool.take(wire_len) if pool is not None else None
    try:
        payload, crc = _recv_payload(sock, wire_len, buffer)
        (payload_crc,) = _U32.unpack(_recv_exact(sock, _U32.size))
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


def send_frame(sock: socket.socket, head: bytes, wire: bytes | bytearray | memoryview,
               crc: int | None = None) -> int:
    """Send header, payload and the payload's crc32c trailer, checksumming each slice just before
    it is sent (one pass over memory); ``crc`` overrides the trailer (the corruption fault hook)."""
    sock.sendall(head)
    view, running = memoryview(wire), 0
    for off in range(0, len(view), _SEND_SLICE):
        piece = view[off:off + _SEND_SLICE]
        running = crc32c.crc32c(piece, running)
        sock.sendall(piece)
    sock.sendall(_U32.pack(running if crc is None else crc))
    return len(head) + len(wire) + _U32.size


# ---------------------------------------------------------------- configuration and counters


@dataclass
class TransferConfig:
    mode: str = "layerwise"          # "layerwise" (stream during prefill) or "whole" (after prefill)
    compression: str | None = None   # None or "zstd"
    zstd_level: int = 1
    layers_per_frame: int = 1
    timeout_s: float = 2.0           # a socket operation making no progress this long fails the attempt
    max_retries: int = 3             # per path, after the first attempt
    backoff_base_s: float = 0.01     # seed 3.3: 10 ms x 2^attempt
    backoff_max_s: float = 0.5
    fallback_enabled: bool = True
    max_frame_bytes: int = 1 << 31

    def __post_init__(self) -> None:
        if self.mode not in ("layerwise", "whole"):
            raise ConfigError(f"transfer mode {self.mode!r} is unknown", fix="use 'layerwise' or 'whole'")
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"compression {self.compression!r} is unknown", fix="use null or 'zstd'")
        if self.layers_per_frame < 1 or self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_base_s < 0:
            raise ConfigError("layers_per_frame >= 1, max_retries >= 0, timeout_s > 0 and backoff_base_s >= 0 "
                              f"are required, got {self}", fix="correct the transfer section of the config")

    @classmethod
    def from_dict(cls, data: dict | None) -> "TransferConfig":
        return config_from_dict(cls, data, "transfer")


def config_from_dict(cls, data: dict | None, section: str):
    """Build config dataclass ``cls`` from a mapping, refusing unknown keys by name."""
    data = dict(data or {})
    unknown = set(data) - set(cls.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown {section} options {sorted(unknown)}",
                          fix=f"use only {sorted(cls.__dataclass_fields__)}")
    return cls(**data)


class TransferStats:
    """Thread-safe per-path counters; ``snapshot()`` is JSON-able and travels in heartbeats."""

    SENDER_FIELDS = ("bytes", "seconds", "frames", "transfers", "retries", "failures", "fallbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[str, dict[str, float]] = {}
        self._rejected: collections.Counter[str] = collections.Counter()
        self._received = {"frames": 0, "bytes": 0}

    def add(self, path: str, **deltas: float) -> None:
        with self._lock:
            counters = self._paths.setdefault(path, dict.fromkeys(self.SENDER_FIELDS, 0))
            for name, value in deltas.items():
                counters[name] += value

    def received(self, nbytes: int) -> None:
        with self._lock:
            self._received["frames"] += 1
            self._received["bytes"] += nbytes

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"paths": {p: dict(c) for p, c in self._paths.items()},
                    "received": dict(self._received), "rejected": dict(self._rejected)}


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path: str = PATH_FABRIC


@dataclass
class TransferResult:
    request_id: str
    path: str          # the path that delivered it
    bytes: int         # wire bytes sent on every path, retries included
    seconds: float
    retries: int
    fallback: bool
    frames: int


class _AttemptFailed(Exception):
    """One delivery attempt failed in a retryable way."""


# ---------------------------------------------------------------- sender


class KVSender:
    """Delivers one request's KV. Call ``send_layer`` from the prefill loop (it never blocks on
    the network), then ``finish(first_token_id)``, which blocks until the receiver confirmed every
    layer and committed, or raises KVTransferError."""

    def __init__(self, request_id: str, num_layers: int, primary: Endpoint, fallback: Endpoint | None,
                 config: TransferConfig, stats: TransferStats, *, corrupt_frames: int = 0,
                 on_event=None) -> None:
        self.request_id, self.num_layers = request_id, num_layers
        self.primary, self.fallback = primary, fallback if config.fallback_enabled else None
        self.config, self.stats = config, stats
        self._corrupt_left = corrupt_frames  # fault hook: damage the wire copy of the next N frames
        self._on_event = on_event or (lambda kind, **kw: None)
        self._compressor = zstandard.ZstdCompressor(level=config.zstd_level) if config.compression else None
        self._frames: dict[int, tuple[int, int, bytes, bytes]] = {}  # start -> (start, end, head, wire)
        self._open: tuple | None = None  # (start, layers, bytes, tensor, buffer) of the frame being filled
        self._buffers: list[torch.Tensor] = []  # pooled; given back once delivered
        self._last_layer = -1
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stream_sock: socket.socket | None = None
        self._stream_broken = False
        self._cancelled = threading.Event()
        self._sent_bytes = 0
        self._frames_sent = 0
        self._t0 = time.perf_counter()
        self._thread: threading.Thread | None = None
        if config.mode == "layerwise":
            self._thread = threading.Thread(target=self._stream, name=f"kv-send-{request_id}", daemon=True)
            self._thread.start()

    # -- producer side (prefill loop)
    def send_layer(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] of layer ``layer_idx``; layers arrive in order."""
        if layer_idx != self._last_layer + 1 or layer_idx >= self.num_layers:
            raise KVIntegrityError(f"layer {layer_idx} arrived after layer {self._last_layer} "
                                   f"(of {self.num_layers})", fix="call send_layer once per layer, in order")
        self._last_layer = layer_idx
        if self._open is None:
            n = min(self.config.layers_per_frame, self.num_layers - layer_idx)
            self._open = (layer_idx, n, *host_buffer((n, 2, *k.shape), k.dtype, SEND_POOL))  # [n, 2, T, H, D]
        start, n, raw, buf, flat = self._open
        buf[layer_idx - start, 0].copy_(k.detach())
        buf[layer_idx - start, 1].copy_(v.detach())
        if layer_idx - start + 1 == n:
            self._open = None
            self._queue.put(Frame(FrameKind.DATA, self.request_id, start, start + n, k.dtype, tuple(buf.shape), raw,
                                  buffer=flat))

    def cancel(self) -> None:
        self._cancelled.set()
        sock = self._stream_sock
        if sock is not None:
            _close(sock)

    def finish(self, first_token_id: int) -> TransferResult:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()
        else:
            self._encode_all_queued()
        try:
            if len(self._covered()) != self.num_layers:
                raise KVIntegrityError(f"{self.request_id}: {len(self._covered())} of {self.num_layers} layers "
                                       "produced", fix="call send_layer for every layer before finish")
            return self._deliver(first_token_id)
        finally:
            self._frames.clear()
            for buf in self._buffers:
                SEND_POOL.give(buf)
            self._buffers = []

    def _deliver(self, first_token_id: int) -> TransferResult:
        retries, used_fallback = 0, False
        paths = [self.primary] + ([self.fallback] if self.fallback else [])
        last_error: Exception | None = None
        for n_path, endpoint in enumerate(paths):
            if n_path:
                used_fallback = True
                self.stats.add(endpoint.path, fallbacks=1)
                self._on_event("fallback", path=endpoint.path, error=str(last_error))
                log.warning("%s: %s path failed (%s); falling back to %s", self.request_id, self.primary.path,
                            last_error, endpoint.path)
            retrying = Retrying(stop=stop_after_attempt(self.config.max_retries + 1),
                                wait=wait_exponential(multiplier=self.config.backoff_base_s,
                                                      max=self.config.backoff_max_s),
                                retry=retry_if_exception_type(_AttemptFailed), reraise=True)
            try:
                for attempt in retrying:
                    with attempt:
                        n = attempt.retry_state.attempt_number
                        if n > 1:
                            retries += 1
                            self.stats.add(endpoint.path, retries=1)
                            self._on_event("retry", path=endpoint.path, attempt=n, error=str(last_error))
                        try:
                            self._attempt(endpoint, first=(n_path == 0 and n == 1), first_token_id=first_token_id)
                        except _AttemptFailed as exc:
                            last_error = exc
                            self.stats.add(endpoint.path, failures=1)
                            raise
            except _AttemptFailed:
                continue
            seconds = time.perf_counter() - self._t0
            self.stats.add(endpoint.path, transfers=1)
            return TransferResult(self.request_id, endpoint.path, self._sent_bytes, seconds, retries,
                                  used_fallback, self._frames_sent)
        raise KVTransferError(f"KV of {self.request_id} not delivered on {[p.path for p in paths]}: {last_error}",
                              fix="check the decode worker's KV listeners and the fabric/control links")

    # -- internals
    def _covered(self) -> set[int]:
        return {layer for s, e, _, _ in self._frames.values() for layer in range(s, e)}

    def _encode(self, frame: Frame) -> tuple[int, int, bytes, bytes]:
        head, wire = encode_frame(frame, self._compressor)
        if frame.buffer is not None:
            if wire is frame.payload:
                self._buffers.append(frame.buffer)  # still needed for resends
            else:
                SEND_POOL.give(frame.buffer)  # compressed: the raw buffer is free now
        entry = (frame.layer_start, frame.layer_end, head, wire)
        self._frames[frame.layer_start] = entry
        return entry

    def _encode_all_queued(self) -> None:
        while (frame := self._queue.get()) is not None:
            self._encode(frame)

    def _stream(self) -> None:
        """Layer-wise mode: send each frame as soon as its layers are computed."""
        t_path = None
        while (frame := self._queue.get()) is not None:
            entry = self._encode(frame)
            if self._stream_broken or self._cancelled.is_set():
                continue
            try:
                if self._stream_sock is None:
                    t_path = time.perf_counter()
                    self._stream_sock = _connect(self.primary, self.config.timeout_s)
                self._send(self._stream_sock, entry, self.primary.path)
            except OSError as exc:
                log.info("%s: layer stream to %s broke: %s", self.request_id, self.primary, exc)
                self._stream_broken = True
                self.stats.add(self.primary.path, failures=1)
                self._on_event("stream_error", path=self.primary.path, error=str(exc))
                if self._stream_sock is not None:
                    _close(self._stream_sock)
                    self._stream_sock = None
        if t_path is not None:
            self.stats.add(self.primary.path, seconds=time.perf_counter() - t_path)

    def _send(self, sock: socket.socket, entry: tuple[int, int, bytes, bytes], path: str) -> None:
        _, _, head, wire = entry
        crc = None
        if self._corrupt_left > 0:
            self._corrupt_left -= 1
            crc = crc32c.crc32c(wire)  # the trailer of the intact payload
            damaged = bytearray(wire)
            damaged[len(damaged) // 2] ^= 0xFF
            wire = damaged
            log.warning("%s: fault hook corrupted the frame of layers %d-%d", self.request_id, entry[0], entry[1])
        n = send_frame(sock, head, wire, crc)
        self._sent_bytes += n
        self._frames_sent += 1
        self.stats.add(path, bytes=n, frames=1)

    def _attempt(self, endpoint: Endpoint, *, first: bool, first_token_id: int) -> None:
        if self._cancelled.is_set():
            raise KVTransferError(f"transfer of {self.request_id} cancelled")
        t0 = time.perf_counter()
        sock = self._stream_sock if (first and not self._stream_broken) else None
        self._stream_sock = None
        try:
            if sock is None:
                sock = _connect(endpoint, self.config.timeout_s)
                if self._frames_sent:  # something may have arrived earlier: ask what is missing
                    send_frame(sock, *encode_frame(Frame(FrameKind.QUERY, self.request_id)))
                    missing = self._reply(sock)["missing"]
                else:
                    missing = sorted(self._covered())
                for start in sorted({s for s, e, _, _ in self._frames.values() for m in missing if s <= m < e}):
                    if self._cancelled.is_set():
                        raise KVTransferError(f"transfer of {self.request_id} cancelled")
                    self._send(sock, self._frames[start], endpoint.path)
            send_frame(sock, *encode_frame(Frame(FrameKind.END, self.request_id, 0, self.num_layers,
                                                 aux=first_token_id)))
            body = self._reply(sock)
            if not body["ok"]:
                raise _AttemptFailed(f"receiver misses layers {body['missing']}")
        except (OSError, KVIntegrityError) as exc:
            if self._cancelled.is_set():
                raise KVTransferError(f"transfer of {self.request_id} cancelled") from exc
            raise _AttemptFailed(f"{endpoint.path} {endpoint.host}:{endpoint.port}: {exc}") from exc
        finally:
            if sock is not None:
                _close(sock)
            self.stats.add(endpoint.path, seconds=time.perf_counter() - t0)

    def _reply(self, sock: socket.socket) -> dict:
        frame = read_frame(sock)
        if frame is None or frame.kind != FrameKind.REPLY:
            raise TruncatedFrameError("receiver closed the connection without a reply")
        body = frame.body()
        if body.get("fatal"):
            raise KVTransferError(f"decode worker refused KV of {self.request_id}: {body['fatal']}",
                                  fix="the decode side no longer expects this request (cancelled or unknown)")
        return body


def _connect(endpoint: Endpoint, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# ---------------------------------------------------------------- receiver


@dataclass(frozen=True)
class KVLayout:
    """What the decode side expects for one request (from its import handle)."""

    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class KVSink(Protocol):
    """The decode engine as the receiver sees it (the worker adapts its ImportHandles to this)."""

    def kv_layout(self, request_id: str) -> KVLayout | None: ...

    def kv_write(self, request_id: str, layer_start: int, kv: torch.Tensor, release: Callable[[], None]) -> None:
        """kv: [layers, 2, tokens, kv_heads, head_dim], already verified. ``kv`` views a pooled
        receive buffer: call ``release()`` once it is copied (the buffer then takes later frames)."""

    def kv_complete(self, request_id: str, first_token_id: int) -> None: ...


class KVReceiver:
    """Accepts KV connections on one or more addresses (fabric and control) and feeds verified
    layers to a KVSink. Progress per request survives across connections so a retry or the
    fallback path only resends what is missing."""

    def __init__(self, sink: KVSink, stats: TransferStats, *, max_frame_bytes: int = 1 << 31,
                 timeout_s: float = 30.0) -> None:
        self.sink, self.stats = sink, stats
        self.max_frame_bytes, self.timeout_s = max_frame_bytes, timeout_s
        self._lock = threading.Lock()
        self._have: dict[str, set[int]] = {}
        self._completed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._listeners: list[socket.socket] = []
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._pool = BufferPool()

    def listen(self, host: str, port: int, path: str) -> tuple[str, int]:
        srv = socket.create_server((host, port), reuse_port=False)
        self._listeners.append(srv)
        t = threading.Thread(target=self._accept, args=(srv, path), name=f"kv-accept-{path}", daemon=True)
        t.start()
        self._threads.append(t)
        return srv.getsockname()[:2]

    def forget(self, request_id: str) -> None:
        """The import was cancelled: drop progress so late frames are refused."""
        with self._lock:
            self._have.pop(request_id, None)

    def close(self) -> None:
        self._closed = True
        for s in self._listeners + list(self._conns):
            _close(s)
        for t in self._threads:
            t.join(timeout=5)

    def _accept(self, srv: socket.socket, path: str) -> None:
        while not self._closed:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn, path), name=f"kv-recv-{path}", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket, path: str) -> None:
        try:
            while True:
                try:
                    frame = read_frame(conn, self.max_frame_bytes, self._pool)
                except CorruptFrameError as exc:
                    self.stats.rejected(exc.reason)
                    log.warning("rejected a KV frame on %s: %s", path, exc)
                    if exc.in_sync:
                        continue
                    return
                except TruncatedFrameError as exc:
                    self.stats.rejected("truncated")
                    log.info("KV stream on %s truncated: %s", path, exc)
                    return
                if frame is None:
                    return
                if frame.kind == FrameKind.DATA:
                    self._on_data(frame, path)
                    continue
                if frame.buffer is not None:
                    self._pool.give(frame.buffer)
                if frame.kind in (FrameKind.QUERY, FrameKind.END):
                    send_frame(conn, *encode_frame(Frame.reply(frame.request_id, self._on_control(frame))))
        except OSError as exc:
            log.info("KV connection on %s ended: %s", path, exc)
        finally:
            self._conns.discard(conn)
            _close(conn)

    def _on_data(self, frame: Frame, path: str) -> None:
        released = threading.Event()

        def release() -> None:
            if frame.buffer is not None and not released.is_set():
                released.set()
                self._pool.give(frame.buffer)

        try:
            self._accept_data(frame, release)
        except BaseException:
            release()
            raise

    def _accept_data(self, frame: Frame, release: Callable[[], None]) -> None:
        layout = self.sink.kv_layout(frame.request_id)
        with self._lock:
            expected = layout is not None and frame.request_id in self._have
            if layout is not None and not expected and frame.request_id not in self._completed:
                self._have[frame.request_id] = set()
                expected = True
        if not expected:
            self.stats.rejected("unknown_request")
            release()
            return
        want = (frame.layer_end - frame.layer_start, 2, layout.num_tokens, layout.num_kv_heads, layout.head_dim)
        if (frame.dtype != layout.dtype or tuple(frame.shape) != want or frame.layer_start < 0
                or frame.layer_end > layout.num_layers):
            self.stats.rejected("shape")
            log.warning("%s: frame layers %d-%d %s %s does not match the import (%s %s)", frame.request_id,
                        frame.layer_start, frame.layer_end, frame.dtype, frame.shape, layout.dtype, want)
            release()
            return
        try:
            self.sink.kv_write(frame.request_id, frame.layer_start, frame.tensor(), release)
        except Exception as exc:  # the import was cancelled or failed under us
            release()
            self.stats.rejected("sink")
            log.info("%s: sink refused layers %d-%d: %s", frame.request_id, frame.layer_start, frame.layer_end, exc)
            return
        self.stats.received(len(frame.payload))
        with self._lock:
            if frame.request_id in self._have:
                self._have[frame.request_id].update(range(frame.layer_start, frame.layer_end))

    def _on_control(self, frame: Frame) -> dict:
        rid = frame.request_id
        with self._lock:
            if rid in self._completed:
                return {"ok": True, "missing": []}
        layout = self.sink.kv_layout(rid)
        if layout is None:
            return {"ok": False, "missing": [], "fatal": f"no import pending for {rid}"}
        with self._lock:
            have = self._have.setdefault(rid, set())
            missing = [i for i in range(layout.num_layers) if i not in have]
        if frame.kind == FrameKind.QUERY or missing:
            return {"ok": False, "missing": missing}
        try:
            self.sink.kv_complete(rid, frame.aux)
        except Exception as exc:
            return {"ok": False, "missing": [], "fatal": f"commit failed: {exc}"}
        with self._lock:
            self._have.pop(rid, None)
            self._completed[rid] = None
            while len(self._completed) > 4096:
                self._completed.popitem(last=False)
        return {"ok": True, "missing": []}
