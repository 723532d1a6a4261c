"""``python -m harness revert``: revert every fault the ledger still holds (a harness killed with
SIGKILL, a revert that failed), then end what dead runs left running (a stopped worker holding its
ports, a router, Locust) and remove their fabric namespaces (harness.faults.runs). An entry whose
bundled cluster died with its run is closed ``target_gone``. Exit 0 when all are reverted (or none
was left), 4 when any revert fails: the cluster may be dirty."""

from __future__ import annotations

import argparse
import sys

from harness.errors import RevertError
from harness.faults.ledger import STATE_DIR_ENV, Ledger, LedgerStatus, state_dir
from harness.faults.runner import FaultRunner

EXIT_REVERT_FAILED = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", default=None,
                        help=f"directory holding the fault ledgers (default: ${STATE_DIR_ENV}, else ./state)")
    parser.add_argument("--cluster", default=None, help="only this cluster's ledger (default: every ledger)")
    parser.add_argument("--dry-run", action="store_true", help="print exactly what would be reverted; change nothing")
    parser.add_argument("--force", action="store_true",
                        help="also revert faults of a harness that is still running (it will lose track of them)")


def run(args: argparse.Namespace) -> int:
    from harness.faults.runs import clean_dead_runs, dead_runs

    directory = state_dir(args.state_dir).absolute()
    ledgers = [Ledger.for_cluster(args.cluster, directory)] if args.cluster else Ledger.all_in(directory)
    failed = 0
    total = 0
    cleaned = False
    for ledger in ledgers:
        outstanding = ledger.outstanding(include_live_owners=args.force)
        live = len(ledger.outstanding(include_live_owners=True)) - len(outstanding)
        if live:
            print(f"{ledger.path}: {live} fault(s) belong to a harness that is still running; "
                  "left to it (use --force to revert them anyway)")
        if not outstanding:
            continue
        total += len(outstanding)
        print(f"{ledger.path}: {'would revert' if args.dry_run else 'reverting'} {len(outstanding)} fault(s), "
              "newest first")
        runner = FaultRunner(ledger, dry_run=args.dry_run, recover_on_enter=False, handle_signals=False)
        try:
            cleaned = True  # recover() also ends dead runs' leftovers and removes their namespaces
            records = runner.recover(include_live_owners=args.force)
        except RevertError as exc:
            failed += 1
            print(f"error: {exc}", file=sys.stderr)
            records = runner.records
        for rec in records:
            print(f"  {rec.kind} {rec.target}: {rec.action.value} {rec.status.value}"
                  f"{': ' + rec.output if rec.output else ''}{' (' + rec.error + ')' if rec.error else ''}")
    if not cleaned and dead_runs(directory):
        total += 1
        problems = clean_dead_runs(directory, dry_run=args.dry_run, say=print)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        failed += bool(problems)
    if not total:
        print(f"nothing to revert in {directory}")
    if failed:
        still = sum(1 for lg in ledgers for e in lg.entries() if e["status"] == LedgerStatus.REVERT_FAILED.value)
        print(f"{still} fault(s) could not be reverted; the cluster may be dirty", file=sys.stderr)
        return EXIT_REVERT_FAILED
    return 0
