"""bench/bench_dependence.py as run (a real subprocess) on two recorded-shape load runs written
with the harness's own record writer: 300 requests whose 12 slow ones come in one burst, and the
same requests with the slow ones spread out. The bench must find the burst's p99 dependent (tau
> 2) and the spread one not (tau < 1.5), label each with its cluster, and refuse a path that holds
no records with a message naming the fix.
Planted defect it catches: the bench losing the records' order (samples shuffled, or taken per
worker): the burst's tau falls to about 1 and the burst goes unseen."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.probes.client.records import write_records
from tests.checks.test_slo import rec

ROOT = Path(__file__).resolve().parents[1]


def _report(folder: Path, slow_at) -> Path:
    load = folder / "artifacts" / "test_x-load0"
    load.mkdir(parents=True)
    write_records(load / "requests.jsonl", [rec(i, ttft_ms=400 + i if slow_at(i) else 50, tpot_ms=5) for i in range(300)])
    (folder / "results.json").write_text(json.dumps({"cluster": {"name": "local"}}))
    return folder


def test_the_bench_finds_a_burst_dependent_and_a_spread_tail_not(tmp_path):
    burst = _report(tmp_path / "burst", lambda i: 140 <= i < 152)
    spread = _report(tmp_path / "spread", lambda i: i % 25 == 24)
    out = subprocess.run([sys.executable, "bench/bench_dependence.py", str(burst), str(spread)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| local: test_x-load0")]
    assert len(rows) == 4, out.stdout   # TTFT and TPOT of each run
    ttft = [[c.strip() for c in row.split("|")] for row in rows if "| ttft |" in row]
    tau_burst, tau_spread = (float(cells[6].split()[0]) for cells in ttft)   # the p99 column: "tau (n_eff)"
    assert tau_burst > 2 and tau_spread < 1.5, out.stdout

    empty = subprocess.run([sys.executable, "bench/bench_dependence.py", str(tmp_path / "none")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode != 0 and "neither a report folder nor a requests.jsonl" in empty.stderr
