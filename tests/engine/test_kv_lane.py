"""The KV lane (kvtransfer/lane.py): one persistent connection and one writer thread per decode
endpoint, shared by every transfer to it; producers write their own frames when nothing is ahead
of them and read their own replies; what queued together is merged and gathered."""

from __future__ import annotations

import socket
import threading
import time

import torch

from harness.engine.kvtransfer import lane
from harness.engine.kvtransfer.lane_conn import LaneJob
from harness.engine.kvtransfer.transfer import (PATH_FABRIC, Endpoint, Frame, FrameKind, KVLayout, KVReceiver,
                                                KVSender, TransferConfig, TransferStats)

LAYERS, TOKENS, HEADS, DIM = 4, 8, 2, 4


class Sink:
    def __init__(self) -> None:
        self.layouts: dict[str, KVLayout] = {}
        self.kv: dict[str, torch.Tensor] = {}
        self.completed: dict[str, int] = {}

    def expect(self, rid: str) -> None:
        self.layouts[rid] = KVLayout(LAYERS, TOKENS, HEADS, DIM, torch.float32)
        self.kv[rid] = torch.full((LAYERS, 2, TOKENS, HEADS, DIM), float("nan"))

    def kv_layout(self, rid):
        return self.layouts.get(rid)

    def kv_write(self, rid, layer_start, kv, release):
        self.kv[rid][layer_start:layer_start + kv.shape[0]] = kv
        release()

    def kv_complete(self, rid, first_token_id):
        self.completed[rid] = first_token_id


def send(endpoint: Endpoint, rid: str, kv: torch.Tensor, stats: TransferStats, first: int = 5):
    sender = KVSender(rid, LAYERS, endpoint, None, TransferConfig(timeout_s=5.0), stats)
    for layer in range(LAYERS):
        sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
    return sender.finish(first)


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def lane_threads(port: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"kv-lane-127.0.0.1:{port}"]


def test_transfers_to_one_decode_worker_share_one_connection_and_one_sender_thread():
    sink, rx_stats = Sink(), TransferStats()
    rx = KVReceiver(sink, rx_stats, timeout_s=30)
    try:
        endpoint = Endpoint(*rx.listen("127.0.0.1", 0, PATH_FABRIC), PATH_FABRIC)
        stats = TransferStats()
        threads_before = threading.active_count()
        for n in range(6):
            rid = f"r{n}"
            sink.expect(rid)
            kv = torch.randn(LAYERS, 2, TOKENS, HEADS, DIM, generator=torch.Generator().manual_seed(n))
            result = send(endpoint, rid, kv, stats, first=n)
            assert result.retries == 0 and not result.fallback
            assert sink.completed[rid] == n and torch.equal(sink.kv[rid], kv)
        serving = [t for t in rx._threads if t.name.startswith("kv-recv-")]  # one a connection accepted
        assert len(rx._conns) == 1 and len(serving) == 1                         # one connection
        assert len(lane_threads(endpoint.port)) == 1                                  # one sender thread
        assert not [t for t in threading.enumerate() if t.name.startswith("kv-send-")]  # none per transfer
        # the lane's writer and the receiver's one connection thread, whatever the number of
        # transfers (replies are read by the transfers waiting for them)
        assert threading.active_count() <= threads_before + 2
        assert not [t for t in threading.enumerate() if t.name.startswith("kv-lane-replies")]
        assert stats.snapshot()["paths"][PATH_FABRIC]["transfers"] == 6
    finally:
        rx.close()


def test_a_connection_the_receiver_closed_is_replaced_before_the_next_transfer():
    sink = Sink()
    rx = KVReceiver(sink, TransferStats(), timeout_s=0.3)  # closes idle connections with nothing pending
    try:
        endpoint = Endpoint(*rx.listen("127.0.0.1", 0, PATH_FABRIC), PATH_FABRIC)
        stats = TransferStats()
        sink.expect("a")
        kv = torch.randn(LAYERS, 2, TOKENS, HEADS, DIM)
        assert send(endpoint, "a", kv, stats).retries == 0
        first = lane.LANES._lanes[("127.0.0.1", endpoint.port)].conn
        assert wait_until(lambda: not rx._conns), "the receiver never closed its idle connection"
        assert not first.dead  # nobody reads an idle lane connection: noticed when a transfer starts
        sink.expect("b")
        result = send(endpoint, "b", kv, stats)
        assert result.retries == 0 and not result.fallback and torch.equal(sink.kv["b"], kv)
        assert first.dead and lane.LANES._lanes[("127.0.0.1", endpoint.port)].conn is not first
        assert stats.snapshot()["paths"][PATH_FABRIC]["failures"] == 0
    finally:
        rx.close()


def test_small_layers_ride_together_until_a_frame_holds_min_frame_bytes():
    """Fails if send_layer ignores min_frame_bytes (a frame a layer at every setting) or holds
    layers back when it is 0. Each request starts on an idle lane: CI once saw a layer queue behind
    the writer thread still leaving the warm-up's batch, and the writer merge all four into one."""
    sink, rx_stats = Sink(), TransferStats()
    rx = KVReceiver(sink, rx_stats, timeout_s=30)
    layer_bytes = 2 * TOKENS * HEADS * DIM * 4
    try:
        endpoint = Endpoint(*rx.listen("127.0.0.1", 0, PATH_FABRIC), PATH_FABRIC)
        sink.expect("warm")  # the lane's connection is up: no frame waits for the writer thread to open it
        # its frames: however the writer thread found its layers queued (1 to LAYERS)
        warm_frames = send(endpoint, "warm", torch.randn(LAYERS, 2, TOKENS, HEADS, DIM), TransferStats()).frames
        for n, (min_bytes, frames) in enumerate([(0, LAYERS), (2 * layer_bytes, 2), (3 * layer_bytes, 2),
                                                  (1 << 20, 1)]):
            rid = f"m{n}"
            sink.expect(rid)
            # the writer thread may still be leaving the last END's batch (a loaded machine): a
            # layer offered meanwhile queues and the writer merges the rest with it into one frame
            the_lane = lane.LANES._lanes[("127.0.0.1", endpoint.port)]
            assert wait_until(lambda: not the_lane.writing and not the_lane.queue), "the lane never went idle"
            kv = torch.randn(LAYERS, 2, TOKENS, HEADS, DIM, generator=torch.Generator().manual_seed(n))
            sender = KVSender(rid, LAYERS, endpoint, None, TransferConfig(timeout_s=5.0, min_frame_bytes=min_bytes),
                              TransferStats())
            sent_before = []
            for layer in range(LAYERS):
                sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
                sent_before.append(sender._frames_sent)
            result = sender.finish(n)
            # 3 layers' worth: layers 0-2 in one frame, the last layer alone (the rest of the KV)
            assert result.frames == frames and result.retries == 0, (min_bytes, result)
            assert torch.equal(sink.kv[rid], kv) and sink.completed[rid] == n
            if min_bytes == 0:  # a frame a layer, written by the producer as it hands the layer over
                assert sent_before == [1, 2, 3, 4]
            elif min_bytes == 1 << 20:  # nothing out before the last layer
                assert sent_before == [0, 0, 0, 1]
        assert rx_stats.snapshot()["received"]["frames"] == warm_frames + LAYERS + 2 + 2 + 1
    finally:
        rx.close()


class _Sender:  # _merge_frames only compares senders by identity
    pass


def _data(sender, start: int, end: int, nbytes: int = 8) -> LaneJob:
    parts = [memoryview(bytes([start]) * nbytes) for _ in range(end - start)]
    return LaneJob("data", sender, Frame(FrameKind.DATA, "r", start, end, torch.float32, (end - start, 2, 1, 1, 1),
                                         parts))


def test_adjacent_layers_of_one_transfer_queued_together_become_one_frame():
    a, b = _Sender(), _Sender()
    end = LaneJob("end", a)
    out = lane._merge_frames([_data(a, 0, 1), _data(a, 1, 2), _data(a, 2, 3), end, _data(a, 3, 4)])
    assert [(j.kind, j.frame.layer_start, j.frame.layer_end) if j.kind == "data" else (j.kind,) for j in out] == \
        [("data", 0, 3), ("end",), ("data", 3, 4)]
    merged = out[0].frame
    assert merged.shape == (3, 2, 1, 1, 1) and [bytes(p)[0] for p in merged.payload] == [0, 1, 2]
    # another transfer between, a gap in the layers, or too many bytes: no merge
    assert len(lane._merge_frames([_data(a, 0, 1), _data(b, 1, 2), _data(a, 1, 2)])) == 3
    assert len(lane._merge_frames([_data(a, 0, 1), _data(a, 2, 3)])) == 2
    big = lane.COALESCE_BYTES // 2 + 1
    assert len(lane._merge_frames([_data(a, 0, 1, big), _data(a, 1, 2, big)])) == 2


def test_a_frame_the_socket_cannot_take_now_is_finished_by_the_writer_without_blocking_the_producer():
    """A proxy stops reading (a stalled link): the producer's layers do not fit the socket
    buffers, yet every send_layer returns while the link is stalled; the writer thread sends the
    rest once it moves again, and every byte arrives."""
    tokens, heads, dim = 8192, 8, 8  # 4 MiB a layer (float32), 16 MiB a transfer: more than loopback buffers
    layouts: dict[str, KVLayout] = {}
    got: dict[str, torch.Tensor] = {}

    class BigSink(Sink):
        def kv_layout(self, rid):
            return layouts.get(rid)

        def kv_write(self, rid, layer_start, kv, release):
            got[rid][layer_start:layer_start + kv.shape[0]] = kv
            release()

    sink = BigSink()
    rx = KVReceiver(sink, TransferStats(), timeout_s=30)
    gate = threading.Event()
    gate.set()
    proxy = socket.create_server(("127.0.0.1", 0))
    threads: list[threading.Thread] = []

    def pump(src, dst, gated):
        try:
            while True:
                if gated:
                    gate.wait()
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass

    def serve():
        try:
            c, _ = proxy.accept()
        except OSError:
            return
        up = socket.create_connection(rx_addr)
        for args in ((c, up, True), (up, c, False)):
            threads.append(threading.Thread(target=pump, args=args, daemon=True))
            threads[-1].start()

    try:
        rx_addr = rx.listen("127.0.0.1", 0, PATH_FABRIC)
        acceptor = threading.Thread(target=serve, daemon=True)
        acceptor.start()
        endpoint = Endpoint(*proxy.getsockname()[:2], PATH_FABRIC)
        config = TransferConfig(timeout_s=30.0, min_frame_bytes=0)
        for rid in ("warm", "big"):  # the first opens the lane's connection through the proxy
            layouts[rid] = KVLayout(LAYERS, tokens, heads, dim, torch.float32)
            got[rid] = torch.full((LAYERS, 2, tokens, heads, dim), float("nan"))
        kv = torch.randn(LAYERS, 2, tokens, heads, dim, generator=torch.Generator().manual_seed(9))
        warm = KVSender("warm", LAYERS, endpoint, None, config, TransferStats())
        for layer in range(LAYERS):
            warm.send_layer(layer, kv[layer, 0], kv[layer, 1])
        assert warm.finish(1).retries == 0
        gate.clear()  # the link stalls
        opened_by_timer = threading.Event()
        timer = threading.Timer(20.0, lambda: (opened_by_timer.set(), gate.set()))
        timer.start()
        sender = KVSender("big", LAYERS, endpoint, None, config, TransferStats())
        for layer in range(LAYERS):
            sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
        written_while_stalled = sender._frames_sent
        gate.set()  # every send_layer returned while the link was stalled
        timer.cancel()
        assert not opened_by_timer.is_set(), "send_layer blocked on a stalled link"
        assert written_while_stalled < LAYERS  # the rest was left to the writer thread
        result = sender.finish(2)
        assert result.retries == 0 and result.frames == LAYERS and torch.equal(got["big"], kv)
    finally:
        gate.set()
        proxy.close()
        rx.close()
        for t in threads:
            t.join(5)
