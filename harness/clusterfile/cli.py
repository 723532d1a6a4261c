"""``python -m harness schema``: print the cluster file's JSON Schema (``--checklist``: the
checklist's), or check cluster files with the same function a run calls before it starts
(:func:`harness.clusterfile.load.check_cluster`); ``--check --checklist=PATH`` checks a checklist
file too, and the clusters' threshold overrides against it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from harness.checklists import DEFAULT_CHECKLIST, Checklist
from harness.checklists import json_schema as checklist_schema
from harness.clusterfile.load import check_cluster, json_schema
from harness.errors import ConfigError

_SHIPPED = "shipped"  # `--checklist` without a path: the checklist shipped in the package


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", nargs="*", metavar="CLUSTER",
                        help="validate these cluster files (names under ./clusters/, then the shipped examples, "
                             "or paths) as a run does before it starts, SSH key files included; every file is "
                             "checked, exit 3 when any is bad")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --check: check as `--dry-run` does (it contacts no host, so it needs no SSH "
                             "key or known_hosts file)")
    parser.add_argument("--checklist", nargs="?", const=_SHIPPED, default=None, metavar="PATH",
                        help="alone: print the checklist's JSON Schema instead of the cluster file's; with "
                             "--check: validate the checklist file PATH (default: the shipped one) and the "
                             "cluster files' threshold overrides against it")


def run(args: argparse.Namespace) -> int:
    if args.check is None:
        return _print_schema(checklist_schema() if args.checklist else json_schema())
    if not args.check and args.checklist is None:
        print("error: --check needs cluster files, --checklist[=PATH] or both", file=sys.stderr)
        return 3
    checklist: Checklist | None = None
    if args.checklist is not None:
        try:
            checklist = Checklist.load(DEFAULT_CHECKLIST if args.checklist == _SHIPPED else args.checklist)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            print("1 checklist file bad: cluster files not checked against it", file=sys.stderr)
            return 3
        count = sum(len(item.thresholds) for item in checklist.items.values())
        print(f"{checklist.path}: ok (checklist, {len(checklist.items)} items, {count} thresholds)")
    bad = 0
    for name in args.check:
        try:
            spec = check_cluster(name, dry_run=args.dry_run, checklist=checklist)
        except ConfigError as exc:
            bad += 1
            print(f"error: {exc}", file=sys.stderr)
            continue
        print(f"{spec.path}: ok ({spec.kind}, engine {spec.engine_name}, {len(spec.workers)} workers"
              f"{'; checked as a dry run: SSH key files not read' if args.dry_run and spec.hosts else ''})")
    if bad:
        print(f"{bad} of {len(args.check)} cluster file(s) bad", file=sys.stderr)
    return 3 if bad else 0


def _print_schema(schema: dict[str, Any]) -> int:
    """The schema on stdout; a reader that stops early (``| head``) ends it quietly."""
    try:
        json.dump(schema, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at /dev/null so that flush is silent
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
