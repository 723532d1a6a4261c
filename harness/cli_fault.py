"""``python -m harness fault``: fan one fault kind out over targets a selector picks from the
cluster file's inventory, hold it, revert every target (harness/faults/fanout.py, docs/faults.md
"Faults fanned out").

    python -m harness fault --cluster dynamo-many --kind process_kill --select percent:25 --role aggregated --dry-run
    python -m harness fault --cluster dynamo-many --kind process_kill --select percent:25 --hold 10

``--dry-run`` prints the resolved targets, the blast-radius check and how each target would be hit
and brought back, and contacts nothing. Exit 0 when every target was injected, verified, reverted
and its revert verified; 3 when the fan-out was refused or a target failed (the others were
reverted); 4 when a revert failed (the cluster may be dirty: ``python -m harness revert``).
"""

from __future__ import annotations

import argparse
import sys
import time

from harness.errors import ConfigError, RevertError
from harness.faults.cli import EXIT_REVERT_FAILED
from harness.faults.fanout import FANOUT_KINDS, MAX_PARALLEL, MAX_PER_HOST, fan_out, plan_fanout, revert_fanout
from harness.faults.ledger import STATE_DIR_ENV
from harness.faults.selectors import SYNTAX, Selector


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, help="cluster file (name under clusters/ or a path)")
    parser.add_argument("--kind", required=True, choices=FANOUT_KINDS, help="the fault every target gets")
    parser.add_argument("--select", default="one", help=f"how many of the matching targets: {SYNTAX} (default one)")
    for label in ("role", "host", "rack", "name"):
        parser.add_argument(f"--{label}", action="append", default=[],
                            help=f"only targets with this {label}" + (" (shell pattern, e.g. 'mocker-0*')"
                                                                      if label == "name" else "") + "; repeatable")
    parser.add_argument("--seed", type=int, default=0, help="which targets a sampling selector picks (default 0)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds the faults are held (default 10)")
    parser.add_argument("--max-parallel", type=int, default=MAX_PARALLEL,
                        help=f"targets handled at once (default {MAX_PARALLEL})")
    parser.add_argument("--max-per-host", type=int, default=MAX_PER_HOST,
                        help=f"targets handled at once on one host (default {MAX_PER_HOST}; sshd allows 10 sessions)")
    parser.add_argument("--state-dir", default=None,
                        help=f"where the ledger and audit log live (default: ${STATE_DIR_ENV}, else ./state)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved targets and the plan; contact nothing")


def run(args: argparse.Namespace) -> int:
    from harness.cluster import ClusterHandle
    from harness.clusterfile import load_cluster
    from harness.fixtures import make_fault_runner

    if args.hold < 0 or args.max_parallel < 1:
        raise ConfigError(f"--hold must be >= 0 and --max-parallel >= 1 (got {args.hold}, {args.max_parallel})",
                          fix="pass e.g. --hold 10 --max-parallel 16")
    spec = load_cluster(args.cluster)
    if spec.kind != "external" or spec.endpoints is None:
        raise ConfigError(f"cluster {spec.name!r} is {spec.kind}: its workers are started by a run, not listed in "
                          "its file", fix="fan out over a bundled cluster from a scenario (harness.faults.fanout "
                                          "with candidates_from_workers), or use an external cluster file")
    selector = Selector.parse(args.select, roles=args.role, hosts=args.host, racks=args.rack, names=args.name)
    cluster = ClusterHandle(spec, spec.checklist(), spec.endpoints.api, spec.endpoints.metrics, spec.endpoints.admin,
                            dry_run=args.dry_run)
    plan = plan_fanout(cluster, args.kind, selector, seed=args.seed, dry_run=args.dry_run)
    prefix = "[dry-run] " if args.dry_run else ""
    for line in plan.lines():
        print(prefix + line, flush=True)
    if plan.refused:
        print(f"{prefix}a real run would be refused: nothing would be touched", file=sys.stderr)
        return 3
    if args.dry_run:
        print(f"{prefix}would hold {args.hold:g} s, then revert all {len(plan.targets)} target(s) in parallel "
              f"(max {args.max_parallel} at once, {args.max_per_host} per host)")
        return 0
    runner = make_fault_runner(cluster, state_dir=args.state_dir, out=sys.stdout)
    try:
        with runner:  # whatever is still active when this block ends is reverted, however it ends
            fan = fan_out(runner, cluster, plan, max_parallel=args.max_parallel, max_per_host=args.max_per_host)
            print(f"injected and verified {args.kind} on {len(fan.faults)} target(s) in {fan.inject_s:.2f} s; "
                  f"holding {args.hold:g} s", flush=True)
            time.sleep(args.hold)  # the fault is held this long: what the cluster must cope with
            revert_fanout(runner, fan, max_parallel=args.max_parallel)
            print(f"reverted and verified {len(fan.faults)} target(s) in {fan.revert_s:.2f} s")
    except RevertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_REVERT_FAILED
    return 0
