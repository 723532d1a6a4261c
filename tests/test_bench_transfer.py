"""bench/bench_transfer.py runs end to end: the KV transfer, both raw TCP baselines, checked bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_transfer_prints_a_row_per_size_with_its_ratios():
    out = subprocess.run([sys.executable, "bench/bench_transfer.py", "--preset", "tiny", "--sizes", "16,64",
                          "--repeats", "1", "--small-repeats", "2", "--no-mooncake"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["tokens"])
    assert lines[header].split() == ["tokens", "MiB", "n", "raw", "GB/s", "new", "GB/s", "KV", "GB/s", "KV/raw", "KV/new"]
    rows = [line.split() for line in lines[header + 1:]]
    assert [int(r[0]) for r in rows] == [16, 64] and [int(r[2]) for r in rows] == [2, 2]  # under 16 MiB
    for r in rows:
        raw, new, kv, kv_raw, kv_new = map(float, r[3:8])
        assert min(raw, new, kv, kv_raw, kv_new) > 0  # sizes this small say nothing of speed
