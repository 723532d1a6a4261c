"""KV transfer data plane between a prefill and a decode worker (seed Sections 3.2 and 3.3).

A prefill worker streams each request's KV to the chosen decode worker over TCP, layer by layer
while later layers still compute (``mode="layerwise"``), or all at once after prefill
(``mode="whole"``, kept for comparison). Every frame carries the request id, layer range, dtype,
shape and crc32c checksums of its header and payload; the receiver verifies both and never hands
a corrupt or truncated frame to the engine. The sender asks the receiver which layers are still
missing, resends them with exponential backoff (seed 3.3), and when the primary path (the
fabric NIC) is spent, delivers over the fallback path (the decode worker's listener on the
control network). Bytes, seconds, retries, failures and fallbacks are counted per path.

Layer-wise frames and the END go out on the decode endpoint's persistent lane (lane.py: one
connection per decode worker, shared by every transfer to it, written by the producing thread
when it can and by the lane's writer thread otherwise); retries and
the fallback use connections of their own. The wire format and shared pieces are in wire.py,
the receiver in receiver.py; this module is the sender and its configuration, and re-exports the rest so callers import from one place.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import crc32c
import torch
import zstandard

from harness.engine.kvtransfer.lane import LANES, LaneBroken
from harness.engine.kvtransfer.lane_conn import EncodedFrame, LaneJob
from harness.engine.kvtransfer.receiver import KVReceiver, KVSink
from harness.engine.kvtransfer.wire import (PATH_CONTROL, PATH_FABRIC, BufferPool, CorruptFrameError, Frame, FrameKind,
                                            KVLayout, TruncatedFrameError, close_socket, encode_frame, read_frame,
                                            tensor_bytes)
from harness.engine.kvtransfer.wire_send import frame_buffers, send_frame
from harness.engine.kvtransfer.stats import TransferStats
from harness.engine.kvtransfer.config import TransferConfig, config_from_dict
from harness.errors import KVIntegrityError, KVTransferError
from harness.states import TransferEventKind

log = logging.getLogger(__name__)

__all__ = ["BufferPool", "CorruptFrameError", "Endpoint", "Frame", "FrameKind", "KVLayout", "KVReceiver", "KVSender",
           "KVSink", "PATH_CONTROL", "PATH_FABRIC", "TransferConfig", "TransferResult", "TransferStats",
           "TruncatedFrameError", "config_from_dict", "encode_frame", "read_frame", "send_frame"]


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
        self._frames: dict[int, EncodedFrame] = {}  # first layer -> the frame, kept for a retry
        self._open: tuple | None = None  # (start, layers, parts) of the frame being filled
        self._last_layer = -1
        self._whole: list[Frame] = []   # mode "whole": frames kept until finish
        self._lane = config.mode == "layerwise"  # else every frame goes after prefill, in finish
        self.lane_broken = False
        self.lane_conn = None  # the one lane connection its frames may go on (the lane sets it)
        self._lane_t0: float | None = None
        self._lane_ref = None  # the lane its frames and END go on, which hands back the reply
        self._cancelled = threading.Event()
        self._sent_bytes = 0
        self._frames_sent = 0
        self._t0 = time.perf_counter()
        self._end_body: bytes | None = None
        self._first_token_id = 0

    # -- producer side (prefill loop)
    def send_layer(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [tokens, kv_heads, head_dim] of layer ``layer_idx``; layers arrive in order."""
        if layer_idx != self._last_layer + 1 or layer_idx >= self.num_layers:
            raise KVIntegrityError(f"layer {layer_idx} arrived after layer {self._last_layer} "
                                   f"(of {self.num_layers})", fix="call send_layer once per layer, in order")
        self._last_layer = layer_idx
        if self._open is None:
            self._open = (layer_idx, [], 0)
        start, parts, nbytes = self._open
        # the frame payload [n, 2, T, H, D] is each layer's K then V back to back: sent straight
        # from the tensors' memory (they are not written again), no staging copy
        kb, vb = tensor_bytes(k), tensor_bytes(v)
        parts += [kb, vb]
        nbytes += kb.nbytes + vb.nbytes
        n = layer_idx - start + 1
        if layer_idx + 1 < self.num_layers and (n < self.config.layers_per_frame
                                                or nbytes < self.config.min_frame_bytes):
            self._open = (start, parts, nbytes)  # small layers ride together (config.min_frame_bytes)
            return
        self._open = None
        frame = Frame(FrameKind.DATA, self.request_id, start, start + n, k.dtype, (n, 2, *k.shape), parts)
        if self._lane:  # out now on the decode endpoint's lane, without waiting on the network
            self._to_lane(LaneJob("data", self, frame=frame))
        else:
            self._whole.append(frame)

    def _to_lane(self, job: LaneJob) -> None:
        lane = self._lane_ref
        if lane is None or not lane.offer(job):  # none yet, or it retired (idle): the endpoint's lane now
            self._lane_ref = LANES.submit(self.primary.host, self.primary.port, job)

    def cancel(self) -> None:
        """Stop sending: frames not yet out are dropped and ``finish`` raises KVTransferError. The
        lane's connection stays up (other transfers share it)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def finish(self, first_token_id: int, tokens: list[int] | None = None) -> TransferResult:
        """``tokens`` (live migration): output tokens the receiver must learn with the KV, ending
        with ``first_token_id``; they travel in the END frame."""
        self._end_body = None if tokens is None else json.dumps({"tokens": [int(t) for t in tokens]}).encode()
        self._first_token_id = first_token_id
        try:
            if self._last_layer + 1 != self.num_layers:
                raise KVIntegrityError(f"{self.request_id}: {self._last_layer + 1} of {self.num_layers} layers "
                                       "produced", fix="call send_layer for every layer before finish")
            lane_reply: Future | None = None
            if self._lane:  # END follows this transfer's last frame on the lane
                lane_reply = Future()
                self._to_lane(LaneJob("end", self, reply=lane_reply))
            else:
                for frame in self._whole:
                    self.encode(frame)
            return self._deliver(first_token_id, lane_reply)
        finally:
            self._frames.clear()
            self._whole.clear()

    # -- called by the lane (lane.py), from whichever thread writes
    def end_frame(self) -> Frame:
        body = self._end_body or b""
        return Frame(FrameKind.END, self.request_id, 0, self.num_layers, shape=(len(body),), payload=body,
                     aux=self._first_token_id)

    def lane_started(self) -> None:
        if self._lane_t0 is None:
            self._lane_t0 = time.perf_counter()

    def lane_failed(self, exc: Exception) -> None:
        if self.lane_broken:
            return
        self.lane_broken = True
        log.info("%s: layer stream to %s broke: %s", self.request_id, self.primary, exc)
        self.stats.add(self.primary.path, failures=1)
        self._on_event(TransferEventKind.STREAM_ERROR, path=self.primary.path, error=str(exc))

    def _deliver(self, first_token_id: int, lane_reply: Future | None) -> TransferResult:
        """Path by path (primary, then the fallback), up to 1 + max_retries attempts each, waiting
        backoff_base_s x 2^(attempt - 2) (at most backoff_max_s) before each retry (seed 3.3). A
        layer-wise transfer's first attempt is the END sent on its lane, and most end there."""
        retries, used_fallback = 0, False
        paths = [self.primary] + ([self.fallback] if self.fallback else [])
        last_error: Exception | None = None
        for n_path, endpoint in enumerate(paths):
            if n_path:
                used_fallback = True
                self.stats.add(endpoint.path, fallbacks=1)
                self._on_event(TransferEventKind.FALLBACK, path=endpoint.path, error=str(last_error))
                log.warning("%s: %s path failed (%s); falling back to %s", self.request_id, self.primary.path,
                            last_error, endpoint.path)
            for n in range(1, self.config.max_retries + 2):
                if n > 1:
                    time.sleep(min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (n - 2)))
                    retries += 1
                    self.stats.add(endpoint.path, retries=1)
                    self._on_event(TransferEventKind.RETRY, path=endpoint.path, attempt=n, error=str(last_error))
                try:
                    if lane_reply is not None and n_path == 0 and n == 1:
                        self._lane_attempt(lane_reply)
                    else:
                        self._attempt(endpoint, first_token_id=first_token_id)
                except _AttemptFailed as exc:
                    last_error = exc
                    self.stats.add(endpoint.path, failures=1)
                    continue
                seconds = time.perf_counter() - self._t0
                self.stats.add(endpoint.path, transfers=1)
                return TransferResult(self.request_id, endpoint.path, self._sent_bytes, seconds, retries,
                                      used_fallback, self._frames_sent)
        raise KVTransferError(f"KV of {self.request_id} not delivered on {[p.path for p in paths]}: {last_error}",
                              fix="check the decode worker's KV listeners and the fabric/control links")

    # -- internals
    def _covered(self) -> set[int]:
        return {layer for f in self._frames.values() for layer in range(f.layer_start, f.layer_end)}

    def encode(self, frame: Frame) -> EncodedFrame:
        head, wire = encode_frame(frame, self._compressor)
        entry = EncodedFrame(frame.layer_start, frame.layer_end, head, wire)
        self._frames[frame.layer_start] = entry
        return entry

    def _lane_attempt(self, reply: Future) -> None:
        """The first attempt of a layer-wise transfer: the END sent on the lane after its frames."""
        try:
            body = self._lane_ref.wait_reply(reply)  # within the timeout (lane.py)
        except LaneBroken as exc:
            if self._cancelled.is_set():
                raise KVTransferError(f"transfer of {self.request_id} cancelled") from exc
            raise _AttemptFailed(f"{self.primary.path} {self.primary.host}:{self.primary.port}: {exc}") from exc
        finally:
            if self._lane_t0 is not None:
                self.stats.add(self.primary.path, seconds=time.perf_counter() - self._lane_t0)
        self._check_reply(body)

    def wire_buffers(self, entry: EncodedFrame) -> list:
        """A small frame's buffers for the lane's gather write (the corruption hook applies)."""
        wire, crc = self._maybe_corrupt(entry)
        return frame_buffers(entry.head, wire, crc)

    def wire_parts(self, entry: EncodedFrame) -> tuple[bytes, list, int | None]:
        """A frame's header, payload parts and the trailer to claim (None: the parts' own crc32c,
        which the lane computes once they are written; the corruption hook applies)."""
        wire, crc = self._maybe_corrupt(entry)
        return entry.head, wire if isinstance(wire, list) else [wire], crc

    def count_sent(self, nbytes: int, path: str) -> None:
        self._sent_bytes += nbytes
        self._frames_sent += 1
        self.stats.add(path, bytes=nbytes, frames=1)

    def _maybe_corrupt(self, entry: EncodedFrame) -> tuple[object, int | None]:
        """The wire payload to send and the trailer to claim: the fault hook damages the next N
        frames' payload while the trailer stays that of the intact one."""
        wire = entry.wire
        if self._corrupt_left <= 0:
            return wire, None
        self._corrupt_left -= 1
        wire = b"".join(wire) if isinstance(wire, list) else wire
        crc = crc32c.crc32c(wire)  # the trailer of the intact payload
        damaged = bytearray(wire)
        damaged[len(damaged) // 2] ^= 0xFF
        log.warning("%s: fault hook corrupted the frame of layers %d-%d", self.request_id, entry.layer_start,
                    entry.layer_end)
        return damaged, crc

    def send_entry(self, sock: socket.socket, entry: EncodedFrame, path: str) -> None:
        wire, crc = self._maybe_corrupt(entry)
        self.count_sent(send_frame(sock, entry.head, wire, crc), path)

    def _attempt(self, endpoint: Endpoint, *, first_token_id: int) -> None:
        """One delivery on a connection of its own: ask what is missing (when anything was sent
        before), resend it, END."""
        if self._cancelled.is_set():
            raise KVTransferError(f"transfer of {self.request_id} cancelled")
        t0 = time.perf_counter()
        sock = None
        try:
            sock = _connect(endpoint, self.config.timeout_s)
            if self._frames_sent:  # something may have arrived earlier: ask what is missing
                send_frame(sock, *encode_frame(Frame(FrameKind.QUERY, self.request_id)))
                missing = self._reply(sock)["missing"]
            else:
                missing = sorted(self._covered())
            for start in sorted({f.layer_start for f in self._frames.values() for m in missing
                                 if f.layer_start <= m < f.layer_end}):
                if self._cancelled.is_set():
                    raise KVTransferError(f"transfer of {self.request_id} cancelled")
                self.send_entry(sock, self._frames[start], endpoint.path)
            send_frame(sock, *encode_frame(self.end_frame()))
            self._check_reply(self._reply(sock))
            CONNECTIONS.give(endpoint, sock)  # in sync at a frame boundary: the next transfer reuses it
            sock = None
        except (OSError, KVIntegrityError) as exc:
            if self._cancelled.is_set():
                raise KVTransferError(f"transfer of {self.request_id} cancelled") from exc
            raise _AttemptFailed(f"{endpoint.path} {endpoint.host}:{endpoint.port}: {exc}") from exc
        finally:
            if sock is not None:
                close_socket(sock)
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

    def _check_reply(self, body: dict) -> None:
        if body.get("fatal"):
            raise KVTransferError(f"decode worker refused KV of {self.request_id}: {body['fatal']}",
                                  fix="the decode side no longer expects this request (cancelled or unknown)")
        if not body["ok"]:
            raise _AttemptFailed(f"receiver misses layers {body['missing']}")


class _Connections:
    """Idle KV connections per endpoint, reused by later transfers to the same decode worker: a
    connection per transfer cost a handshake (and a receiver thread) on every request. A
    connection goes back only after a transfer it carried was confirmed; one the receiver has
    closed meanwhile (it closes idle ones after its timeout) is noticed before reuse."""

    def __init__(self, max_idle: int = 4) -> None:
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self.max_idle = max_idle

    def take(self, endpoint: Endpoint, timeout_s: float) -> socket.socket:
        key = (endpoint.host, endpoint.port)
        while True:
            with self._lock:
                idle = self._idle.get(key)
                sock = idle.pop() if idle else None
            if sock is None:
                sock = socket.create_connection(key, timeout=timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:  # nothing pending: not closed by the peer
                sock.settimeout(timeout_s)
                return sock
            close_socket(sock)  # EOF (or stray bytes): never reuse

    def give(self, endpoint: Endpoint, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault((endpoint.host, endpoint.port), [])
            if len(idle) < self.max_idle:
                idle.append(sock)
                return
        close_socket(sock)


CONNECTIONS = _Connections()


def _connect(endpoint: Endpoint, timeout_s: float) -> socket.socket:
    return CONNECTIONS.take(endpoint, timeout_s)
