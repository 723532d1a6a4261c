"""KV transfer receiver (decode side): accepts KV connections on the fabric and control
addresses, verifies every frame (wire.py) and hands verified layers to a KVSink; progress per
request survives across connections, so a retry or the fallback path resends only what is missing.

``timeout_s`` bounds a frame that stalls half-way (a network stall). Between frames a connection
may idle longer while the request it carries is still expected: a long prompt's next layer can
take minutes to compute on a CPU; an idle connection whose request is no longer pending closes.
"""

from __future__ import annotations

import collections
import logging
import math
import select
import socket
import threading
from typing import Callable, Protocol

import torch

from harness.engine.kvtransfer.stats import TransferStats
from harness.engine.kvtransfer.wire import (BufferPool, CorruptFrameError, Frame, FrameKind, KVLayout,
                                            TruncatedFrameError, close_socket, encode_frame, read_frame)
from harness.engine.kvtransfer.wire_send import send_frame

log = logging.getLogger(__name__)


class KVSink(Protocol):
    """The decode engine as the receiver sees it (the worker adapts its ImportHandles to this)."""

    def kv_layout(self, request_id: str) -> KVLayout | None: ...

    def kv_write(self, request_id: str, layer_start: int, kv: torch.Tensor, release: Callable[[], None]) -> None:
        """kv: [layers, 2, tokens, kv_heads, head_dim], already verified. ``kv`` views a pooled
        receive buffer: call ``release()`` once it is copied (the buffer then takes later frames)."""

    # Optional: kv_recv_into(request_id, layer_start, layer_end, nbytes) -> (views, done) | None
    # lets verified-later payloads land straight in the KV (landing.py).

    def kv_complete(self, request_id: str, first_token_id: int) -> None:
        """Every layer arrived. A live migration's END also names the output tokens behind the
        KV (``tokens=[...]``, ending with ``first_token_id``); only then is it passed."""


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
            close_socket(s)
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
        rid = None  # the request this connection carried last
        try:
            while True:
                if not self._wait_for_frame(conn, rid):
                    log.info("KV connection on %s idle for %.0f s with nothing pending; closing it", path,
                             self.timeout_s)
                    return
                try:
                    frame = read_frame(conn, self.max_frame_bytes, self._pool, into=self._into)
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
                rid = frame.request_id
                if frame.landed:
                    self._on_landed(frame)
                    continue
                if frame.kind == FrameKind.DATA:
                    self._on_data(frame, path)
                    continue
                try:
                    tokens = _end_tokens(frame) if frame.kind == FrameKind.END else None
                finally:  # read before the pooled buffer goes back
                    if frame.buffer is not None:
                        self._pool.give(frame.buffer)
                if frame.kind in (FrameKind.QUERY, FrameKind.END):
                    send_frame(conn, *encode_frame(Frame.reply(frame.request_id, self._on_control(frame, tokens))))
        except OSError as exc:
            log.info("KV connection on %s ended: %s", path, exc)
        finally:
            self._conns.discard(conn)
            close_socket(conn)

    def _wait_for_frame(self, conn: socket.socket, rid: str | None) -> bool:
        """Wait until the next frame starts; False when the connection idled ``timeout_s`` with
        no request of it pending (or the receiver closed)."""
        while not self._closed:
            try:
                readable, _, _ = select.select([conn], [], [], self.timeout_s)
            except (OSError, ValueError):  # closed under us (receiver shutting down)
                return False
            if readable:
                return True
            with self._lock:
                done = rid is None or rid in self._completed
            if done or self.sink.kv_layout(rid) is None:
                return False
        return False

    def _into(self, rid: str, layer_start: int, layer_end: int, dtype: torch.dtype, shape: tuple[int, ...],
              nbytes: int):
        """Where a DATA frame's payload lands, when the sink takes frames straight into its KV
        (``kv_recv_into``) and the frame is one it expects; None: the buffered path (which also
        rejects what does not fit)."""
        land = getattr(self.sink, "kv_recv_into", None)
        layout = self.sink.kv_layout(rid) if land is not None else None
        if layout is None:
            return None
        want = (layer_end - layer_start, 2, layout.num_tokens, layout.num_kv_heads, layout.head_dim)
        if dtype != layout.dtype or tuple(shape) != want or layer_start < 0 or layer_end > layout.num_layers:
            return None
        with self._lock:
            if rid in self._completed or self._have.setdefault(rid, set()).issuperset(range(layer_start, layer_end)):
                return None  # a resend of layers that arrived: never write over verified KV
        return land(rid, layer_start, layer_end, nbytes)

    def _on_landed(self, frame: Frame) -> None:
        self.stats.received(math.prod(frame.shape) * frame.dtype.itemsize)
        with self._lock:
            if frame.request_id in self._have:
                self._have[frame.request_id].update(range(frame.layer_start, frame.layer_end))

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
        with self._lock:   # a resend of layers that arrived (a QUERY answered before a cut stream's last
            # frame was read): never write over KV that was verified, as the direct path (_into) does not
            duplicate = self._have.get(frame.request_id, set()).issuperset(range(frame.layer_start, frame.layer_end))
        if duplicate:
            self.stats.rejected("duplicate")
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

    def _on_control(self, frame: Frame, tokens: list[int] | None = None) -> dict:
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
            if tokens is None:
                self.sink.kv_complete(rid, frame.aux)
            else:
                self.sink.kv_complete(rid, frame.aux, tokens=tokens)
        except Exception as exc:
            return {"ok": False, "missing": [], "fatal": f"commit failed: {exc}"}
        with self._lock:
            self._have.pop(rid, None)
            self._completed[rid] = None
            while len(self._completed) > 4096:
                self._completed.popitem(last=False)
        return {"ok": True, "missing": []}


def _end_tokens(frame: Frame) -> list[int] | None:
    """The token list an END frame may carry (live migration); None when it carries none."""
    if not len(frame.payload):
        return None
    try:
        return [int(t) for t in frame.body()["tokens"]]
    except (ValueError, KeyError, TypeError):
        return None  # checksummed, so a sender bug: the commit's own checks refuse the request
