"""The rollout comparison's error rates and power on the bundled cluster (issue 36; docs/compare.md).

Runs the 6.2 suite (``pytest suites/test_62_slo.py``) on the bundled cluster as users run it, in
pairs: a baseline, the same cluster again (A/A: every "regressed" is a false regression), and a
candidate whose engine processes run two torch threads instead of one (``bundled.engine.num_threads:
2``, a real engine setting a release could change: on a 2-core machine shared by four workers the
threads spin-wait for each other; measured 2026-12-06, one pair, 20 s of load each: TTFT p50 13.3 ->
16.9 ms, p99 27.2 -> 41 ms, TPOT p50 1.70 -> 2.45 ms, all four called regressed by ``harness compare``,
lost requests within tolerance), each compared with the baseline by ``harness.compare`` as
``python -m harness compare`` does. (The knob before, ``max_prefill_tokens``, moved nothing measurable:
the prompts are too short to be chunked.) Then, for each figure, the smallest regression found with 80 % power at these run sizes:
the baseline runs' own samples resampled, one side scaled by a factor, judged the same way (the
resampling draws independent requests, so it knows nothing of the streams' dependence: the real
runs' power is at most this).

    .venv/bin/python bench/bench_compare.py --pairs 20      # the acceptance: ~40-80 min on 2 cores
    .venv/bin/python bench/bench_compare.py --quick         # 2 pairs, ~5 min, not recorded
    .venv/bin/python bench/bench_compare.py --tally         # every recorded pair with these settings

Each pair is appended, as it ends, to bench/records/compare_pairs.jsonl (committed): its settings,
commit and machine, both comparisons' figures, and the two baseline runs' TTFT/TPOT samples, so
pairs from several sessions add up to the acceptance's 20 and ``--tally`` prints the same tables
from them (``--commits`` to count only some; pairs of other settings are never mixed).

Prints one line per comparison (exit code and each figure's verdict), then per figure the A/A
false-regression count, the candidate's detections, and the power table. Nothing is timed:
the figures are error counts.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.checklists import default_checklist  # noqa: E402
from harness.compare import FIGURES, compare_figure, compare_runs, load_run  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from error_runs import commit, read, record  # noqa: E402  (the error-rate ledger's commit label and line I/O)

LEDGER = ROOT / "bench" / "records" / "compare_pairs.jsonl"

SHIFTS = (1.05, 1.10, 1.15, 1.20, 1.30, 1.50, 2.0)   # candidate / baseline factors tried for power


def cluster_file(folder: Path, threads: int | None) -> Path:
    """clusters/local.yaml as shipped, or with each engine process running ``threads`` torch threads,
    still named local (the same cluster, another build)."""
    data = yaml.safe_load((ROOT / "clusters" / "local.yaml").read_text())
    if threads is not None:
        data.setdefault("bundled", {}).setdefault("engine", {})["num_threads"] = threads
    path = folder / f"local-{threads or 'shipped'}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def one_run(folder: Path, cluster: Path, name: str, users: int, duration: float) -> Path:
    reports = folder / name
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pytest", "suites/test_62_slo.py", "-p", "no:cacheprovider", "-q",
                          f"--cluster={cluster}", f"--report-dir={reports}", "--live=off",
                          f"--load-users={users}", f"--load-duration={duration:g}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode not in (0, 1, 2):
        sys.exit(f"run {name} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")
    print(f"  run {name}: exit {out.returncode} in {time.monotonic() - t0:.0f} s", flush=True)
    return reports / "latest"


def power(base_runs: list, checklist, trials: int, seed: int) -> dict[str, dict[float, float]]:
    """Per figure and shift: the share of resampled comparisons called regressed."""
    rng = random.Random(seed)
    compared = [(i, f, t) for i, fs in checklist.regression.tolerances.items() for f, t in fs.items()
                if FIGURES[(i, f)][0] in base_runs[0].samples]   # the runs' figures (6.2 and its lost requests)
    alpha_each = checklist.regression.alpha / len(compared)
    # the percentiles' power (a share of lost requests is not a list of values to scale)
    wanted = [(i, f, t) for i, f, t in compared if isinstance(base_runs[0].samples[FIGURES[(i, f)][0]], list)]
    table: dict[str, dict[float, float]] = {}
    for item, fig, tol in wanted:
        kind = FIGURES[(item, fig)][0]
        table[fig] = {}
        for shift in SHIFTS:
            hits = 0
            for _ in range(trials):
                a, b = rng.sample(base_runs, 2) if len(base_runs) > 1 else (base_runs[0], base_runs[0])
                base = rng.choices(a.samples[kind], k=len(a.samples[kind]))
                cand = [x * shift for x in rng.choices(b.samples[kind], k=len(b.samples[kind]))]
                hits += compare_figure(item, fig, base, cand, tol, alpha_each).status == "regressed"
            table[fig][shift] = hits / trials
    return table


def figure_rows(c) -> list[dict]:
    """A comparison's figures as ledger rows: what --tally needs, no report folder."""
    return [{"figure": f.figure, "status": f.status, "ratio": None if f.ratio is None else round(f.ratio, 4),
             "lo": None if f.interval is None else f.interval.lo, "hi": None if f.interval is None else f.interval.hi}
            for f in c.figures]


def pair_line(k: int, settings: dict, base, same, aa, ab, started: float) -> dict:
    """One pair's ledger line: both comparisons' figures and the two baseline runs' 6.2 samples (ms,
    0.001 ms resolution) for the power table, with the commit and machine that ran it."""
    return {"commit": commit(), "host": socket.gethostname(), "cpus": os.cpu_count(), "started": round(started, 1),
            "seconds": round(time.time() - started, 1), "settings": settings, "pair": k,
            "aa_exit": aa.exit_code, "ab_exit": ab.exit_code, "aa": figure_rows(aa), "ab": figure_rows(ab),
            "base_samples": [{kind: [round(x, 3) for x in run.samples[kind]] for kind in ("ttft", "tpot")
                              if isinstance(run.samples.get(kind), list)} for run in (base, same)]}


def read_ledger(ledger: Path, settings: dict, commits: list[str] | None) -> list[dict]:
    """The ledger's pairs run with these settings (and of these commits, when named)."""
    return [x for x in read(ledger) if x["settings"] == settings and (not commits or x["commit"] in commits)]


def summarize(lines: list[dict], checklist, trials: int) -> None:
    """Per figure: A/A false regressions, A/B detections and the candidate's median ratio, then the
    power table from the pairs' baseline samples."""
    if not lines:
        print("no pairs recorded with these settings")
        return
    figs = [r["figure"] for r in lines[0]["aa"]]
    print(f"\nper figure over {len(lines)} pairs (alpha {checklist.regression.alpha:g} over the figures); "
          f"A/A exit 1 in {sum(x['aa_exit'] == 1 for x in lines)}, A/B exit 1 in {sum(x['ab_exit'] == 1 for x in lines)}")
    print(f"{'figure':<12} {'A/A regressed':>13} {'A/A within':>10} {'A/B regressed':>13} {'A/B ratio median':>16}")
    for fig in figs:
        a_f = [r for x in lines for r in x["aa"] if r["figure"] == fig]
        b_f = [r for x in lines for r in x["ab"] if r["figure"] == fig]
        ratios = sorted(r["ratio"] for r in b_f if r["ratio"] is not None)
        print(f"{fig:<12} {sum(r['status'] == 'regressed' for r in a_f):>13} "
              f"{sum(r['status'] in ('within tolerance', 'improved') for r in a_f):>10} "
              f"{sum(r['status'] == 'regressed' for r in b_f):>13} "
              f"{ratios[len(ratios) // 2] if ratios else float('nan'):>16.3f}")
    bases = [SimpleNamespace(samples=s) for x in lines for s in x["base_samples"] if s]
    table = power(bases, checklist, trials, seed=0)
    print(f"\npower: share called regressed, the baseline runs' samples resampled ({trials} a cell), one side x shift")
    print(f"{'figure':<12} " + " ".join(f"{s:>6g}x" for s in SHIFTS) + "  smallest at 80 %")
    for fig, row in table.items():
        smallest = next((s for s in SHIFTS if row[s] >= 0.8), None)
        print(f"{fig:<12} " + " ".join(f"{row[s]:>7.2f}" for s in SHIFTS) +
              f"  {'> %gx' % SHIFTS[-1] if smallest is None else '%gx' % smallest}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=20, help="baseline / A / B triples (default 20)")
    p.add_argument("--quick", action="store_true", help="2 pairs and 40 resamples a power cell, not recorded")
    p.add_argument("--threads", type=int, default=2,
                   help="the candidate's torch threads per engine process (bundled.engine.num_threads; shipped: 1)")
    p.add_argument("--users", type=int, default=4, help="closed-loop load users of every run (default 4)")
    p.add_argument("--duration", type=float, default=8.0, help="--load-duration of every run (default 8)")
    p.add_argument("--scratch", type=Path, default=None, help="keep the runs' reports here")
    p.add_argument("--ledger", type=Path, default=LEDGER, help=f"where each pair is appended (default {LEDGER})")
    p.add_argument("--tally", action="store_true",
                   help="run nothing: the ledger's pairs with these settings, their counts and the power table")
    p.add_argument("--commits", nargs="*", default=None, help="with --tally, count only these commits' pairs")
    args = p.parse_args(argv)
    pairs, trials = (2, 40) if args.quick else (args.pairs, 200)
    checklist = default_checklist()
    settings = {"users": args.users, "duration": args.duration, "threads": args.threads}
    if args.tally:
        lines = read_ledger(args.ledger, settings, args.commits)
        print(f"{args.ledger}: {len(lines)} pair(s) with {settings}; by commit "
              f"{dict(Counter(x['commit'] for x in lines))}; this checkout {commit()}")
        summarize(lines, checklist, trials)
        return 0
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="bench-compare-"))
    scratch.mkdir(parents=True, exist_ok=True)
    shipped, knob = cluster_file(scratch, None), cluster_file(scratch, args.threads)
    print(f"bench_compare: {pairs} pairs, 6.2 at {args.users} users for {args.duration:g} s a run; candidate "
          f"num_threads {args.threads}; reports in {scratch}" + ("" if args.quick else f"; each pair appended to {args.ledger}"))
    lines = []
    for k in range(1, pairs + 1):
        started = time.time()
        base = load_run(one_run(scratch, shipped, f"base-{k}", args.users, args.duration))
        same = load_run(one_run(scratch, shipped, f"same-{k}", args.users, args.duration))
        slow = load_run(one_run(scratch, knob, f"knob-{k}", args.users, args.duration))
        aa, ab = compare_runs(base, same, checklist), compare_runs(base, slow, checklist)
        for label, c in (("A/A", aa), ("A/B", ab)):
            print(f"pair {k} {label}: exit {c.exit_code}; " +
                  ", ".join(f"{f.figure} {f.status} {f.ratio and round(f.ratio, 3)}" for f in c.figures), flush=True)
        line = pair_line(k, settings, base, same, aa, ab, started)
        lines.append(line)
        if not args.quick:   # recorded as it ends: a session cut short keeps every pair it finished
            record(line, args.ledger)
    summarize(lines, checklist, trials)
    if not args.quick:
        print(f"\nall pairs recorded with these settings: bench/bench_compare.py --tally "
              f"--users {args.users} --duration {args.duration:g} --threads {args.threads}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
