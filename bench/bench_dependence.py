"""How dependent are the latency samples the verdicts count? (issue 33 item 3; docs/statistics.md
"Dependence")

Reads the per-request records of finished runs (``reports/<run>/artifacts/*/requests*.jsonl``),
takes each load run's client TTFT and TPOT in the order the harness's verdicts take them (the
records' order, as slo.client_samples does), and prints, per load run and metric: the samples,
the lag-1..3 autocorrelations of log latency, and the variance inflation tau with its effective
samples at the median and the p99 (harness/stats/dependence.py, the estimator the verdicts use).

    .venv/bin/python bench/bench_dependence.py reports/latest [more report folders or requests.jsonl ...]

Nothing is timed: the figures are properties of the recorded streams. A run with tau near 1
everywhere would justify the independent-draws intervals; the table in docs/statistics.md says
what the bundled engine, vLLM and Dynamo gave.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.checks.slo import client_samples  # noqa: E402
from harness.probes.client.records import read_records  # noqa: E402
from harness.stats.dependence import autocorrelations, percentile_dependence  # noqa: E402


def load_runs(paths: list[str]) -> list[Path]:
    """Every requests*.jsonl under the given report folders (or the files themselves)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(p.glob("**/requests*.jsonl")))
        else:
            raise SystemExit(f"bench_dependence: {p} is neither a report folder nor a requests.jsonl file "
                             "(pass e.g. reports/latest)")
    if not found:
        raise SystemExit("bench_dependence: no requests*.jsonl under the given paths (a run writes them to "
                         "reports/<run>/artifacts/<test>-load0/)")
    return found


def run_label(path: Path) -> str:
    """``CLUSTER: LOAD RUN`` from the report's results.json above the records (the folder alone when none)."""
    for parent in path.parents:
        results = parent / "results.json"
        if results.is_file():
            try:
                cluster = json.loads(results.read_text()).get("cluster") or {}
            except (OSError, ValueError):
                break
            name = cluster.get("name") if isinstance(cluster, dict) else None
            return f"{name or parent.name}: {path.parent.name}"
    return path.parent.name


def rows_of(path: Path) -> list[dict]:
    # in the order the verdicts take them: LoadRunner.records sorts by send time (the file is in
    # completion order)
    _, ttft, tpot = client_samples(sorted(read_records(path), key=lambda r: r.start_wall_ns()))
    out = []
    for metric, values in (("ttft", ttft), ("tpot", tpot)):
        x = np.asarray(values, dtype=float)
        if len(x) < 2:
            continue
        logs = np.log(np.maximum(x, 1e-6))
        rho = autocorrelations(logs, 3)
        row = {"run": run_label(path), "metric": metric, "n": len(x),
               "lag1": rho[1] if len(rho) > 1 else math.nan, "lag2": rho[2] if len(rho) > 2 else math.nan,
               "lag3": rho[3] if len(rho) > 3 else math.nan}
        for q in (50, 99):
            dep = percentile_dependence(x, q)
            row[f"tau{q}"] = dep.tau if dep.measured else math.nan
            row[f"neff{q}"] = dep.n_eff if dep.measured else None
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="report folders (searched for requests*.jsonl) or requests*.jsonl files")
    args = ap.parse_args(argv)
    runs = load_runs(args.paths)
    print("| load run | metric | n | log lag 1 / 2 / 3 | tau p50 (n_eff) | tau p99 (n_eff) |")
    print("|---|---|---|---|---|---|")
    for i, path in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {path}", file=sys.stderr)
        for r in rows_of(path):
            def tau(q: int) -> str:
                return "n < 100" if math.isnan(r[f"tau{q}"]) else f"{r[f'tau{q}']:.2f} ({r[f'neff{q}']})"
            print(f"| {r['run']} | {r['metric']} | {r['n']} | {r['lag1']:+.2f} / {r['lag2']:+.2f} / {r['lag3']:+.2f} "
                  f"| {tau(50)} | {tau(99)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
