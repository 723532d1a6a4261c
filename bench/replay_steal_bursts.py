"""6.2 judged again on kept main-job reports, with and without leaving out the requests timed in VM
steal bursts (docs/load-and-metrics.md, "Steal in bursts").

    .venv/bin/python bench/replay_steal_bursts.py /tmp/aa-keep/*/2*/results.json
    .venv/bin/python bench/replay_steal_bursts.py --limit 20 REPORT/results.json ...

For each report: the 6.2 suite's request records (its ``links``), and the run's machine series
(``results.json`` ``machine.samples``: the sampler's 0.5 s samples merged into at most 300 buckets, so
each bucket is 0.5-2 s and a span's edges are that coarse). The spans over ``--limit`` % steal (any 5 s,
MachineMonitor.steal_spans) are rebuilt from the series, and both 6.2 verdicts are judged on all the
requests and on those outside the spans, at the error-spending share of the look the run ended on
(its ``extension.looks``). Prints one block per report and a count: how many undecided verdicts the
rule decides, and how many decided ones it changes (a pass that turned into anything else is a
regression of the rule). Reads files only; starts nothing. Exit 0.

The bucketed series is not the gate's own input (the live run uses every 0.5 s sample), so a replayed
span can differ by a bucket from what the run would have left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.checklists import Checklist  # noqa: E402
from harness.checks.machine import LIMITS  # noqa: E402
from harness.checks.slo import slo_verdicts  # noqa: E402
from harness.probes.client.records import read_records  # noqa: E402
from harness.probes.machine_health.machine import GROUPS, Sample, steal_spans  # noqa: E402
from harness.stats import levels  # noqa: E402


def series_samples(points: list[dict]) -> list[Sample]:
    """The report's machine buckets as Samples carrying only what steal_spans reads."""
    zero = {g: 0.0 for g in GROUPS}
    out = []
    for a, b in zip(points, points[1:]):
        dt = b["t"] - a["t"]
        if b.get("steal_pct") is None or dt <= 0:
            continue
        out.append(Sample(t=b["t"], dt=dt, lag_ms=0.0, load1=None, runnable=None, psi_some_us=None,
                          psi_full_us=None, psi_some_avg10=None, steal_s=b["steal_pct"] / 100 * dt, cpu_s=zero,
                          ran_s=zero, wait_s=zero, runs={g: 0 for g in GROUPS}, processes={}, engine_wait=()))
    return out


def replay(results: Path, limit: float, checklist: Checklist) -> list[tuple[str, str, str]] | None:
    data = json.loads(results.read_text())
    tpot = next((v for v in data.get("verdicts", []) if v["item"] == "6.2.tpot"), None)
    if tpot is None or not tpot["evidence"].get("links"):
        print(f"{results}: no 6.2 run with its request records: skipped")
        return None
    records = [r for link in tpot["evidence"]["links"] for r in read_records(results.parent / link)]
    machine = data["machine"]
    # steal_pct is of all CPUs: series_samples keeps it per CPU, so steal_spans gets cpus=1
    begin = min(r.start_wall_ns() for r in records) / 1e9
    spans = steal_spans([s for s in series_samples(machine["samples"]) if s.t >= begin - 10], 1, limit)
    looks = (tpot["evidence"].get("extension") or {}).get("looks", 1)
    with levels.spending(look=looks, looks=levels.LOOKS):
        before = slo_verdicts(records, checklist)
        after = slo_verdicts(records, checklist, steal_bursts=spans)
    print(f"{results.parent.name}: {len(records)} requests, look {looks}, spans "
          f"{[(round(a - begin), round(b - begin)) for a, b in spans]} s from the first request")
    rows = []
    for old, new in zip(before, after):
        print(f"  {old.item}: {old.status.value} -> {new.status.value}: {new.reason[:240]}")
        rows.append((old.item, old.status.value, new.status.value))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of main-job reports")
    parser.add_argument("--limit", type=float, default=LIMITS.steal_leave_out_pct,
                        help="steal %% over 5 s that leaves requests out (default: the gate's steal_leave_out_pct)")
    args = parser.parse_args(argv)
    checklist = Checklist.load()
    rows = [row for path in args.results for row in (replay(path, args.limit, checklist) or [])]
    undecided = [r for r in rows if r[1] == "inconclusive"]
    decided = [r for r in rows if r[1] != "inconclusive"]
    print(f"\nat {args.limit:g} %: {sum(r[2] != 'inconclusive' for r in undecided)} of {len(undecided)} undecided "
          f"verdicts decided ({sum(r[2] == 'pass' for r in undecided)} pass); {sum(r[1] != r[2] for r in decided)} "
          f"of {len(decided)} decided verdicts changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
