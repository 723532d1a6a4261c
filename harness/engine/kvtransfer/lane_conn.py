"""A lane's connection (lane.py): the transfers whose frames it carries, the END replies awaited
on it, and the writes that go on it, blocking or not."""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from harness.engine.kvtransfer.wire import Frame, close_socket
from harness.engine.kvtransfer.wire_send import send_buffers

_IOV_MAX = 1024           # buffers one writev takes


@dataclass(frozen=True, slots=True)
class EncodedFrame:
    """A DATA frame as its sender encoded it, kept for a retry: the layers it carries, its header
    and its payload on the wire (bytes, or the list of buffers a layer-wise frame is made of)."""
    layer_start: int
    layer_end: int
    head: bytes
    wire: Any


@dataclass(frozen=True, slots=True)
class LaneJob:
    """One thing a lane sends, in its order: a transfer's DATA frame (``frame``) or its END
    (``reply``: the future its REPLY settles)."""
    kind: Literal["data", "end"]
    sender: "LaneSender"
    frame: Frame | None = None
    reply: Future | None = None


@dataclass(frozen=True, slots=True)
class PartialWrite:
    """The rest of an inline gather write that the socket did not take at once: the writer
    thread finishes it (``flush``) before anything queued behind it."""
    conn: "LaneConn"
    views: list
    counted: list


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

    def encode(self, frame: Frame) -> EncodedFrame: ...

    def send_entry(self, sock: socket.socket, entry: EncodedFrame, path: str) -> None: ...

    def wire_buffers(self, entry: EncodedFrame) -> list: ...

    def wire_parts(self, entry: EncodedFrame) -> tuple[bytes, list, int | None]: ...

    def count_sent(self, nbytes: int, path: str) -> None: ...

    def end_frame(self) -> Frame: ...

    def lane_started(self) -> None: ...

    def lane_failed(self, exc: Exception) -> None: ...


class LaneBroken(Exception):
    """The lane could not carry a transfer's frames or END; the transfer takes the retry path."""


class LaneConn:
    """One connection of a lane, the transfers whose frames it carries and the END replies
    awaited on it (per request id, in send order). Its lock is its lane's condition, so waiters
    learn of every reply and of its end. A transfer never spans two connections: when this one
    dies, every transfer on it is broken for the lane and its retry sends what is missing."""

    def __init__(self, sock: socket.socket, timeout_s: float, cv: threading.Condition) -> None:
        self.sock, self.timeout_s, self.cv = sock, timeout_s, cv
        self.pending: dict[str, collections.deque[tuple[Future, float, LaneSender]]] = {}
        self.users: weakref.WeakValueDictionary[int, LaneSender] = weakref.WeakValueDictionary()  # an abandoned one goes
        self.dead = False

    def use(self, sender: LaneSender) -> None:
        with self.cv:
            if self.dead:
                raise OSError("connection closed")
            self.users[id(sender)] = sender

    def expect(self, sender: LaneSender, fut: Future) -> None:
        with self.cv:
            if self.dead:
                raise OSError("connection closed")
            self.pending.setdefault(sender.request_id, collections.deque()).append((fut, time.monotonic(), sender))
            self.cv.notify_all()

    def resolve(self, rid: str, body: dict) -> None:
        with self.cv:
            waiting = self.pending.get(rid)
            entry = waiting.popleft() if waiting else None
            if waiting is not None and not waiting:
                del self.pending[rid]
            if entry is not None:
                self.users.pop(id(entry[2]), None)
            self.cv.notify_all()
        if entry is not None:
            settle(entry[0], result=body)

    def reply_due(self) -> float | None:
        """When the oldest awaited reply is overdue (monotonic), or None when none is awaited."""
        with self.cv:
            starts = [t for waits in self.pending.values() for _, t, _ in waits]
        return min(starts) + self.timeout_s if starts else None

    def kill(self, reason: str) -> None:
        with self.cv:
            if self.dead:
                return
            self.dead = True
            waiting = [f for waits in self.pending.values() for f, _, _ in waits]
            self.pending.clear()
            users = list(self.users.values())
            self.users.clear()
            self.cv.notify_all()
        close_socket(self.sock)
        for sender in users:
            sender.lane_failed(LaneBroken(reason))
        for fut in waiting:
            settle(fut, LaneBroken(reason))


def write_now(conn: LaneConn, buffers: list) -> list:
    """Write what the socket takes without blocking; returns the views left unsent."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    fd = conn.sock.fileno()  # non-blocking: a socket with a timeout is, underneath
    while views:
        try:
            sent = os.writev(fd, views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            return views
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
    return views


def count(counted: list) -> None:
    """Count frames as sent before they are written: once a transfer's END is out, its REPLY can
    come back and its result be read before the writing thread runs again (counted after the
    write, a delivered transfer once reported 0 frames and 0 bytes on a loaded machine)."""
    for sender, nbytes in counted:
        sender.count_sent(nbytes, sender.primary.path)
    counted.clear()


def flush(conn: LaneConn, gather: list, counted: list) -> None:
    count(counted)
    if gather:
        send_buffers(conn.sock, gather)
    gather.clear()


def settle(fut: Future, exc: BaseException | None = None, result: object = None) -> None:
    """Resolve ``fut`` unless it already is (a reader and a writer may both try)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass
