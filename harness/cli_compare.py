"""``python -m harness compare BASE CAND``: the candidate run against the baseline run, figure by
figure, on the checklist's ``regression:`` tolerances (harness/compare.py, docs/compare.md).

    python -m harness compare reports-baseline/latest reports-candidate/latest
    python -m harness compare base/results.json cand/results.json --json compare.json

Exit 0 every figure within tolerance, 1 a figure regressed, 2 none regressed but one is undecided,
3 an error (a folder without results.json, a run without 6.2 records, runs that are not comparable
without ``--force``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.checklists import Checklist, default_checklist
from harness.clusterfile.load import load_cluster
from harness.compare import compare_runs, load_run, render_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", help="the baseline run: a report folder (DIR/latest, DIR/<run id>) or its results.json")
    parser.add_argument("candidate", help="the candidate run, the same way")
    parser.add_argument("--checklist", type=Path, default=None,
                        help="checklist with the `regression:` tolerances (default: the shipped section6.yaml)")
    parser.add_argument("--cluster", default=None, metavar="NAME|PATH",
                        help="apply this cluster file's `regression:` overrides of alpha and tolerances (as a run "
                             "with --baseline on that cluster does)")
    parser.add_argument("--force", action="store_true",
                        help="compare runs that differ in cluster, load or thresholds (the differences are stated)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    checklist = Checklist.load(args.checklist) if args.checklist else default_checklist()
    if args.cluster is not None:   # its threshold overrides do not matter here, its tolerance overrides do
        checklist = load_cluster(args.cluster, checklist=checklist).checklist(checklist)
    comparison = compare_runs(load_run(args.baseline), load_run(args.candidate), checklist, force=args.force)
    print(render_text(comparison))
    if args.json is not None:
        args.json.write_text(json.dumps(comparison.to_dict(), indent=2) + "\n")
    return comparison.exit_code
