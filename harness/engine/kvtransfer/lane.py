"""One persistent KV connection and sender thread per decode worker (a "lane").

A prefill worker used to start a thread per transfer and take a pooled connection for it: at
small sizes that fixed cost was most of a transfer (a 1 MiB transfer took 10x a raw socket). Now
every transfer to one decode endpoint goes through that endpoint's lane: its writer thread sends
the frames of all transfers in the order they are produced (frames carry their request id, so
transfers interleave at frame boundaries), and the END of a transfer follows its last frame on
the same connection. A reader thread per connection hands each REPLY to the transfer that waits
for it. A transfer whose frames could not go out on the lane (connection refused or broken) is
marked broken and its ``finish`` takes the retry path (a fresh connection, ask the receiver what
is missing, resend). Every wait here is bounded by the transfer's ``timeout_s``: a reply that does
not come in time fails the transfers waiting on that connection, which is then dropped.

The writer thread ends after ``IDLE_EXIT_S`` with nothing to send, so idle endpoints cost no
thread; the next transfer to it starts a new lane.
"""

from __future__ import annotations

import collections
import logging
import queue
import select
import socket
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

from harness.engine.kvtransfer.wire import (Frame, FrameKind, close_socket, encode_frame, frame_buffers, read_frame,
                                    send_buffers)
from harness.errors import KVIntegrityError



class LaneSender(Protocol):
    """What the lane needs of a transfer (transfer.KVSender; a protocol, so this module does not
    import the sender that imports it)."""

    request_id: str
    config: Any             # TransferConfig: timeout_s, backoff_base_s
    primary: Any            # Endpoint: host, port, path
    lane_broken: bool
    lane_conn: Any          # the lane connection that carries its frames (set by the lane)

    @property
    def cancelled(self) -> bool: ...

    def encode(self, frame: Frame) -> tuple: ...

    def send_entry(self, sock: socket.socket, entry: tuple, path: str) -> None: ...

    def wire_buffers(self, entry: tuple) -> list: ...

    def count_sent(self, nbytes: int, path: str) -> None: ...

    def end_frame(self) -> Frame: ...

    def lane_started(self) -> None: ...

    def lane_failed(self, exc: Exception) -> None: ...

log = logging.getLogger(__name__)

IDLE_EXIT_S = 30.0
COALESCE_BYTES = 4 << 20  # frames queued together up to this size go out in one gather write


class LaneBroken(Exception):
    """The lane could not carry a transfer's frames or END; the transfer takes the retry path."""


class _Conn:
    """One connection of a lane, the transfers whose frames it carries and the END replies
    awaited on it (per request id, in send order). A transfer never spans two connections: when
    this one dies, every transfer on it is broken for the lane and its retry sends what is missing."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock, self.timeout_s = sock, timeout_s
        self.pending: dict[str, collections.deque[tuple[Future, float]]] = {}
        self.users: weakref.WeakValueDictionary[int, LaneSender] = weakref.WeakValueDictionary()  # an abandoned one goes
        self.lock = threading.Lock()
        self.dead = False

    def use(self, sender: LaneSender) -> None:
        with self.lock:
            if self.dead:
                raise OSError("connection closed")
            self.users[id(sender)] = sender

    def done_with(self, sender: LaneSender) -> None:
        with self.lock:
            self.users.pop(id(sender), None)

    def expect(self, rid: str) -> Future:
        fut: Future = Future()
        with self.lock:
            if self.dead:
                raise OSError("connection closed")
            self.pending.setdefault(rid, collections.deque()).append((fut, time.monotonic()))
        return fut

    def resolve(self, rid: str, body: dict) -> None:
        with self.lock:
            waiting = self.pending.get(rid)
            fut = waiting.popleft()[0] if waiting else None
            if waiting is not None and not waiting:
                del self.pending[rid]
        if fut is not None:
            _settle(fut, result=body)

    def oldest_wait_s(self) -> float:
        with self.lock:
            starts = [t for waits in self.pending.values() for _, t in waits]
        return time.monotonic() - min(starts) if starts else 0.0

    def kill(self, reason: str) -> None:
        with self.lock:
            if self.dead:
                return
            self.dead = True
            waiting = [f for waits in self.pending.values() for f, _ in waits]
            self.pending.clear()
            users = list(self.users.values())
            self.users.clear()
        close_socket(self.sock)
        for sender in users:
            sender.lane_failed(LaneBroken(reason))
        for fut in waiting:
            _settle(fut, LaneBroken(reason))


class _Lane:
    def __init__(self, host: str, port: int, lanes: "Lanes") -> None:
        self.host, self.port, self._lanes = host, port, lanes
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._conn: _Conn | None = None
        self._down_until = 0.0  # after a failed connect, transfers skip the lane until then
        self.thread = threading.Thread(target=self._run, name=f"kv-lane-{host}:{port}", daemon=True)

    # -- writer thread
    def _run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                if self._lanes.retire(self):
                    if self._conn is not None:
                        self._conn.kill("lane idle")
                    return
                continue
            batch, size = [job], _job_bytes(job)
            while size < COALESCE_BYTES:  # what queued meanwhile goes out in the same system call
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                batch.append(job)
                size += _job_bytes(job)
            try:
                self._send_batch(batch)
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill the lane of every transfer
                log.exception("KV lane to %s:%d failed a batch of %d jobs", self.host, self.port, len(batch))
                for kind, sender, arg in batch:
                    sender.lane_failed(exc)
                    if kind == "end":
                        _settle(arg, LaneBroken(f"lane error: {exc!r}"))

    def _connection(self, sender: LaneSender) -> _Conn:
        conn = self._conn
        if conn is not None and not conn.dead:
            if conn.timeout_s != sender.config.timeout_s:  # changed at run time (POST /admin/transfer)
                conn.timeout_s = sender.config.timeout_s
                conn.sock.settimeout(conn.timeout_s)
            return conn
        if time.monotonic() < self._down_until:
            raise OSError(f"{self.host}:{self.port} refused a connection moments ago")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=sender.config.timeout_s)
        except OSError:
            self._down_until = time.monotonic() + max(sender.config.backoff_base_s, 0.01)
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = self._conn = _Conn(sock, sender.config.timeout_s)
        threading.Thread(target=_read_replies, args=(conn,), name=f"kv-lane-replies-{self.host}:{self.port}",
                         daemon=True).start()
        return conn

    def _send_batch(self, batch: list[tuple]) -> None:
        """Frames and ENDs in queue order: small ones gathered into one write, a large frame on
        its own (send_frame checksums it slice by slice while cached)."""
        live = []
        for kind, sender, arg in _merge_frames(batch):
            entry = sender.encode(arg) if kind == "data" else None  # kept for a retry even if not sent now
            if sender.cancelled or sender.lane_broken:
                if kind == "end":
                    _settle(arg, LaneBroken("cancelled" if sender.cancelled else "the layer stream broke"))
                continue
            live.append((kind, sender, arg, entry))
        if not live:
            return
        try:
            conn = self._connection(live[0][1])
        except OSError as exc:
            for kind, sender, arg, _ in live:
                sender.lane_failed(exc)
                if kind == "end":
                    _settle(arg, LaneBroken(str(exc)))
            return
        gather: list = []
        counted: list[tuple[LaneSender, int]] = []
        try:
            for kind, sender, arg, entry in live:
                if sender.lane_conn is not None and sender.lane_conn is not conn:
                    # its earlier frames went on a connection that has died (the reader may not have
                    # marked it yet): never continue a transfer on another one
                    sender.lane_failed(LaneBroken("its lane connection broke"))
                if sender.lane_broken:  # its earlier frames died with a connection: the retry sends
                    if kind == "end":
                        _settle(arg, LaneBroken("the layer stream broke"))
                    continue
                sender.lane_conn = conn
                conn.use(sender)
                sender.lane_started()
                if kind == "end":
                    reply = conn.expect(sender.request_id)
                    reply.add_done_callback(lambda f, fut=arg, s_=sender: (conn.done_with(s_), _chain(f, fut)))
                    bufs = frame_buffers(*encode_frame(sender.end_frame()))
                elif _wire_bytes(entry[3]) > COALESCE_BYTES:
                    _flush(conn, gather, counted)
                    sender.send_entry(conn.sock, entry, sender.primary.path)
                    continue
                else:
                    bufs = sender.wire_buffers(entry)
                    counted.append((sender, sum(memoryview(b_).nbytes for b_ in bufs)))
                gather += bufs
            _flush(conn, gather, counted)
        except (OSError, KVIntegrityError) as exc:
            conn.kill(f"send failed: {exc}")  # fails the ENDs awaited on it
            for kind, sender, arg, _ in live:
                sender.lane_failed(exc)
                if kind == "end":
                    _settle(arg, LaneBroken(str(exc)))


def _merge_frames(batch: list[tuple]) -> list[tuple]:
    """Consecutive frames of one transfer with adjacent layers become one frame (the receiver
    takes any layer range): one header, one landing and one checksum instead of several."""
    out: list[tuple] = []
    for job in batch:
        kind, sender, frame = job
        if out and kind == "data" and out[-1][0] == "data" and out[-1][1] is sender:
            prev = out[-1][2]
            if (prev.layer_end == frame.layer_start and prev.dtype == frame.dtype
                    and prev.shape[1:] == frame.shape[1:] and isinstance(prev.payload, list)
                    and isinstance(frame.payload, list)
                    and _wire_bytes(prev.payload) + _wire_bytes(frame.payload) <= COALESCE_BYTES):
                out[-1] = ("data", sender, Frame(FrameKind.DATA, frame.request_id, prev.layer_start, frame.layer_end,
                                                 frame.dtype, (prev.shape[0] + frame.shape[0], *frame.shape[1:]),
                                                 prev.payload + frame.payload))
                continue
        out.append(job)
    return out


def _wire_bytes(payload) -> int:
    parts = payload if isinstance(payload, list) else [payload]
    return sum(memoryview(p).nbytes for p in parts)


def _job_bytes(job: tuple) -> int:
    kind, _, arg = job
    return _wire_bytes(arg.payload) if kind == "data" else 0


def _flush(conn: _Conn, gather: list, counted: list) -> None:
    if gather:
        send_buffers(conn.sock, gather)
        for sender, nbytes in counted:
            sender.count_sent(nbytes, sender.primary.path)
    gather.clear()
    counted.clear()


def _chain(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        _settle(dst, exc)
    else:
        _settle(dst, result=src.result())


def _settle(fut: Future, exc: BaseException | None = None, result: object = None) -> None:
    """Resolve ``fut`` unless it already is (the reader and the writer may both try)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _read_replies(conn: _Conn) -> None:
    """A lane connection's reader: each REPLY goes to the transfer waiting for it; EOF, a broken
    stream or a reply overdue by the timeout ends the connection and fails whoever waits on it."""
    reason = "receiver closed the connection"
    try:
        while not conn.dead:
            readable, _, _ = select.select([conn.sock], [], [], conn.timeout_s)
            if not readable:  # wait at a frame boundary only: a timeout inside a frame loses sync
                if conn.oldest_wait_s() > conn.timeout_s:
                    reason = f"no reply within {conn.timeout_s:.1f} s"
                    break
                continue
            frame = read_frame(conn.sock)  # a started reply completes within the socket's timeout
            if frame is None:
                break
            if frame.kind != FrameKind.REPLY:
                reason = f"unexpected {frame.kind.name} frame from the receiver"
                break
            conn.resolve(frame.request_id, frame.body())
    except (OSError, ValueError, KVIntegrityError) as exc:  # ValueError: select on a closed socket
        reason = f"reply stream broke: {exc}"
    conn.kill(reason)


class Lanes:
    """The lanes of this process, one per decode endpoint (host, port)."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._lock = threading.Lock()

    def submit(self, host: str, port: int, job: tuple) -> None:
        with self._lock:  # under the lock retire() takes too: a job never lands on a lane that left
            lane = self._lanes.get((host, port))
            if lane is None:
                lane = self._lanes[(host, port)] = _Lane(host, port, self)
                lane.thread.start()
            lane.jobs.put(job)

    def retire(self, lane: _Lane) -> bool:
        """Called by an idle lane: True when it may end (nothing was queued meanwhile)."""
        with self._lock:
            if not lane.jobs.empty():
                return False
            if self._lanes.get((lane.host, lane.port)) is lane:
                del self._lanes[(lane.host, lane.port)]
            return True

    def count(self) -> int:
        with self._lock:
            return len(self._lanes)


LANES = Lanes()
