"""``python -m harness schema``: print the cluster file's JSON Schema, or check cluster files with
the same function a run calls before it starts (:func:`harness.clusterfile.load.check_cluster`)."""

from __future__ import annotations

import argparse
import json
import sys

from harness.clusterfile.load import check_cluster, json_schema
from harness.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", nargs="+", metavar="CLUSTER",
                        help="validate these cluster files (names under ./clusters/, then the shipped examples, "
                             "or paths) as a run does before it starts, SSH key files included; every file is "
                             "checked, exit 3 when any is bad")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --check: check as `--dry-run` does (it contacts no host, so it needs no SSH "
                             "key or known_hosts file)")


def run(args: argparse.Namespace) -> int:
    if not args.check:
        return _print_schema()
    bad = 0
    for name in args.check:
        try:
            spec = check_cluster(name, dry_run=args.dry_run)
        except ConfigError as exc:
            bad += 1
            print(f"error: {exc}", file=sys.stderr)
            continue
        print(f"{spec.path}: ok ({spec.kind}, engine {spec.engine_name}, {len(spec.workers)} workers"
              f"{'; checked as a dry run: SSH key files not read' if args.dry_run and spec.hosts else ''})")
    if bad:
        print(f"{bad} of {len(args.check)} cluster file(s) bad", file=sys.stderr)
    return 3 if bad else 0


def _print_schema() -> int:
    """The schema on stdout; a reader that stops early (``| head``) ends it quietly."""
    try:
        json.dump(json_schema(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # the interpreter flushes stdout again at exit: point it at /dev/null so that flush is silent
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
