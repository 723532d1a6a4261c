"""KV transfer goodput against a raw TCP socket moving the same bytes on the same path.

For each size (tokens of context) this builds the KV of one request with the shape of a model
preset ([layers, 2, tokens, kv_heads, head_dim]), sends it with KVSender to a KVReceiver whose
sink is a decode worker's block pool: frames land straight in the request's reserved blocks
(kvtransfer/landing.py, as a worker does), and times it from the first layer handed over to the
receiver's commit. The sender reuses its connection across transfers, as a prefill worker does.
Two baselines in the same run, each one ``sendall`` of the same bytes to a ``recv_into`` loop in
the receiver process, timed to the receiver's one-byte acknowledgement: ``raw`` over a TCP
connection kept across transfers (the stricter: KV / raw), and ``new`` over a fresh connection
per transfer (KV / new, the baseline of issue 13's figures). Each measured transfer follows an
unmeasured one of its own kind. Prints the ratios per size: the median of --repeats, or of
--small-repeats for transfers under 16 MiB (they take about a millisecond, and this machine's
noise moved a median of 9 by a third from run to run; a median of 101 held within a few percent).
When Mooncake's transfer engine can be imported (here, or in the virtualenv --mooncake-python
names), the same bytes also go through it over TCP between two processes on the same host
address (mooncake_peer.py), interleaved with the others, and the ratio KV / Mooncake is printed.

    .venv/bin/python bench/bench_transfer.py                 # small preset, 128 .. 32768 tokens
    .venv/bin/python bench/bench_transfer.py --compression zstd --sizes 128,2048
    .venv/bin/python bench/bench_transfer.py --mooncake-python ../venv-mooncake  # a venv with the bench extra
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
import zlib

import torch

from harness.engine.core.config import EngineConfig, ModelConfig
from harness.engine.core.kv_cache import KVBlockPool
from harness.engine.kvtransfer.landing import block_views, layer_views
from harness.engine.kvtransfer.transfer import (PATH_FABRIC, Endpoint, KVLayout, KVReceiver, KVSender, TransferConfig,
                                     TransferStats)
from mooncake_peer import INSTALL_HINT, MooncakePair, MooncakeUnavailable, interpreter


# Both ends run with the torch threads of an engine process (EngineConfig.num_threads): with the
# default (one per core), torch's idle OpenMP workers spin on the other core after every parallel
# copy, and the decode side then runs on the prefill side's core, after it instead of alongside.
ENGINE_THREADS = EngineConfig().num_threads or torch.get_num_threads()
SMALL_BYTES = 16 << 20  # transfers under this size use --small-repeats


class CacheSink:
    """A decode worker's KV pool: frames land in each request's reserved blocks, as in a worker."""

    BLOCK_SIZE = 16

    def __init__(self, cfg: ModelConfig, max_tokens: int) -> None:
        self.pool = KVBlockPool(-(-max_tokens // self.BLOCK_SIZE), cfg.n_layers, cfg.n_kv_heads, self.BLOCK_SIZE,
                                cfg.head_dim, cfg.torch_dtype)  # zeroed once: a worker's pool is touched at start
        self.layouts: dict[str, KVLayout] = {}
        self.blocks: dict[str, list[int]] = {}
        self.views: dict[str, list] = {}
        self.done: dict[str, threading.Event] = {}

    def expect(self, rid: str, layout: KVLayout) -> None:
        """The import begins: blocks reserved and their views worked out before the KV comes,
        as a worker does (landing.ImportLanding.register)."""
        self.layouts[rid] = layout
        self.blocks[rid] = self.pool.allocate(self.pool.blocks_for(layout.num_tokens))
        self.views[rid] = block_views(self.pool.storage, self.blocks[rid], layout.num_tokens, 0, layout.num_layers)
        self.done[rid] = threading.Event()

    def kv_layout(self, rid):
        return self.layouts.get(rid)

    def kv_recv_into(self, rid, layer_start, layer_end, nbytes):
        return layer_views(self.views[rid], self.layouts[rid].num_layers, layer_start, layer_end), lambda ok: None

    def kv_write(self, rid, layer_start, kv, release):
        raise AssertionError("every frame should have landed in the blocks")

    def kv_complete(self, rid, first_token_id):
        self.done[rid].set()

    def received(self, rid: str) -> torch.Tensor:
        layout = self.layouts.pop(rid)
        blocks = self.blocks.pop(rid)
        self.views.pop(rid)
        kv = torch.stack([torch.stack(self.pool.gather(layer, blocks, layout.num_tokens))
                          for layer in range(layout.num_layers)])
        self.pool.free(blocks)
        return kv


def raw_tcp_seconds(host: str, payload: memoryview) -> float:
    """One sendall of ``payload`` to a recv_into loop; timed until the receiver acknowledges."""
    nbytes = payload.nbytes
    srv = socket.create_server((host, 0))

    def receive() -> None:
        conn, _ = srv.accept()
        with conn:
            buf = memoryview(bytearray(1 << 22))
            got = 0
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                got += n
            conn.sendall(b"k")

    t = threading.Thread(target=receive)
    t.start()
    try:
        with socket.create_connection(srv.getsockname()[:2]) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            c.sendall(payload)
            c.recv(1)
            return time.perf_counter() - t0
    finally:
        t.join()
        srv.close()


def send_kv_seconds(endpoint: Endpoint, kv: torch.Tensor, rid: str, config: TransferConfig) -> float:
    """Send ``kv`` layer by layer as a prefill worker does; seconds until the receiver committed it.
    Each layer's K and V are separate tensors before the clock starts, as a model's forward hands
    them over (indexing them out of one tensor is the bench's doing, not the transfer's)."""
    layers = [(kv[layer, 0], kv[layer, 1]) for layer in range(kv.shape[0])]
    t0 = time.perf_counter()
    sender = KVSender(rid, kv.shape[0], endpoint, None, config, TransferStats())
    for layer, (k, v) in enumerate(layers):
        sender.send_layer(layer, k, v)
    sender.finish(0)
    return time.perf_counter() - t0


def kv_seconds(endpoint: Endpoint, sink: CacheSink, kv: torch.Tensor, rid: str, config: TransferConfig) -> float:
    sink.expect(rid, KVLayout(kv.shape[0], kv.shape[2], kv.shape[3], kv.shape[4], kv.dtype))
    seconds = send_kv_seconds(endpoint, kv, rid, config)
    assert torch.equal(sink.received(rid), kv), "received KV differs from what was sent"
    return seconds


class ReceiverProcess:
    """The decode side in its own process, as in a PD cluster (a prefill and a decode worker are two
    processes; one process with both ends shares one GIL and measures that, not the path). It owns
    a CacheSink with its KVReceiver and a raw TCP receiver for the baseline, driven over a pipe."""

    def __init__(self, cfg: ModelConfig, max_tokens: int, host: str) -> None:
        ctx = mp.get_context("fork")  # before the parent starts any thread
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_receiver_main, args=(child, cfg.name, max_tokens, host), daemon=True)
        self._proc.start()
        self.kv_port, self.raw_port = self._conn.recv()
        self.raw_sock: socket.socket | None = None  # the baseline's connection, opened by its first transfer

    def call(self, *msg):
        self._conn.send(msg)
        reply = self._conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"receiver process: {reply[1]}")
        return reply

    def close(self) -> None:
        if self.raw_sock is not None:
            self.raw_sock.close()
        try:
            self.call("quit")
        finally:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()


def _receiver_main(conn, preset: str, max_tokens: int, host: str) -> None:
    torch.set_num_threads(ENGINE_THREADS)
    cfg = ModelConfig.from_name(preset)
    sink = CacheSink(cfg, max_tokens)
    receiver = KVReceiver(sink, TransferStats())
    _, kv_port = receiver.listen(host, 0, PATH_FABRIC)
    raw = socket.create_server((host, 0))
    conn.send((kv_port, raw.getsockname()[1]))
    buf = memoryview(bytearray(1 << 22))
    raw_conn = None
    try:
        while True:
            msg = conn.recv()
            try:
                if msg[0] == "quit":
                    conn.send("ok")
                    return
                if msg[0] == "expect":  # (rid, layers, tokens, heads, head_dim, dtype name)
                    _, rid, layers, tokens, heads, dim, dtype = msg
                    sink.expect(rid, KVLayout(layers, tokens, heads, dim, getattr(torch, dtype)))
                    conn.send("ok")
                elif msg[0] == "received":  # wait for the commit, then the bytes' checksum
                    rid = msg[1]
                    if not sink.done[rid].wait(120):
                        conn.send(("error", f"{rid} never completed"))
                        continue
                    conn.send(zlib.crc32(sink.received(rid).contiguous().numpy().tobytes()))
                elif msg[0] == "raw_new":  # accept one connection, read nbytes, acknowledge, close
                    conn.send("ok")
                    c, _ = raw.accept()
                    with c:
                        got = 0
                        while got < msg[1]:
                            n = c.recv_into(buf)
                            if not n:
                                break
                            got += n
                        c.sendall(b"k")
                elif msg[0] == "raw":  # read nbytes on the baseline's connection, acknowledge
                    conn.send("ok")
                    if raw_conn is None:  # one connection for every baseline transfer, as the KV lane
                        raw_conn, _ = raw.accept()
                    got = 0
                    while got < msg[1]:
                        n = raw_conn.recv_into(buf)
                        if not n:
                            raise ConnectionError("the baseline's connection closed")
                        got += n
                    raw_conn.sendall(b"k")
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
                conn.send(("error", repr(exc)))
    finally:
        receiver.close()
        if raw_conn is not None:
            raw_conn.close()
        raw.close()


def raw_tcp_seconds_to(proc: ReceiverProcess, host: str, payload: memoryview) -> float:
    """The baseline across processes: one sendall to the receiver process's recv_into loop, on a
    connection kept from one transfer to the next (as the KV lane keeps its own): a fresh one
    starts with a small receive window, which made the baseline slower and noisier at 1 MiB."""
    proc.call("raw", payload.nbytes)
    if proc.raw_sock is None:
        # accepted by the receiver after any fresh connection it was told to take (raw_new_seconds_to)
        proc.raw_sock = socket.create_connection((host, proc.raw_port))
        proc.raw_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    proc.raw_sock.sendall(payload)
    proc.raw_sock.recv(1)
    return time.perf_counter() - t0


def raw_new_seconds_to(proc: ReceiverProcess, host: str, payload: memoryview) -> float:
    """The baseline the KV transfer was first measured against: a fresh connection a transfer
    (its receive window starts small), timed from after the handshake."""
    proc.call("raw_new", payload.nbytes)
    with socket.create_connection((host, proc.raw_port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        c.sendall(payload)
        c.recv(1)
        return time.perf_counter() - t0


def kv_seconds_to(proc: ReceiverProcess, endpoint: Endpoint, kv: torch.Tensor, rid: str,
                  config: TransferConfig) -> float:
    proc.call("expect", rid, kv.shape[0], kv.shape[2], kv.shape[3], kv.shape[4], str(kv.dtype).split(".")[-1])
    seconds = send_kv_seconds(endpoint, kv, rid, config)
    assert proc.call("received", rid) == zlib.crc32(kv.contiguous().numpy().tobytes()), \
        "received KV differs from what was sent"
    return seconds


def start_mooncake(python: str, host: str, cfg: ModelConfig, max_tokens: int, required: bool):
    """Mooncake's sender and receiver peers, or None (with one line saying why) when not installed."""
    capacity = max_tokens * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * \
        torch.empty((), dtype=cfg.torch_dtype).element_size()
    try:
        mc = MooncakePair(python, host, capacity)
    except MooncakeUnavailable as exc:
        if required:
            raise SystemExit(f"Mooncake: {exc}; {INSTALL_HINT}") from None
        print(f"Mooncake: not measured: {exc}; {INSTALL_HINT}")
        return None
    print(f"Mooncake: {mc.description}; each size's bytes written into a registered buffer of the "
          f"receiver process, checked by crc32")
    return mc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--sizes", default="128,512,2048,8192,32768", help="tokens of context, comma-separated")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--small-repeats", type=int, default=101,
                   help=f"repeats of sizes under {SMALL_BYTES >> 20} MiB (about a millisecond each)")
    p.add_argument("--host", default="127.0.0.1", help="address both ends use (the path under test)")
    p.add_argument("--compression", choices=("zstd",), default=None)
    p.add_argument("--min-frame-bytes", type=int, default=TransferConfig.min_frame_bytes,
                   help="the transfer's min_frame_bytes (layers under it ride together in one frame)")
    p.add_argument("--same-process", action="store_true",
                   help="both ends as threads of this process (the old layout: one GIL for both)")
    p.add_argument("--mooncake-python", metavar="PATH", default=None,
                   help="a virtualenv (or its python) with Mooncake installed; default: this interpreter")
    p.add_argument("--no-mooncake", action="store_true", help="leave the Mooncake baseline out")
    args = p.parse_args()
    torch.set_num_threads(ENGINE_THREADS)
    try:
        mc_python = interpreter(args.mooncake_python)
    except ValueError as exc:
        p.error(str(exc))
    cfg = ModelConfig.from_name(args.preset)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.min_frame_bytes < 0:
        p.error(f"--min-frame-bytes must be 0 or more (0: a frame per layer), got {args.min_frame_bytes}")
    config = TransferConfig(compression=args.compression, timeout_s=60, min_frame_bytes=args.min_frame_bytes)
    proc = None if args.same_process else ReceiverProcess(cfg, max(sizes), args.host)
    if proc is None:
        sink = CacheSink(cfg, max(sizes))
        receiver = KVReceiver(sink, TransferStats())
        endpoint = Endpoint(*receiver.listen(args.host, 0, PATH_FABRIC), PATH_FABRIC)
    else:
        endpoint = Endpoint(args.host, proc.kv_port, PATH_FABRIC)
    print(f"preset {cfg.name}: {cfg.kv_bytes_per_token()} KV bytes/token ({cfg.dtype}), {cfg.n_layers} layers, "
          f"host {args.host}, compression {args.compression}, min_frame_bytes {args.min_frame_bytes}, "
          f"median of n (column n), receiver "
          f"{'a thread of this process' if proc is None else 'its own process'}")
    mc = None
    try:
        if not args.no_mooncake:
            mc = start_mooncake(mc_python, args.host, cfg, max(sizes), required=args.mooncake_python is not None)
        print("raw: the same bytes over a TCP connection kept across transfers, as the KV lane keeps its own; "
              "new: over a fresh connection each (the baseline of the first measurements, slower: its receive "
              "window starts small)")
        print(f"{'tokens':>7} {'MiB':>8} {'n':>4} {'raw GB/s':>9} {'new GB/s':>9} {'KV GB/s':>8} {'KV/raw':>7} {'KV/new':>7}"
              + (f" {'MC GB/s':>8} {'KV/MC':>6}" if mc is not None else ""))
        for n_size, tokens in enumerate(sizes):
            g = torch.Generator().manual_seed(tokens)
            kv = torch.randn(cfg.n_layers, 2, tokens, cfg.n_kv_heads, cfg.head_dim, generator=g,
                             dtype=torch.float32).to(cfg.torch_dtype)  # [L, 2, T, H, D]
            nbytes = kv.numel() * kv.element_size()
            times: dict[str, list[float]] = {"raw": [], "new": [], "kv": [], "mc": []}
            # raw TCP sends the KV's own bytes (a fresh zeroed buffer would be read from the
            # kernel's one zero page, always in cache)
            payload = memoryview(kv.contiguous().view(torch.uint8).numpy()).cast("B")
            kinds = {"new": lambda rid: raw_tcp_seconds(args.host, payload),
                     "kv": lambda rid: kv_seconds(endpoint, sink, kv, rid, config)} if proc is None else {
                     "raw": lambda rid: raw_tcp_seconds_to(proc, args.host, payload),
                     "new": lambda rid: raw_new_seconds_to(proc, args.host, payload),
                     "kv": lambda rid: kv_seconds_to(proc, endpoint, kv, rid, config)}
            with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as same_bytes:
                if mc is not None:  # the Mooncake sender loads these bytes into its registered buffer, untimed
                    kv_bytes = kv.contiguous().view(torch.uint8).numpy().data
                    same_bytes.write(kv_bytes)
                    same_bytes.flush()
                    crc = zlib.crc32(kv_bytes)
                    kinds["mc"] = lambda rid: mc.seconds(same_bytes.name, nbytes, crc)
                repeats = args.small_repeats if nbytes < SMALL_BYTES else args.repeats
                for r in range(repeats):  # interleaved so drift hits all alike; each measured
                    # transfer follows an unmeasured one of its own kind, as in a steady stream of
                    # them: right after another kind, its caches held the other's buffers and the
                    # first 1 MiB transfer took 1.3-1.6x as long, whichever kind
                    for kind, run in kinds.items():
                        run(f"bench-{n_size}-{tokens}-{r}-warm")
                        times[kind].append(run(f"bench-{n_size}-{tokens}-{r}"))
            gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items() if v}
            row = (f"{tokens:>7} {nbytes / 2**20:>8.1f} {repeats:>4} " + (f"{gbs['raw']:>9.2f}" if "raw" in gbs else f"{'n/a':>9}")
                   + f" {gbs['new']:>9.2f} {gbs['kv']:>8.2f} "
                   + (f"{gbs['kv'] / gbs['raw']:>7.2f}" if "raw" in gbs else f"{'n/a':>7}")
                   + f" {gbs['kv'] / gbs['new']:>7.2f}")
            if mc is not None:
                row += f" {gbs['mc']:>8.2f} {gbs['kv'] / gbs['mc']:>6.2f}"
            print(row, flush=True)
    finally:
        if mc is not None:
            mc.close()
        if proc is None:
            receiver.close()
        else:
            proc.close()


if __name__ == "__main__":
    main()
