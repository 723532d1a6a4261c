"""KV frames landing straight in an import's reserved blocks (kvtransfer/landing.py), over real sockets
into a real engine's block pool."""

from __future__ import annotations

import threading

import torch

from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.kvtransfer.landing import ImportLanding
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.kvtransfer.transfer import (PATH_FABRIC, Endpoint, KVLayout, KVReceiver, KVSender, TransferConfig,
                                     TransferStats)

TOKENS = 37  # not a multiple of the block size: the last block is partly filled


class LandingSink:
    """A decode worker's sink reduced to its imports: frames land in the blocks, never in a buffer."""

    def __init__(self) -> None:
        self.core = EngineCore(EngineConfig(preset="tiny", kv_budget_bytes=4 << 20))
        self.engine_cmds: list = []
        self.landing = ImportLanding(self.core, self.engine_cmds.append)
        self.handles = {}
        self.buffered = 0
        self.done = threading.Event()

    def expect(self, rid: str):
        req = GenerateRequest(rid, [65] * TOKENS, SamplingParams(max_tokens=4))
        handle = self.handles[rid] = self.core.begin_import(req, TOKENS)
        self.landing.register(rid, handle)
        return handle

    def kv_layout(self, rid):
        m = self.core.model_config
        return KVLayout(m.n_layers, TOKENS, m.n_kv_heads, m.head_dim, m.torch_dtype) if rid in self.handles else None

    def kv_recv_into(self, rid, layer_start, layer_end, nbytes):
        return self.landing.take(rid, layer_start, layer_end, nbytes)

    def kv_write(self, rid, layer_start, kv, release):
        self.buffered += 1
        release()

    def kv_complete(self, rid, first_token_id):
        self.landing.wait_idle(rid)
        self.done.set()


def kv_of(core: EngineCore) -> torch.Tensor:
    m = core.model_config
    g = torch.Generator().manual_seed(3)
    return torch.randn(m.n_layers, 2, TOKENS, m.n_kv_heads, m.head_dim, generator=g, dtype=torch.float64)


def test_frames_land_in_the_blocks_and_a_corrupt_one_is_resent_over_it():
    sink, stats = LandingSink(), TransferStats()
    rx = KVReceiver(sink, stats, timeout_s=5)
    try:
        endpoint = Endpoint(*rx.listen("127.0.0.1", 0, PATH_FABRIC), PATH_FABRIC)
        handle = sink.expect("r1")
        kv = kv_of(sink.core)
        sender = KVSender("r1", kv.shape[0], endpoint, None, TransferConfig(), TransferStats(), corrupt_frames=1)
        for layer in range(kv.shape[0]):
            sender.send_layer(layer, kv[layer, 0], kv[layer, 1])
        result = sender.finish(7)
        assert sink.done.is_set() and result.retries >= 1  # the damaged frame was refused, then resent
        assert stats.snapshot()["rejected"] == {"crc": 1} and sink.buffered == 0
        assert handle.layers_written == set(range(kv.shape[0]))
        for layer in range(kv.shape[0]):
            k, v = sink.core.pool.gather(layer, handle.blocks, TOKENS)
            assert torch.equal(k, kv[layer, 0]) and torch.equal(v, kv[layer, 1])
    finally:
        rx.close()


def test_an_import_cancelled_while_a_frame_lands_is_freed_only_when_the_landing_ends():
    sink = LandingSink()
    pool = sink.core.pool
    handle = sink.expect("r2")
    free_before = pool.num_free
    views, done = sink.landing.take("r2", 0, 1, _layer_bytes(sink))  # a frame of layer 0 starts landing
    assert not sink.landing.release("r2", handle)  # the engine aborts the import mid-frame
    assert pool.num_free == free_before and sink.landing.take("r2", 1, 2, _layer_bytes(sink)) is None
    done(False)  # the frame ends (here: it failed its checksum)
    assert len(sink.engine_cmds) == 1 and pool.num_free == free_before
    sink.engine_cmds.pop()()  # the engine thread runs the deferred cancel
    assert pool.num_free == free_before + pool.blocks_for(TOKENS + 1)


def _layer_bytes(sink: LandingSink) -> int:
    m = sink.core.model_config
    return 2 * TOKENS * m.n_kv_heads * m.head_dim * 8


def test_views_worked_out_while_the_import_is_released_are_not_kept_for_it():
    sink = LandingSink()
    handle = sink.expect("r3")
    handle.resize(TOKENS - 5)  # live migration: the views of the registered size no longer fit
    work_out = sink.landing._all_views

    def released_meanwhile(h):
        views = work_out(h)
        assert not sink.landing.release("r3", h)  # pinned by the take in progress: freed when it ends
        return views

    sink.landing._all_views = released_meanwhile
    views, done = sink.landing.take("r3", 0, 1, 2 * (TOKENS - 5) * 2 * 16 * 8)
    assert len(views) and "r3" not in sink.landing._views  # nothing left behind for a released import
    done(False)
