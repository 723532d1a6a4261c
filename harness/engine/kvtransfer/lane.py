"""One persistent KV connection per decode worker (a "lane"), shared by every transfer to it.

A prefill worker used to start a thread per transfer and take a pooled connection for it: at
small sizes that fixed cost was most of a transfer (a 1 MiB transfer took 10x a raw socket).
Now every transfer to one decode endpoint goes through that endpoint's lane, in the order its
frames are produced (frames carry their request id, so transfers interleave at frame
boundaries), and the END of a transfer follows its last frame on the same connection.

Who writes: the thread that produced a frame writes it itself when nothing is ahead of it, with
a non-blocking write, so the prefill loop never waits on the network; what the socket does not
take at once (a slow or congested link, a large frame, a connection still to open) goes to the
lane's writer thread, which sends it and everything queued behind it with blocking writes.
Handing each frame to another thread cost a wake-up per frame and per reply (about half of a
1 MiB transfer on loopback). Who reads: a transfer waiting for its END's reply reads the
replies itself (one waiter reads at a time and hands each reply to the transfer it names),
so there is no reader thread either.

A transfer whose frames could not go out on the lane (connection refused or broken) is marked
broken and its ``finish`` takes the retry path (a fresh connection, ask the receiver what is
missing, resend). A transfer never spans two lane connections. Every wait here is bounded by
the transfer's ``timeout_s``: a reply that does not come in time fails the transfers waiting
on that connection, which is then dropped. A connection the receiver closed while idle is
noticed (and replaced) before the next transfer starts on it. The writer thread ends, and the
lane with its connection, after ``IDLE_EXIT_S`` unused.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import threading
import time
from concurrent.futures import Future

from harness.engine.kvtransfer.lane_conn import (LaneBroken, LaneConn, LaneJob, LaneSender, PartialWrite, count, flush,
                                                 settle, write_now)
from harness.engine.kvtransfer.wire import Frame, FrameKind, encode_frame, read_frame
from harness.engine.kvtransfer.wire_send import crc_trailer, frame_buffers
from harness.errors import KVIntegrityError

log = logging.getLogger(__name__)

IDLE_EXIT_S = 30.0
COALESCE_BYTES = 4 << 20  # frames queued together up to this size go out in one gather write


class _Lane:
    """The lane to one decode endpoint: its connection, the jobs its writer thread has to send,
    who writes now and who reads replies now (all under ``cv``)."""

    def __init__(self, host: str, port: int, lanes: "Lanes") -> None:
        self.host, self.port, self._lanes = host, port, lanes
        lock = threading.RLock()
        self.cv = threading.Condition(lock)    # reply waiters: a reply, a written END, a death
        self.work = threading.Condition(lock)  # the writer thread: jobs queued for it
        self.queue: collections.deque[LaneJob | PartialWrite] = collections.deque()  # for the writer thread, in order
        self.writing = False   # a thread is writing on the connection (the producer or the writer)
        self.reading = False   # a waiter is reading replies
        self.retired = False   # ended idle: takes no more jobs
        self.conn: LaneConn | None = None
        self.last_used = time.monotonic()
        self._down_until = 0.0  # after a failed connect, transfers skip the lane until then
        self.thread = threading.Thread(target=self._run, name=f"kv-lane-{host}:{port}", daemon=True)

    # -- writing
    def offer(self, job: LaneJob) -> bool:
        """Send ``job`` now from this thread when nothing is ahead of it and the connection
        takes it without blocking; whatever is left goes to the writer thread. False: the lane
        has retired (Lanes.submit gives the endpoint's lane now)."""
        with self.cv:
            if self.retired:
                return False
            self.last_used = time.monotonic()
            if self.queue or self.writing or not self._inline_ok(job):
                self.queue.append(job)
                self.work.notify()
                return True
            self.writing = True
        left = None
        try:
            left = self._send_batch([job], inline=True)
        except Exception as exc:  # noqa: BLE001 - a bug here fails the transfer, never the caller
            log.exception("KV lane to %s:%d failed to write a %s frame", self.host, self.port, job.kind)
            job.sender.lane_failed(exc)
            if job.kind == "end":
                settle(job.reply, LaneBroken(f"lane error: {exc!r}"))
        finally:
            with self.cv:
                self.writing = False
                if left is not None:
                    self.queue.appendleft(left)
                if self.queue:  # only then: a wake-up per frame would cost the producer the GIL
                    self.work.notify()
                if job.kind == "end":  # its END went out or failed: its waiter learns which
                    self.cv.notify_all()
        return True

    def _inline_ok(self, job: LaneJob) -> bool:
        return self.conn is not None and not self.conn.dead and (job.kind == "end" or _wire_bytes(job.frame.payload)
                                                                 <= COALESCE_BYTES)

    def _run(self) -> None:
        """The writer thread: sends what producers could not, in order; ends the lane when idle."""
        while True:
            with self.cv:
                while not self.queue or self.writing:
                    idle = time.monotonic() - self.last_used
                    if idle >= IDLE_EXIT_S and not self.queue and self._lanes.retire(self):
                        if self.conn is not None:
                            self.conn.kill("lane idle")
                        return
                    self.work.wait(max(0.05, IDLE_EXIT_S - idle))
                self.writing = True
                batch = [self.queue.popleft()]
                if isinstance(batch[0], LaneJob):  # what queued meanwhile goes out in the same system call
                    size = _job_bytes(batch[0])
                    while self.queue and isinstance(self.queue[0], LaneJob) and size < COALESCE_BYTES:
                        batch.append(self.queue.popleft())
                        size += _job_bytes(batch[-1])
            try:
                self._send_batch(batch, inline=False)
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill the lane of every transfer
                log.exception("KV lane to %s:%d failed a batch of %d jobs", self.host, self.port, len(batch))
                for job in batch:
                    if isinstance(job, LaneJob):
                        job.sender.lane_failed(exc)
                        if job.kind == "end":
                            settle(job.reply, LaneBroken(f"lane error: {exc!r}"))
            finally:
                with self.cv:
                    self.writing = False
                    self.last_used = time.monotonic()
                    self.cv.notify_all()  # ENDs of the batch went out or failed

    def _connection(self, sender: LaneSender, may_connect: bool) -> LaneConn | None:
        conn = self.conn
        if conn is not None and not conn.dead:
            if conn.timeout_s != sender.config.timeout_s:  # changed at run time (POST /admin/transfer)
                conn.timeout_s = sender.config.timeout_s
                conn.sock.settimeout(conn.timeout_s)
            with self.cv:
                idle = not conn.pending and not self.reading
            if not (idle and sender.lane_conn is None and select.select([conn.sock], [], [], 0)[0]):
                return conn
            # nothing awaited, yet readable: the receiver closed it while idle; a new transfer
            # must not start on it
            conn.kill("receiver closed the idle connection")
        if not may_connect:
            return None
        if time.monotonic() < self._down_until:
            raise OSError(f"{self.host}:{self.port} refused a connection moments ago")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=sender.config.timeout_s)
        except OSError:
            self._down_until = time.monotonic() + max(sender.config.backoff_base_s, 0.01)
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = self.conn = LaneConn(sock, sender.config.timeout_s, self.cv)
        return conn

    def _send_batch(self, batch: list[LaneJob] | list[PartialWrite], inline: bool) -> LaneJob | PartialWrite | None:
        """Frames and ENDs in queue order: small ones gathered into one write, a large frame on
        its own (send_frame checksums it slice by slice while cached). ``inline``: one job from
        its producer, written without blocking; returns what the writer thread must finish."""
        if isinstance(batch[0], PartialWrite):
            rest = batch[0]
            if not rest.conn.dead:
                try:
                    flush(rest.conn, rest.views, rest.counted)
                except OSError as exc:
                    rest.conn.kill(f"send failed: {exc}")
            return None
        live, conn = [], None
        if inline:
            try:
                conn = self._connection(batch[0].sender, may_connect=False)
            except OSError:
                conn = None
            if conn is None:
                return batch[0]  # a connection to open: the writer thread does it
        for job in _merge_frames(batch):
            sender = job.sender
            entry = sender.encode(job.frame) if job.kind == "data" else None  # kept for a retry even if not sent now
            if sender.cancelled or sender.lane_broken:
                if job.kind == "end":
                    settle(job.reply, LaneBroken("cancelled" if sender.cancelled else "the layer stream broke"))
                continue
            live.append((job, entry))
        if not live:
            return None
        try:
            conn = conn or self._connection(live[0][0].sender, may_connect=True)
        except OSError as exc:
            for job, _ in live:
                job.sender.lane_failed(exc)
                if job.kind == "end":
                    settle(job.reply, LaneBroken(str(exc)))
            return None
        gather: list = []
        counted: list[tuple[LaneSender, int]] = []
        late = None  # inline DATA: (parts, claimed crc) of the trailer written after the payload
        try:
            for job, entry in live:
                sender = job.sender
                if sender.lane_conn is not None and sender.lane_conn is not conn:
                    # its earlier frames went on a connection that has died (the reader may not have
                    # marked it yet): never continue a transfer on another one
                    sender.lane_failed(LaneBroken("its lane connection broke"))
                if sender.lane_broken:  # its earlier frames died with a connection: the retry sends
                    if job.kind == "end":
                        settle(job.reply, LaneBroken("the layer stream broke"))
                    continue
                sender.lane_conn = conn
                conn.use(sender)
                sender.lane_started()
                if job.kind == "end":
                    conn.expect(sender, job.reply)
                    bufs = frame_buffers(*encode_frame(sender.end_frame()))
                elif _wire_bytes(entry.wire) > COALESCE_BYTES:
                    flush(conn, gather, counted)
                    sender.send_entry(conn.sock, entry, sender.primary.path)
                    continue
                elif inline:  # its checksum is worked out after the payload is written: meanwhile
                    # the receiver lands it on its core instead of waiting
                    head, parts, claimed = sender.wire_parts(entry)
                    late = (parts, claimed)
                    bufs = [head, *parts]
                    counted.append((sender, len(head) + _wire_bytes(parts) + 4))
                else:
                    bufs = sender.wire_buffers(entry)
                    counted.append((sender, sum(memoryview(b_).nbytes for b_ in bufs)))
                gather += bufs
            if inline:
                count(counted)
                rest = write_now(conn, gather)
                if late is not None:
                    trailer = crc_trailer(late[0], late[1])
                    rest = rest + [trailer] if rest else write_now(conn, [trailer])
                if rest:
                    return PartialWrite(conn, rest, counted)
                gather.clear()
            flush(conn, gather, counted)
        except (OSError, KVIntegrityError) as exc:
            conn.kill(f"send failed: {exc}")  # fails the ENDs awaited on it
            for job, _ in live:
                job.sender.lane_failed(exc)
                if job.kind == "end":
                    settle(job.reply, LaneBroken(str(exc)))
        return None

    # -- reading
    def wait_reply(self, fut: Future) -> dict:
        """The reply to an END submitted with ``fut``: read by this thread when no other waiter
        is reading; raises LaneBroken when the connection failed or the reply is overdue."""
        while True:
            with self.cv:
                while True:
                    if fut.done():
                        return fut.result()
                    conn = self.conn
                    if not self.reading and conn is not None and not conn.dead and conn.pending:
                        self.reading = True
                        break
                    self.cv.wait(1.0)  # a reply, a written END, a dead connection or a reader leaving
            try:
                self._read_replies(conn, fut)
            finally:
                with self.cv:
                    self.reading = False
                    self.cv.notify_all()

    def _read_replies(self, conn: LaneConn, fut: Future) -> None:
        """Hand each REPLY to the transfer it names until ``fut``'s came; EOF, a broken stream or
        a reply overdue by the timeout ends the connection and fails whoever waits on it."""
        while not fut.done() and not conn.dead:
            due = conn.reply_due()
            if due is None:
                return  # nothing awaited on it yet (this END is still queued): wait for the writer
            left = due - time.monotonic()
            if left <= 0:
                conn.kill(f"no reply within {conn.timeout_s:.1f} s")
                return
            try:  # wait at a frame boundary only: a timeout inside a frame loses sync
                if not select.select([conn.sock], [], [], left)[0]:
                    continue
                frame = read_frame(conn.sock)  # a started reply completes within the socket's timeout
            except (OSError, ValueError, KVIntegrityError) as exc:  # ValueError: select on a closed socket
                conn.kill(f"reply stream broke: {exc}")
                return
            if frame is None or frame.kind != FrameKind.REPLY:
                conn.kill("receiver closed the connection" if frame is None
                          else f"unexpected {frame.kind.name} frame from the receiver")
                return
            conn.resolve(frame.request_id, frame.body())


def _merge_frames(batch: list[LaneJob]) -> list[LaneJob]:
    """Consecutive frames of one transfer with adjacent layers become one frame (the receiver
    takes any layer range): one header, one landing and one checksum instead of several."""
    out: list[LaneJob] = []
    for job in batch:
        frame = job.frame
        if out and job.kind == "data" and out[-1].kind == "data" and out[-1].sender is job.sender:
            prev = out[-1].frame
            if (prev.layer_end == frame.layer_start and prev.dtype == frame.dtype
                    and prev.shape[1:] == frame.shape[1:] and isinstance(prev.payload, list)
                    and isinstance(frame.payload, list)
                    and _wire_bytes(prev.payload) + _wire_bytes(frame.payload) <= COALESCE_BYTES):
                out[-1] = LaneJob("data", job.sender, Frame(
                    FrameKind.DATA, frame.request_id, prev.layer_start, frame.layer_end, frame.dtype,
                    (prev.shape[0] + frame.shape[0], *frame.shape[1:]), prev.payload + frame.payload))
                continue
        out.append(job)
    return out


def _wire_bytes(payload) -> int:
    parts = payload if isinstance(payload, list) else [payload]
    return sum(memoryview(p).nbytes for p in parts)


def _job_bytes(job: LaneJob) -> int:
    return _wire_bytes(job.frame.payload) if job.kind == "data" else 0


class Lanes:
    """The lanes of this process, one per decode endpoint (host, port)."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[str, int], _Lane] = {}
        self._lock = threading.Lock()

    def submit(self, host: str, port: int, job: LaneJob) -> _Lane:
        """Send a transfer's DATA frame or END on the endpoint's lane;
        returns the lane, which takes the transfer's later jobs (``offer``) and hands back its
        END's reply (``wait_reply``)."""
        while True:
            with self._lock:
                lane = self._lanes.get((host, port))
                if lane is None:
                    lane = self._lanes[(host, port)] = _Lane(host, port, self)
                    lane.thread.start()
            if lane.offer(job):  # False only when it retired since: its successor takes it
                return lane

    def retire(self, lane: _Lane) -> bool:
        """Called by an idle lane's writer, holding its condition (which ``offer`` takes): True
        when it may end; it then takes no more jobs."""
        with self._lock:
            if lane.queue or lane.writing or lane.reading or (lane.conn and lane.conn.pending):
                return False
            lane.retired = True
            if self._lanes.get((lane.host, lane.port)) is lane:
                del self._lanes[(lane.host, lane.port)]
            return True

    def count(self) -> int:
        with self._lock:
            return len(self._lanes)


LANES = Lanes()
