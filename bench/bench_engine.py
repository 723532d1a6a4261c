"""Reference-engine speed: prefill and decode tokens/s per preset and batch size, the engine's
decode against a plain dense torch loop on the same tokens (engine/dense), speculative decoding
on/off, paged vs dense attention (paged/dense). Every ratio is against a baseline measured in the
same run. ``--quick`` keeps it under a minute or so on two cores.

    .venv/bin/python bench/bench_engine.py --quick
"""

from __future__ import annotations

import argparse
import time

import torch

from harness.engine.core.config import EngineConfig, ModelConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.kv_cache import KVBlockPool, PagedAttention
from harness.engine.core.model import causal_attention, load_model
from harness.engine.core.types import GenerateRequest, SamplingParams


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [32 + (i * 7 + salt * 13) % 95 for i in range(n)]


def engine(preset: str, **kw) -> EngineCore:
    return EngineCore(EngineConfig(preset=preset, kv_budget_bytes=512 * 2**20, num_threads=1, **kw))


def bench_prefill(preset: str, length: int) -> float:
    eng = engine(preset, max_prefill_tokens=length)
    eng.add_request(GenerateRequest("warm", prompt(16), SamplingParams(max_tokens=1)))
    eng.run_to_completion()
    eng.add_request(GenerateRequest("p", prompt(length), SamplingParams(max_tokens=1)))
    start = time.perf_counter()
    eng.step()  # the whole prompt in one forward pass
    return length / (time.perf_counter() - start)


def bench_decode(preset: str, batch: int, steps: int, speculative: bool = False) -> tuple[float, float]:
    """Output tokens/s over ``steps`` decode steps of ``batch`` running greedy streams."""
    eng = engine(preset, speculative=speculative, max_batch=max(batch, 1))
    for i in range(batch):
        eng.add_request(GenerateRequest(f"r{i}", prompt(64, i), SamplingParams(max_tokens=10_000, ignore_eos=True)))
    eng.step()  # prefill all
    eng.step()
    produced = 0
    start = time.perf_counter()
    for _ in range(steps):
        produced += sum(len(e.token_ids) for e in eng.step())
    elapsed = time.perf_counter() - start
    return produced / elapsed, eng.stats().spec_acceptance_rate


class _DenseBatch:
    """AttentionBackend of the plain loop: one preallocated contiguous K/V per sequence."""

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int) -> None:
        self.kv = [torch.zeros(cfg.n_layers, 2, capacity, cfg.n_kv_heads, cfg.head_dim, dtype=cfg.torch_dtype)
                   for _ in range(batch)]
        self.segments: list[tuple[int, int]] = []  # per sequence (start, n), packed in order

    def attend(self, layer: int, q, k, v):
        out = torch.empty_like(q)
        t0 = 0
        for kv, (start, n) in zip(self.kv, self.segments):
            kv[layer, 0, start:start + n], kv[layer, 1, start:start + n] = k[t0:t0 + n], v[t0:t0 + n]
            out[t0:t0 + n] = causal_attention(q[t0:t0 + n], kv[layer, 0, :start + n], kv[layer, 1, :start + n],
                                              start)
            t0 += n
        return out


def bench_dense_decode(preset: str, batch: int, steps: int) -> float:
    """The same greedy decode as ``bench_decode`` as a plain loop: model.forward over dense caches,
    argmax, no scheduler, no block pool. Output tokens/s."""
    cfg = ModelConfig.from_name(preset)
    model = load_model(cfg)
    backend = _DenseBatch(cfg, batch, 64 + steps + 4)
    prompts = [prompt(64, i) for i in range(batch)]
    backend.segments = [(0, 64)] * batch
    hidden = model.forward(model.tensor([t for p in prompts for t in p]),
                           torch.arange(64).repeat(batch), backend)
    last = model.logits(hidden[63::64]).argmax(-1)                       # [B]
    pos = 64
    backend.segments = [(pos, 1)] * batch
    last = model.logits(model.forward(last, torch.full((batch,), pos), backend)).argmax(-1)
    start = time.perf_counter()
    for _ in range(steps):
        pos += 1
        backend.segments = [(pos, 1)] * batch
        last = model.logits(model.forward(last, torch.full((batch,), pos), backend)).argmax(-1)
    return batch * steps / (time.perf_counter() - start)


def bench_attention(preset: str, batch: int, context: int, repeats: int) -> tuple[float, float]:
    """Seconds per decode-step attention of one layer: paged (the engine's backend) vs dense."""
    cfg = ModelConfig.from_name(preset)
    block_size = 16
    nb = -(-context // block_size)
    pool = KVBlockPool(batch * nb, cfg.n_layers, cfg.n_kv_heads, block_size, cfg.head_dim, cfg.torch_dtype)
    pool.storage.normal_()
    tables = [pool.allocate(nb) for _ in range(batch)]
    q = torch.randn(batch, cfg.n_heads, cfg.head_dim, dtype=cfg.torch_dtype)         # [B, H, hd]
    k = torch.randn(batch, cfg.n_kv_heads, cfg.head_dim, dtype=cfg.torch_dtype)      # [B, KVH, hd]
    dense = [pool.gather(0, t, context) for t in tables]  # contiguous copies: [context, KVH, hd]
    backend = PagedAttention(pool, [(t, context - 1, 1) for t in tables])

    def paged() -> None:
        backend.attend(0, q, k, k)

    def contiguous() -> None:
        for b, (ck, cv) in enumerate(dense):
            causal_attention(q[b:b + 1], ck, cv, context - 1)

    timings = []
    for fn in (paged, contiguous):
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        timings.append((time.perf_counter() - start) / repeats)
    return timings[0], timings[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, fewer sizes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    presets = ["tiny", "small", "medium"]

    rows = []
    for preset in presets:
        lengths = {"tiny": [128, 512], "small": [128, 512], "medium": [512] if quick else [512, 2048]}[preset]
        for length in lengths:
            rows.append([preset, length, f"{bench_prefill(preset, length):,.0f}"])
    table("Prefill (one request, whole prompt in one step)", ["preset", "prompt tokens", "tokens/s"], rows)

    rows = []
    steps = 8 if quick else 30
    for preset in presets:
        batches = [1, 12] if quick else [1, 4, 12, 32]
        base = None
        for batch in batches:
            rate, _ = bench_decode(preset, batch, steps)
            dense = bench_dense_decode(preset, batch, steps)
            base = base or rate
            rows.append([preset, batch, f"{rate:,.0f}", f"{rate / batch:,.1f}", f"{rate / base:.2f}x",
                         f"{dense:,.0f}", f"{rate / dense:.2f}"])
    table(f"Decode ({steps} steps after prefill, greedy); dense = a plain torch loop on the same tokens",
          ["preset", "batch", "tokens/s", "per stream", "vs batch 1", "dense tok/s", "engine/dense"], rows)

    rows = []
    for preset in presets:
        for batch in (1, 8):
            off, _ = bench_decode(preset, batch, steps)
            on, acceptance = bench_decode(preset, batch, steps, speculative=True)
            rows.append([preset, batch, f"{off:,.0f}", f"{on:,.0f}", f"{on / off:.2f}x", f"{acceptance:.0%}"])
    table("Speculative decoding (draft = first layer, 3 draft tokens), same greedy tokens",
          ["preset", "batch", "off tok/s", "on tok/s", "on/off", "acceptance"], rows)

    rows = []
    repeats = 20 if quick else 100
    for preset in ("tiny", "medium"):
        for batch, context in ((1, 512), (12, 512), (12, 2048)):
            paged, dense = bench_attention(preset, batch, context, repeats)
            rows.append([preset, batch, context, f"{paged * 1e3:.2f}", f"{dense * 1e3:.2f}", f"{paged / dense:.2f}x"])
    table("Attention, one layer, one decode step: paged (the engine's backend) vs dense (contiguous)",
          ["preset", "batch", "context", "paged ms", "dense ms", "paged/dense"], rows)


if __name__ == "__main__":
    main()
