"""The live half of issue 33's acceptance: real runs on real clusters, each one recorded.

    .venv/bin/python bench/error_runs.py --aa 20                 # `pytest suites/` 20 times, default bundled cluster
    .venv/bin/python bench/error_runs.py --planted 10            # each planted defect 10 times, its own suite
    .venv/bin/python bench/error_runs.py --planted 3 --only local-no-ecc local-sabotaged
    .venv/bin/python bench/error_runs.py --tally                 # what the ledger holds, per commit

(`bench/bench_error_rates.py --aa N` / `--planted N` call this.) Each run is one
`pytest` subprocess under /tmp/heavy.lock (run these alone on the machine: the acceptance is for a
quiet machine), and appends one line to the ledger, bench/records/error_runs.jsonl (committed: the
acceptance's 20 + 80 runs take about 5 hours of a 2-core machine, more than one working session, so
they accumulate, each line naming its commit, time, machine and outcome). Nothing is kept from a run
but that line; the reports go to a temporary folder unless --keep.

A planted defect runs the suite that judges its item, not the whole main job (the sabotage is in the
cluster file; the other suites neither see it nor change it): 30-60 s a run instead of 5 minutes.
`--whole` runs `suites/` instead. The planted process leak runs the soak twice: 3 minutes (its growth
judged in a process that lives through it) and 11 minutes with the soak's own kills restarting the
leaking workers (growth judged per role across restarts): both must fail soak.leaks.

Pass (exit 0): A/A, no fail, no exit 1, 3 or 4, at most 2 inconclusive in 20 per item (n // 10);
planted, every run fails its item. --tally judges the ledger's runs by the same rules, saying how
many each commit holds (--commits to count only some), and lists every run worth a look.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "bench" / "records" / "error_runs.jsonl"
ORDER = ["pass", "inconclusive", "fail", "error"]

# cluster file -> (the item it must fail, the suite that judges it, extra options)
PLANTED: dict[str, tuple[str, list[str]]] = {
    "local-fabric-sabotaged": ("6.1.5", ["suites/test_item5_pfc_isolation.py"]),
    "local-no-degradation": ("6.1.3", ["suites/test_item3_degradation.py"]),
    "local-no-offload": ("6.1.3", ["suites/test_item3_degradation.py"]),
    "local-no-ecc": ("ecc", ["suites/test_ecc_poisoning.py"]),
    "local-no-migration": ("6.1.2", ["suites/test_item2_hot_migration.py"]),
    "local-sabotaged": ("6.1.4", ["suites/test_item4_reschedule.py"]),
    "local-leaky": ("soak.leaks", ["suites/test_soak.py", "--soak=3m"]),
    "local-leaky-process": ("soak.leaks", ["suites/test_soak.py", "--soak=3m"]),
    "local-leaky-process@11m": ("soak.leaks", ["suites/test_soak.py", "--soak=11m"]),
}


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/records"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "") if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def statuses_of(report_dir: Path) -> tuple[dict[str, str], list[str]]:
    """Each item's worst status over the run's results.json files (nothing-lost is recorded by several
    suites: as bad as its worst), and the items whose verdict the machine gate turned inconclusive."""
    statuses: dict[str, str] = {}
    gated: list[str] = []
    for results in sorted(report_dir.glob("**/results.json")):
        for v in json.loads(results.read_text())["verdicts"]:
            statuses[v["item"]] = max(statuses.get(v["item"], "pass"), v["status"], key=ORDER.index)
            if ((v.get("evidence") or {}).get("machine") or {}).get("gated"):
                gated.append(v["item"])
    return statuses, sorted(set(gated))


def reasons_of(report_dir: Path, limit: int = 300) -> dict[str, list[str]]:
    """Each verdict that did not pass, its reason as recorded (cut to ``limit`` characters), by item:
    the ledger then says why an A/A item went inconclusive after its report is gone."""
    reasons: dict[str, list[str]] = defaultdict(list)
    for results in sorted(report_dir.glob("**/results.json")):
        for v in json.loads(results.read_text())["verdicts"]:
            if v["status"] != "pass":
                reasons[v["item"]].append(f"{v['status']}: {str(v.get('reason') or '')[:limit]}")
    return dict(reasons)


def one_run(mode: str, cluster: str, args: list[str], keep: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="error-runs-") as tmp:
        report_dir = keep / f"{cluster}-{int(time.time())}" if keep else Path(tmp)
        cmd = ["flock", "/tmp/heavy.lock", sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-q",
               f"--cluster={cluster.split('@')[0]}", f"--report-dir={report_dir}"]
        started = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        statuses, gated = statuses_of(report_dir)
        reasons = reasons_of(report_dir)
    return {"mode": mode, "cluster": cluster, "args": args, "commit": commit(), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "started": round(started, 1), "seconds": round(time.time() - started, 1),
            "exit": proc.returncode, "statuses": statuses, "machine_gated": gated, "reasons": reasons,
            "tail": proc.stdout[-400:] if proc.returncode not in (0, 1, 2) else ""}


def record(line: dict[str, Any], ledger: Path) -> None:
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def read(ledger: Path) -> list[dict[str, Any]]:
    if not ledger.exists():
        return []
    return [json.loads(line) for line in ledger.read_text().splitlines() if line.strip()]


def judge_aa(runs: list[dict[str, Any]], want: int = 20) -> tuple[bool, list[str]]:
    """The A/A rule: no fail, no exit 1, 3 or 4, at most max(2, n // 10) inconclusive per item; and
    whether ``want`` runs were made (fewer is not a pass: it is not yet the acceptance)."""
    codes = Counter(r["exit"] for r in runs)
    per_item: dict[str, Counter] = defaultdict(Counter)
    for r in runs:
        for item, s in r["statuses"].items():
            per_item[item][s] += 1
    lines = [f"A/A: {len(runs)} run(s), exit codes {dict(sorted(codes.items()))}"]
    lines += [f"  {item:14} {dict(c)}" for item, c in sorted(per_item.items())]
    bad = bool(codes[1] or codes[3] or codes[4]) or any(
        c["fail"] or c["error"] or c["inconclusive"] > max(2, len(runs) // 10) for c in per_item.values())
    return not bad and len(runs) >= want, lines


def judge_planted(runs: list[dict[str, Any]], want: int = 10) -> tuple[bool, list[str]]:
    lines, ok = [], True
    for cluster, (item, _) in PLANTED.items():
        got = Counter(r["statuses"].get(item, "not judged") for r in runs if r["cluster"] == cluster)
        n = sum(got.values())
        ok = ok and n >= want and got["fail"] == n
        lines.append(f"  {cluster:24} expects {item} fail: {n} run(s) {dict(got)}")
    return ok, ["planted defects:"] + lines


def tally(ledger: Path, commits: list[str] | None = None, aa_want: int = 20, planted_want: int = 10) -> int:
    """Judge the ledger's runs (all, or those of ``commits``) by the acceptance's rules, with how many
    runs each commit holds: the runs accumulate over sessions and commits, and the reader sees which."""
    runs = [r for r in read(ledger) if not commits or r["commit"] in commits]
    by_commit = Counter(r["commit"] for r in runs)
    print(f"{ledger}: {len(runs)} run(s) counted; by commit {dict(by_commit)}; this checkout {commit()}")
    aa_ok, aa_lines = judge_aa([r for r in runs if r["mode"] == "aa"], aa_want)
    pl_ok, pl_lines = judge_planted([r for r in runs if r["mode"] == "planted"], planted_want)
    print("\n".join(aa_lines + pl_lines))
    for r in runs:
        if r["exit"] not in (0, 1, 2) or (r["mode"] == "planted" and r["statuses"].get(PLANTED[r["cluster"]][0]) != "fail"):
            print(f"  worth a look: {r['mode']} {r['cluster']} on {r['commit']} exit {r['exit']} {r['statuses']}")
        elif r["mode"] == "aa" and r.get("reasons"):   # an A/A item that did not pass, and why (runs since 9e53131)
            print(f"  A/A on {r['commit']} exit {r['exit']}: " +
                  "; ".join(f"{item} {' | '.join(rs)}" for item, rs in sorted(r["reasons"].items())))
    print(f"acceptance: A/A {'met' if aa_ok else 'not met'} ({aa_want} runs wanted), planted "
          f"{'met' if pl_ok else 'not met'} ({planted_want} runs of each wanted)")
    return 0 if aa_ok and pl_ok else 1


def run_aa(n: int, ledger: Path, keep: Path | None) -> int:
    runs = []
    for k in range(n):
        line = one_run("aa", "local", ["suites/"], keep)
        record(line, ledger)
        runs.append(line)
        print(f"A/A run {k + 1}/{n}: exit {line['exit']} in {line['seconds']:.0f} s {line['statuses']}"
              + (f" machine-gated {line['machine_gated']}" if line["machine_gated"] else ""), flush=True)
    ok, lines = judge_aa(runs, n)
    print("\n".join(lines))
    return 0 if ok else 1


def run_planted(n: int, ledger: Path, only: list[str], whole: bool, keep: Path | None) -> int:
    """Round by round (every cluster once, then again), so a run cut short leaves even counts."""
    runs = []
    for k in range(n):
        for cluster in only:
            item, args = PLANTED[cluster]
            line = one_run("planted", cluster, ["suites/", *args[1:]] if whole else args, keep)
            record(line, ledger)
            runs.append(line)
            print(f"round {k + 1}/{n} {cluster}: {item} {line['statuses'].get(item, 'not judged')} "
                  f"(exit {line['exit']}, {line['seconds']:.0f} s)", flush=True)
    ok, lines = judge_planted(runs, n)
    print("\n".join(line for line in lines if not line.endswith("0 run(s) {}")))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--aa", type=int, metavar="N", help="run pytest suites/ N times on the bundled cluster")
    p.add_argument("--planted", type=int, metavar="N", help="each planted defect N times")
    p.add_argument("--only", nargs="+", choices=sorted(PLANTED), default=list(PLANTED), help="these planted clusters")
    p.add_argument("--whole", action="store_true", help="planted: run suites/ (the main job), not the item's suite")
    p.add_argument("--tally", action="store_true", help="judge the ledger's runs by the acceptance's rules")
    p.add_argument("--commits", nargs="+", help="--tally: only the runs of these commits")
    p.add_argument("--ledger", type=Path, default=LEDGER)
    p.add_argument("--keep", type=Path, help="keep each run's report under this folder")
    a = p.parse_args(argv)
    if a.aa:
        return run_aa(a.aa, a.ledger, a.keep)
    if a.planted:
        return run_planted(a.planted, a.ledger, a.only, a.whole, a.keep)
    if a.tally:
        return tally(a.ledger, a.commits)
    p.error("one of --aa N, --planted N or --tally")
    return 2


if __name__ == "__main__":
    sys.exit(main())
