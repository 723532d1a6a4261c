"""KV transfer data plane: frames, verification, retries, fallback and counters over real sockets."""

from __future__ import annotations

import socket
import threading

import crc32c
import pytest
import torch

from harness.errors import ConfigError, KVTransferError
from harness.engine.kvtransfer.transfer import (PATH_CONTROL, PATH_FABRIC, CorruptFrameError, Endpoint, Frame, KVLayout,
                                     KVReceiver, KVSender, TransferConfig, TransferStats, TruncatedFrameError,
                                     encode_frame, read_frame, send_frame)

LAYERS, TOKENS, HEADS, DIM = 4, 7, 2, 8


class DictSink:
    """Records every verified write, so a test can prove nothing corrupt was ever handed over."""

    def __init__(self, dtype=torch.float32) -> None:
        self.layout = {}
        self.dtype = dtype
        self.writes: list[tuple[str, int, torch.Tensor]] = []
        self.completed: dict[str, int] = {}
        self.done = threading.Event()

    def expect(self, rid: str) -> None:
        self.layout[rid] = KVLayout(LAYERS, TOKENS, HEADS, DIM, self.dtype)

    def kv_layout(self, rid):
        return self.layout.get(rid)

    def kv_write(self, rid, layer_start, kv, release):
        self.writes.append((rid, layer_start, kv.clone()))
        release()

    def kv_complete(self, rid, first_token_id):
        self.completed[rid] = first_token_id
        self.done.set()

    def assembled(self, rid) -> torch.Tensor:
        out = torch.full((LAYERS, 2, TOKENS, HEADS, DIM), float("nan"), dtype=self.dtype)
        for r, start, kv in self.writes:
            if r == rid:
                out[start:start + kv.shape[0]] = kv
        return out


def make_kv(dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, TOKENS, HEADS, DIM, generator=g).to(dtype)  # [L, 2, T, H, D]


@pytest.fixture
def receiver():
    sink, stats = DictSink(), TransferStats()
    rx = KVReceiver(sink, stats, timeout_s=5)
    fabric = rx.listen("127.0.0.1", 0, PATH_FABRIC)
    control = rx.listen("127.0.0.1", 0, PATH_CONTROL)
    yield sink, stats, Endpoint(*fabric, PATH_FABRIC), Endpoint(*control, PATH_CONTROL)
    rx.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def written_layers(sink: DictSink) -> list[int]:
    """Every layer the sink was handed, in order, once per time (a frame may carry several)."""
    return sorted(start + i for _, start, kv in sink.writes for i in range(kv.shape[0]))


def deliver(sender: KVSender, kv: torch.Tensor, first_token: int = 42):
    for layer in range(kv.shape[0]):
        sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
    return sender.finish(first_token)


# ---------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_frame_roundtrip_is_bit_exact(dtype, compression):
    import zstandard
    kv = make_kv(dtype)[1:3]
    a, b = socket.socketpair()
    with a, b:
        comp = zstandard.ZstdCompressor() if compression else None
        send_frame(a, *encode_frame(Frame.from_tensor("req-1", 1, kv), comp))
        frame = read_frame(b)
    assert (frame.request_id, frame.layer_start, frame.layer_end, frame.dtype) == ("req-1", 1, 3, dtype)
    assert torch.equal(frame.tensor(), kv)


def test_payload_corruption_is_rejected_and_stream_stays_aligned():
    kv = make_kv()
    head, wire = encode_frame(Frame.from_tensor("r", 0, kv))
    bad = bytearray(wire)
    bad[5] ^= 0x01
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, head, bad, crc=crc32c.crc32c(wire))  # damaged in flight: trailer of the intact bytes
        send_frame(a, head, wire)
        with pytest.raises(CorruptFrameError) as exc:
            read_frame(b)
        assert exc.value.reason == "crc" and exc.value.in_sync
        assert torch.equal(read_frame(b).tensor(), kv)  # next frame still readable


def test_header_corruption_and_truncation_are_rejected():
    head, wire = encode_frame(Frame.from_tensor("r", 0, make_kv()))
    bad_head = bytearray(head)
    bad_head[20] ^= 0x40
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, bytes(bad_head), wire)
        with pytest.raises(CorruptFrameError) as exc:
            read_frame(b)
        assert not exc.value.in_sync
    a, b = socket.socketpair()
    with b:
        with a:
            a.sendall(head + wire[: len(wire) // 2])
        with pytest.raises(TruncatedFrameError):
            read_frame(b)


def test_config_rejects_bad_values_with_a_fix():
    with pytest.raises(ConfigError, match="layerwise"):
        TransferConfig(mode="streaming")
    with pytest.raises(ConfigError, match="zstd"):
        TransferConfig(compression="lz4")
    with pytest.raises(ConfigError, match="unknown transfer options"):
        TransferConfig.from_dict({"retries": 3})


# ---------------------------------------------------------------- sender + receiver


@pytest.mark.parametrize("mode,compression", [("layerwise", None), ("whole", None), ("layerwise", "zstd")])
def test_delivery_is_exact_and_counted(receiver, mode, compression):
    sink, rx_stats, fabric, control = receiver
    sink.expect("r1")
    kv, stats = make_kv(), TransferStats()
    result = deliver(KVSender("r1", LAYERS, fabric, control, TransferConfig(mode=mode, compression=compression),
                              stats), kv, first_token=77)
    assert sink.completed == {"r1": 77}
    assert torch.equal(sink.assembled("r1"), kv)
    assert (result.path, result.retries, result.fallback) == (PATH_FABRIC, 0, False)
    # layers queued together on the lane go out as one frame (kvtransfer/lane._merge_frames): 1..LAYERS frames
    assert 1 <= result.frames <= LAYERS
    snap = stats.snapshot()["paths"][PATH_FABRIC]
    assert snap["transfers"] == 1 and snap["frames"] == result.frames and snap["bytes"] == result.bytes > 0
    assert rx_stats.snapshot()["received"]["frames"] == result.frames


def test_corrupt_frames_are_detected_retried_and_never_handed_to_the_engine(receiver):
    sink, rx_stats, fabric, control = receiver
    sink.expect("r2")
    kv, stats = make_kv(seed=3), TransferStats()
    result = deliver(KVSender("r2", LAYERS, fabric, control, TransferConfig(), stats, corrupt_frames=2), kv)
    assert rx_stats.snapshot()["rejected"] == {"crc": 2}
    # both damaged frames on the lane (one retry), or the lane merged the layers into one frame and
    # the second damage hit its resend (two retries)
    assert result.retries in (1, 2) and not result.fallback
    for rid, start, written in sink.writes:  # every write the engine saw is the true KV
        assert torch.equal(written, kv[start:start + written.shape[0]])
    assert torch.equal(sink.assembled("r2"), kv)
    assert stats.snapshot()["paths"][PATH_FABRIC]["retries"] == result.retries


def test_dead_primary_falls_back_to_control_path_after_backoff(receiver):
    sink, _, _, control = receiver
    sink.expect("r3")
    kv, stats = make_kv(seed=4), TransferStats()
    dead = Endpoint("127.0.0.1", free_port(), PATH_FABRIC)
    result = deliver(KVSender("r3", LAYERS, dead, control, TransferConfig(max_retries=2), stats), kv)
    assert result.fallback and result.path == PATH_CONTROL
    paths = stats.snapshot()["paths"]
    assert paths[PATH_FABRIC]["failures"] >= 3 and paths[PATH_FABRIC]["retries"] == 2
    assert paths[PATH_CONTROL]["fallbacks"] == 1 and paths[PATH_CONTROL]["transfers"] == 1
    assert torch.equal(sink.assembled("r3"), kv)


def test_no_path_left_raises_transfer_error():
    dead = [Endpoint("127.0.0.1", free_port(), p) for p in (PATH_FABRIC, PATH_CONTROL)]
    sender = KVSender("r4", LAYERS, dead[0], dead[1], TransferConfig(max_retries=1, backoff_base_s=0), TransferStats())
    with pytest.raises(KVTransferError, match="not delivered"):
        deliver(sender, make_kv())


def test_unknown_request_is_refused_without_retries(receiver):
    _, rx_stats, fabric, control = receiver
    stats = TransferStats()
    with pytest.raises(KVTransferError, match="no import pending"):
        deliver(KVSender("ghost", LAYERS, fabric, control, TransferConfig(), stats), make_kv())
    assert stats.snapshot()["paths"][PATH_FABRIC]["retries"] == 0
    # every frame refused: one per layer, fewer when the lane merged queued layers into one frame
    sent = stats.snapshot()["paths"][PATH_FABRIC]["frames"]
    assert 1 <= sent <= LAYERS and rx_stats.snapshot()["rejected"]["unknown_request"] == sent


def test_a_layer_sent_twice_is_written_once(receiver):
    """The buffered path takes a resent layer as the direct path does: once. Under load a cut
    stream's last whole frame may be read after the retry's QUERY was answered, so the sender
    resends it (seen in the truncated-connection test below on a loaded machine: layer 0 written
    twice). Planted defect: _accept_data without its duplicate check (the sink gets layer 0 twice)."""
    sink, stats, fabric, _ = receiver
    sink.expect("rdup")
    kv = make_kv()
    with socket.create_connection((fabric.host, fabric.port)) as conn:
        for _ in range(2):
            send_frame(conn, *encode_frame(Frame.from_tensor("rdup", 0, kv[0:1])))
        pause = threading.Event()
        for _ in range(200):   # the receiver reads the two frames in order on its own thread
            if stats.snapshot()["rejected"].get("duplicate") or len(written_layers(sink)) > 1:
                break
            pause.wait(0.05)
    assert stats.snapshot()["rejected"].get("duplicate") == 1
    assert written_layers(sink).count(0) == 1


def test_truncated_connection_resends_only_missing_layers(receiver):
    """A real TCP proxy cuts the first connection mid-frame; the retry asks what is missing."""
    sink, rx_stats, fabric, control = receiver
    sink.expect("r5")
    kv = make_kv(seed=5)
    frame_len = sum(map(len, encode_frame(Frame.from_tensor("r5", 0, kv[:1]))))
    cut_after = int(frame_len * 1.5)  # layer 0 arrives whole, layer 1 is cut
    proxy = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def pump(src, dst, limit=None):
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve():
        for n in range(2):
            try:
                c, _ = proxy.accept()
            except OSError:
                return
            up = socket.create_connection((fabric.host, fabric.port))
            conns.extend([c, up])
            threads.append(threading.Thread(target=pump, args=(c, up, cut_after if n == 0 else None), daemon=True))
            threads.append(threading.Thread(target=pump, args=(up, c), daemon=True))
            threads[-2].start()
            threads[-1].start()

    threads: list[threading.Thread] = []
    acceptor = threading.Thread(target=serve, daemon=True)
    acceptor.start()
    stats = TransferStats()
    try:
        via_proxy = Endpoint(*proxy.getsockname()[:2], PATH_FABRIC)
        result = deliver(KVSender("r5", LAYERS, via_proxy, control,
                                  TransferConfig(timeout_s=20.0, min_frame_bytes=0), stats), kv)  # a frame a layer
    finally:
        proxy.close()
        acceptor.join(5)
        for c in conns:
            c.close()
        for t in threads:
            t.join(5)
    # Whether the cut is seen by the streaming thread (a broken stream: the first delivery attempt
    # reconnects and asks what is missing) or only at END (one retry) depends on scheduling.
    assert not result.fallback and result.retries in (0, 1)
    assert rx_stats.snapshot()["rejected"].get("truncated") == 1
    assert torch.equal(sink.assembled("r5"), kv)
    assert written_layers(sink) == [0, 1, 2, 3]  # layer 0 written once (resent only if the QUERY beat its frame)


# ---------------------------------------------------------------- idle connections


def test_a_layer_that_takes_longer_than_the_timeout_keeps_the_stream_open():
    """A long prompt's next layer can take minutes on a CPU: the connection idles between frames
    while its request is pending and must not be cut (which would force a resend at the end)."""
    sink, stats = DictSink(), TransferStats()
    rx = KVReceiver(sink, stats, timeout_s=0.3)
    try:
        fabric = Endpoint(*rx.listen("127.0.0.1", 0, PATH_FABRIC), PATH_FABRIC)
        sink.expect("slow")
        kv = make_kv()
        sender = KVSender("slow", LAYERS, fabric, None, TransferConfig(timeout_s=5.0, min_frame_bytes=0), stats)
        sender.send_layer(0, kv[0, 0], kv[0, 1])
        threading.Event().wait(1.2)  # four receiver timeouts with nothing on the wire
        for layer in range(1, LAYERS):
            sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
        result = sender.finish(7)
        assert result.retries == 0 and stats.snapshot()["paths"][PATH_FABRIC]["failures"] == 0
        assert sink.completed == {"slow": 7} and torch.equal(sink.assembled("slow"), kv)
        assert written_layers(sink) == list(range(LAYERS))  # every layer went once, none resent
    finally:
        rx.close()


def test_an_idle_connection_with_nothing_pending_is_closed():
    sink, stats = DictSink(), TransferStats()
    rx = KVReceiver(sink, stats, timeout_s=0.3)
    try:
        host, port = rx.listen("127.0.0.1", 0, PATH_FABRIC)
        with socket.create_connection((host, port), timeout=10) as s:
            assert s.recv(1) == b""  # the receiver hung up (recv would time out after 10 s otherwise)
    finally:
        rx.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                   torch.uint8])
def test_a_tensors_wire_bytes_are_its_own_memory_in_every_dtype(dtype):
    from harness.engine.kvtransfer.wire import tensor_bytes

    kv = (torch.randn(3, 2, TOKENS, HEADS, DIM) * 50).to(dtype)
    k = kv[1, 0]                                # contiguous: no copy, the tensor's own memory
    view = tensor_bytes(k)
    assert view.format == "B" and view.nbytes == k.numel() * k.element_size()
    assert bytes(view) == k.contiguous().view(torch.uint8).numpy().tobytes()
    k.view(torch.uint8).reshape(-1)[0] ^= 0xFF  # a write through the tensor shows in the view
    assert view[0] == int(k.view(torch.uint8).reshape(-1)[0])
    strided = kv[:, 0, 0]                       # not contiguous: a copy, in row-major order
    assert bytes(tensor_bytes(strided)) == strided.contiguous().view(torch.uint8).numpy().tobytes()
