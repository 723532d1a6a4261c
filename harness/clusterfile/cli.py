"""``python -m harness schema``: print the cluster file's JSON Schema, or check cluster files."""

from __future__ import annotations

import argparse
import json
import sys

from harness.clusterfile.load import json_schema, load_cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", nargs="+", metavar="CLUSTER",
                        help="validate these cluster files (names under clusters/ or paths) instead; "
                             "exit 3 naming file, field and fix on the first error")


def run(args: argparse.Namespace) -> int:
    if not args.check:
        json.dump(json_schema(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    for name in args.check:  # a ConfigError propagates: cli.main prints it and exits 3
        spec = load_cluster(name)
        print(f"{spec.path}: ok ({spec.kind}, engine {spec.engine_name}, {len(spec.workers)} workers)")
    return 0
