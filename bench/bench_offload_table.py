"""Seed Section 4.3's table on the bundled engine: offload share against TPOT overhead and
concurrency gain.

A fixed HBM tier (the block pool) holds C0 requests at the 0 % row (offload off). Row s offers
C0 / (1 - s) requests at once with offload on (threshold 0.85, CPU tier): the share of KV that
actually sat in the CPU/NVMe tiers is measured per step and reported next to the nominal one.
TPOT is each request's (last token - first token) / (tokens - 1), averaged; its overhead and the
concurrency gain (peak requests holding KV, resident or offloaded) are against the 0 % row of the
same run.

    .venv/bin/python bench/bench_offload_table.py [--preset tiny] [--quick]
"""

from __future__ import annotations

import time

from bench_engine import prompt, table
from bench_speculative_table import table_args
from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.types import GenerateRequest, SamplingParams

PROMPT_TOKENS, MAX_TOKENS = 40, 24   # 64 tokens = 4 blocks of 16 per request


def run(preset: str, budget_blocks: int, n: int, offload: bool) -> dict:
    block_bytes = EngineConfig(preset=preset).block_bytes
    eng = EngineCore(EngineConfig(preset=preset, num_threads=1, max_batch=n, offload=offload,
                                  kv_budget_bytes=budget_blocks * block_bytes))
    for i in range(n):
        eng.add_request(GenerateRequest(f"r{i}", prompt(PROMPT_TOKENS, i),
                                        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)))
    times: dict[str, list[float]] = {}
    shares, peak = [], 0
    while eng.has_work():
        events = eng.step()
        now = time.perf_counter()
        for ev in events:
            times.setdefault(ev.request_id, []).extend([now] * len(ev.token_ids))
        tiers = eng.offload_stats()["offload"]
        lower = tiers["cpu"] + tiers["nvme"]
        resident = sum(len(s.block_table) for s in eng.scheduler.running) * block_bytes
        if lower + resident:
            shares.append(lower / (lower + resident))
        peak = max(peak, len(eng.scheduler.running) + len(eng.offload.swapped))
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {"tpot_ms": 1e3 * sum(tpots) / len(tpots), "share": sum(shares) / len(shares), "peak": peak,
            "preempt": eng.scheduler.preemptions_total, "fetch_ms": 1e3 * eng.offload_stats()["offload_fetch_s"],
            "offloads": eng.offload_stats()["offloads_total"]}


def main() -> None:
    args = table_args(__doc__)
    budget = 40 if args.quick else 80          # blocks in the HBM tier
    c0 = budget // 4                           # 4 blocks per request
    base = run(args.preset, budget, c0, offload=False)
    rows = [["0%", f"{base['share']:.0%}", c0, f"{base['tpot_ms']:.2f}", "+0%", "1.0x", base["preempt"], 0, "-"]]
    for nominal in (0.25, 0.50, 0.70):
        n = round(c0 / (1 - nominal))
        r = run(args.preset, budget, n, offload=True)
        rows.append([f"{nominal:.0%}", f"{r['share']:.0%}", n, f"{r['tpot_ms']:.2f}",
                     f"{r['tpot_ms'] / base['tpot_ms'] - 1:+.0%}", f"{r['peak'] / base['peak']:.1f}x",
                     r["preempt"], r["offloads"], f"{r['fetch_ms']:.2f}"])
    table(f"Section 4.3 shape, preset {args.preset}, HBM tier {budget} blocks: offload share vs TPOT and concurrency",
          ["offload (nominal)", "measured share", "requests", "TPOT ms", "TPOT overhead", "concurrency gain",
           "preemptions", "offloads", "fetch ms"], rows)


if __name__ == "__main__":
    main()
