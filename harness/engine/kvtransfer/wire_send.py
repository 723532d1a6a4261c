"""Writing KV frames: the payload's crc32c computed slice by slice while it is sent (a large
frame's by a checksum thread beside the sender), and small frames gathered into one ``sendmsg``.
The format is wire.py's."""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c

from harness.engine.kvtransfer.wire import SLICE_BYTES, U32, payload_len

_PARALLEL_CRC_SLICES = 4  # frames of more slices than this are checksummed aside (send_frame)


def send_frame(sock: socket.socket, head: bytes, wire: bytes | bytearray | memoryview | list,
               crc: int | None = None) -> int:
    """Send header, payload (one buffer or a list of parts) and the payload's crc32c trailer,
    checksumming each slice just before it is sent (one pass over memory, no copy); ``crc``
    overrides the trailer (the corruption fault hook). Header and trailer ride with the first
    and last slice in one ``sendmsg`` each, so a small frame costs one or two system calls."""
    parts = wire if isinstance(wire, list) else [wire]
    slices = [v[off:off + SLICE_BYTES] for v in map(memoryview, parts) for off in range(0, len(v), SLICE_BYTES)]
    # a large frame is checksummed by another thread while this one sends it (crc32c lets go of
    # the GIL): in line, the checksum added 15 % to the sender's time per byte
    aside = _checksum_aside(slices) if crc is None and len(slices) > _PARALLEL_CRC_SLICES else None
    running = 0
    pending: list = [head]
    for piece in slices:
        if aside is None:
            running = crc32c.crc32c(piece, running)
        pending.append(piece)
        if len(pending) > 1 and sum(map(len, pending)) >= SLICE_BYTES:
            _sendmsg_all(sock, pending)
            pending = []
    if crc is None:
        crc = aside.result() if aside is not None else running
    pending.append(U32.pack(crc))
    _sendmsg_all(sock, pending)
    return len(head) + payload_len(parts) + U32.size


_CRC_POOL: list[ThreadPoolExecutor] = []
_CRC_POOL_LOCK = threading.Lock()


def _checksum_aside(slices: list) -> Future:
    """The crc32c of ``slices``, computed by this process's checksum thread."""
    with _CRC_POOL_LOCK:
        if not _CRC_POOL:
            _CRC_POOL.append(ThreadPoolExecutor(1, thread_name_prefix="kv-crc"))
    return _CRC_POOL[0].submit(_crc_of, slices)


def _crc_of(slices: list) -> int:
    crc = 0
    for piece in slices:
        crc = crc32c.crc32c(piece, crc)
        os.sched_yield()  # a slice at a time: a thread waiting for this core (the receiver's, on a
        # small machine) gets it now rather than after the whole frame
    return crc


def crc_trailer(parts: list, crc: int | None = None) -> bytes:
    """A payload's crc32c trailer: of ``parts``, or ``crc`` when given (the corruption hook)."""
    if crc is None:
        crc = 0
        for part in parts:
            crc = crc32c.crc32c(part, crc)
    return U32.pack(crc)


def frame_buffers(head: bytes, wire: bytes | bytearray | memoryview | list, crc: int | None = None) -> list:
    """One frame as a list of buffers (header, payload parts, crc32c trailer) for a gather write
    together with other frames (``send_buffers``); ``crc`` overrides the trailer as in send_frame.
    For small frames: a large one goes through send_frame, which checksums slice by slice."""
    parts = wire if isinstance(wire, list) else [wire]
    return [head, *parts, crc_trailer(parts, crc)]


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Send several frames' buffers in as few system calls as the socket takes."""
    _sendmsg_all(sock, buffers)


def _sendmsg_all(sock: socket.socket, buffers: list) -> None:
    """``sendall`` for a list of buffers (gather write): resumes after a partial send."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


__all__ = ["crc_trailer", "frame_buffers", "send_buffers", "send_frame"]
