"""Seed Section 4.2's table on the bundled engine: speculative decoding ON vs OFF.

Rows: KV bytes one request holds at its peak, single-request decode speed (tokens/s; the
speed-up is ON/OFF), and the most requests that run together without a preemption under a fixed KV budget. Every
number is measured in this run; ratios are against the OFF column. The draft here is the
target's first layer and shares the target's KV blocks (spec_decode.py), so the extra KV of ON
is only the lookahead reservation, not a second model's cache as in the article's Eagle3 setup.

    .venv/bin/python bench/bench_speculative_table.py [--preset tiny] [--quick]
"""

from __future__ import annotations

import argparse

import torch

from bench_engine import bench_decode, prompt, table
from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.types import GenerateRequest, SamplingParams

PROMPT_TOKENS, MAX_TOKENS = 64, 64


def requests(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(f"r{i}", prompt(PROMPT_TOKENS, i), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
            for i in range(n)]


def peak_kv_per_request(preset: str, speculative: bool) -> int:
    """Bytes of KV blocks one request holds at its peak (alone in the engine)."""
    eng = EngineCore(EngineConfig(preset=preset, speculative=speculative, num_threads=1))
    eng.add_request(requests(1)[0])
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.pool.num_used)
    return peak * eng.pool.block_bytes


def preemptions(preset: str, speculative: bool, budget_blocks: int, n: int) -> int:
    """Run n requests at once under a fixed KV budget; how often KV ran short (recompute)."""
    cfg = EngineConfig(preset=preset, num_threads=1)
    eng = EngineCore(EngineConfig(preset=preset, speculative=speculative, num_threads=1, max_batch=n,
                                  kv_budget_bytes=budget_blocks * cfg.block_bytes))
    for r in requests(n):
        eng.add_request(r)
    eng.run_to_completion()
    return eng.scheduler.preemptions_total


def max_concurrency(preset: str, speculative: bool, budget_blocks: int, most: int) -> int:
    """The most requests that run together to completion without any preemption (bisection)."""
    lo, hi = 0, most  # lo fits, hi + 1 does not (or is past the search range)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if preemptions(preset, speculative, budget_blocks, mid) == 0:
            lo = mid
        else:
            hi = mid - 1
    return lo


def table_args(doc: str) -> argparse.Namespace:
    """--preset and --quick of the seed-table benchmarks; one torch thread, like a worker."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    torch.set_num_threads(1)
    return parser.parse_args()


def main() -> None:
    args = table_args(__doc__)
    steps = 10 if args.quick else 40
    budget = 96  # blocks: (64 + 64) tokens = 8 blocks per request, about 12 requests
    kv = {on: peak_kv_per_request(args.preset, on) for on in (True, False)}
    speed = {on: bench_decode(args.preset, 1, steps, speculative=on)[0] for on in (True, False)}
    conc = {on: max_concurrency(args.preset, on, budget, 24) for on in (True, False)}
    rows = [["KV per request (peak)", f"{kv[True] / 1024:.0f} KiB", f"{kv[False] / 1024:.0f} KiB",
             f"{kv[False] / kv[True] - 1:+.0%}"],
            ["single-request decode", f"{speed[True]:.0f} tok/s", f"{speed[False]:.0f} tok/s",
             f"speed-up ON {speed[True] / speed[False]:.2f}x"],
            [f"max concurrency, no preemption ({budget} blocks)", str(conc[True]), str(conc[False]),
             f"{conc[False] / conc[True] - 1:+.0%}"]]
    table(f"Section 4.2 shape, preset {args.preset}: speculative decoding ON vs OFF (OFF relative to ON)",
          ["metric", "spec ON", "spec OFF", "OFF vs ON"], rows)


if __name__ == "__main__":
    main()
