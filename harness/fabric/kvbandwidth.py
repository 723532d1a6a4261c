"""KV transfer bandwidth over the fabric, as a curve over transfer sizes (checklist item 1).

The engine's own data plane does the work: a sender process in one host runs
:class:`harness.engine.kvtransfer.transfer.KVSender` (crc32c frames, layer by layer, retries) exactly as a
prefill worker does, and a receiver process in another host runs
:class:`~harness.engine.kvtransfer.transfer.KVReceiver` with a sink that verifies every frame against the
expected layout and copies it into place (as a decode worker's import does). KV tensors have the
preset's layout ``[layers, 2, tokens, kv_heads, head_dim]``; a transfer size is a number of
tokens. Bandwidth = wire bytes / the sender's transfer time (from the first layer handed over to
the receiver's commit), the figure the engine's transfer counters report.

Both processes are long-lived (``python -m harness.fabric.kvbandwidth receive|send``) and talk
JSON lines with the driver, so torch is imported once, not per point.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Sequence

from harness.stats import nearest_rank
from harness.errors import ConfigError, ProbeError
from harness.fabric.bandwidth import Station
from harness.fabric.procs import HostProcess

log = logging.getLogger(__name__)

DEFAULT_SIZES_MIB = (1, 8, 32, 128)
STARTUP_TIMEOUT_S = 120.0
BENCH_TIMEOUT_S = 10.0     # a socket operation of a bench transfer making no progress this long fails it  # the children import torch on a loaded 2-core machine


@dataclass(frozen=True)
class KVPoint:
    size_bytes: int      # KV payload of one transfer
    tokens: int
    gbit_per_s: list[float]   # one per repeat: wire bytes * 8 / transfer seconds
    retries: int
    fallbacks: int

    @property
    def median_gbit_per_s(self) -> float:
        return nearest_rank(self.gbit_per_s, 50)

    def to_dict(self) -> dict:
        return {**asdict(self), "size_mib": self.size_bytes / (1 << 20), "median_gbit_per_s": self.median_gbit_per_s}


@dataclass
class KVCurve:
    preset: str
    sender: str
    receiver: str
    points: list[KVPoint] = field(default_factory=list)

    @property
    def largest(self) -> KVPoint:
        if not self.points:
            raise ProbeError("the KV bandwidth curve has no points", fix="measure at least one transfer size")
        return max(self.points, key=lambda p: p.size_bytes)

    def to_dict(self) -> dict:
        return {"preset": self.preset, "sender": self.sender, "receiver": self.receiver,
                "points": [p.to_dict() for p in self.points]}


def _layout(preset: str) -> tuple[int, int, int, str, int]:
    from harness.engine.core.config import ModelConfig

    cfg = ModelConfig.from_name(preset)
    return cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.dtype, cfg.kv_bytes_per_token()


class KVBench:
    """A receiver process in one host and a sender process in another; measure transfers between them."""

    def __init__(self, sender: Station, receiver: Station, *, port: int, preset: str = "medium",
                 transfer: dict | None = None) -> None:
        self.sender_station, self.receiver_station, self.port, self.preset = sender, receiver, port, preset
        self.layers, self.kv_heads, self.head_dim, self.dtype, self.bytes_per_token = _layout(preset)
        # the engine's 2 s no-progress timeout is for detecting a dead peer; a bandwidth bench on a
        # shared, loaded machine must not turn a receiver starved of CPU for 2 s into a harness error
        self.transfer = {"timeout_s": BENCH_TIMEOUT_S, **(transfer or {})}
        self._rx: HostProcess | None = None
        self._tx: HostProcess | None = None
        self._n = 0

    def __enter__(self) -> KVBench:
        try:
            self._rx = HostProcess.python(self.receiver_station.prefix, __name__, "receive",
                                          self.receiver_station.address, str(self.port),
                                          name=f"KV receiver in {self.receiver_station.name}")
            self._tx = HostProcess.python(self.sender_station.prefix, __name__, "send",
                                          json.dumps(self.transfer), name=f"KV sender in {self.sender_station.name}")
            for proc in (self._rx, self._tx):
                if proc.readline(STARTUP_TIMEOUT_S) != "ready":
                    raise ProbeError(f"{proc.name} did not start", fix="read its stderr")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in (self._tx, self._rx):
            if proc is not None:
                proc.stop()

    def tokens_for(self, size_bytes: int) -> int:
        return max(1, round(size_bytes / self.bytes_per_token))

    def transfer_once(self, tokens: int, timeout_s: float = 120.0) -> dict:
        """One KV transfer of ``tokens`` tokens; the sender's TransferResult as a dict."""
        if self._rx is None or self._tx is None:
            raise ProbeError("KVBench is not started", fix="use it as a context manager")
        self._n += 1
        rid = f"kvbench-{self._n}"
        layout = [self.layers, tokens, self.kv_heads, self.head_dim, self.dtype]
        self._rx.send(json.dumps({"rid": rid, "layout": layout}))
        if self._rx.readline(timeout_s) != f"expecting {rid}":
            raise ProbeError(f"KV receiver did not accept {rid}", fix="read its stderr")
        self._tx.send(json.dumps({"rid": rid, "layout": layout, "host": self.receiver_station.address,
                                  "port": self.port}))
        result = json.loads(self._tx.readline(timeout_s))
        if "error" in result:
            raise ProbeError(f"KV transfer {rid} of {tokens} tokens failed: {result['error']}",
                             fix="check the fabric link and the receiver")
        return result

    def measure(self, sizes_bytes: Sequence[int], repeats: int = 2) -> KVCurve:
        if repeats < 1 or not sizes_bytes:
            raise ConfigError("measure() needs at least one size and one repeat", fix="pass sizes and repeats >= 1")
        curve = KVCurve(self.preset, self.sender_station.name, self.receiver_station.name)
        self.transfer_once(self.tokens_for(1 << 20))  # warm-up: first connection, allocator, page faults
        for size in sorted(sizes_bytes):
            curve.points.append(self._repeat(KVPoint(0, self.tokens_for(size), [], 0, 0), repeats))
        return curve

    def more(self, curve: KVCurve, count: int) -> KVPoint:
        """``count`` more transfers at the curve's largest size (the judged one), added to it."""
        largest = curve.largest
        curve.points[curve.points.index(largest)] = point = self._repeat(largest, count)
        return point

    def _repeat(self, point: KVPoint, count: int) -> KVPoint:
        results = [self.transfer_once(point.tokens) for _ in range(count)]
        out = KVPoint(size_bytes=point.tokens * self.bytes_per_token, tokens=point.tokens,
                      gbit_per_s=point.gbit_per_s + [r["bytes"] * 8 / r["seconds"] / 1e9 for r in results],
                      retries=point.retries + sum(r["retries"] for r in results),
                      fallbacks=point.fallbacks + sum(1 for r in results if r["fallback"]))
        log.info("KV %d tokens (%.1f MiB): %s Gbit/s", out.tokens, out.size_bytes / (1 << 20),
                 ", ".join(f"{g:.3f}" for g in out.gbit_per_s))
        return out


def measure_kv_curve(sender: Station, receiver: Station, *, port: int, preset: str = "medium",
                     sizes_mib: Sequence[float] = DEFAULT_SIZES_MIB, repeats: int = 2) -> KVCurve:
    with KVBench(sender, receiver, port=port, preset=preset) as bench:
        return bench.measure([int(s * (1 << 20)) for s in sizes_mib], repeats)


# ---------------------------------------------------------------- the two ends (child processes)


class _BenchSink:
    """Decode-side stand-in for an import: knows each expected layout and copies every verified
    layer into a destination tensor (as a decode worker copies into its KV blocks), then frees
    the receive buffer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layouts: dict = {}
        self._dest: dict = {}

    def expect(self, rid: str, layout) -> None:
        import torch

        with self._lock:
            self._layouts[rid] = layout
            shape = (layout.num_layers, 2, layout.num_tokens, layout.num_kv_heads, layout.head_dim)
            self._dest[rid] = torch.empty(shape, dtype=layout.dtype)  # [layers, 2, T, H, D]

    def kv_layout(self, request_id: str):
        with self._lock:
            return self._layouts.get(request_id)

    def kv_write(self, request_id: str, layer_start: int, kv, release) -> None:
        try:
            with self._lock:
                dest = self._dest[request_id]
            dest[layer_start:layer_start + kv.shape[0]].copy_(kv)  # kv: [layers, 2, T, H, D]
        finally:
            release()

    def kv_complete(self, request_id: str, first_token_id: int) -> None:
        with self._lock:
            self._layouts.pop(request_id, None)
            self._dest.pop(request_id, None)


def _receive(host: str, port: int) -> None:
    import torch

    from harness.engine.core.config import DTYPES
    from harness.engine.kvtransfer.transfer import PATH_FABRIC, KVLayout, KVReceiver, TransferStats

    sink = _BenchSink()
    receiver = KVReceiver(sink, TransferStats())
    receiver.listen(host, port, PATH_FABRIC)
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            layers, tokens, heads, dim, dtype = msg["layout"]
            sink.expect(msg["rid"], KVLayout(layers, tokens, heads, dim, DTYPES.get(dtype, torch.float32)))
            print(f"expecting {msg['rid']}", flush=True)
    finally:
        receiver.close()


def _send(transfer_json: str) -> None:
    import torch

    from harness.engine.core.config import DTYPES
    from harness.engine.kvtransfer.transfer import PATH_FABRIC, Endpoint, KVSender, TransferConfig, TransferStats

    config = TransferConfig.from_dict(json.loads(transfer_json))
    stats = TransferStats()
    cache: dict = {}
    print("ready", flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        layers, tokens, heads, dim, dtype = msg["layout"]
        key = tuple(msg["layout"])
        if key not in cache:
            cache.clear()
            gen = torch.Generator().manual_seed(tokens)
            cache[key] = torch.randn(layers, 2, tokens, heads, dim, generator=gen,
                                     dtype=DTYPES.get(dtype, torch.float32))  # kv: [layers, 2, T, H, D]
        kv = cache[key]
        sender = KVSender(msg["rid"], layers, Endpoint(msg["host"], msg["port"], PATH_FABRIC), None, config, stats)
        try:
            for layer in range(layers):
                sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
            result = sender.finish(first_token_id=0)
            print(json.dumps(asdict(result)), flush=True)
        except Exception as exc:  # reported to the driver, which raises ProbeError
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__name__}", description="KV transfer bench ends")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("receive")
    r.add_argument("host")
    r.add_argument("port", type=int)
    s = sub.add_parser("send")
    s.add_argument("transfer_json", help="TransferConfig fields as JSON")
    args = p.parse_args(argv)
    if args.cmd == "receive":
        _receive(args.host, args.port)
    else:
        _send(args.transfer_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
