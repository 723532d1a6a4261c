"""``python -m harness``: subcommands are modules that expose ``add_arguments(parser)``
and ``run(args) -> int`` (or ``PASS_THROUGH = True`` and ``main(argv) -> int``: the arguments are
handed on unparsed, ``harness run``'s to pytest). Register a new subcommand in ``SUBCOMMANDS``; its module is
imported only when the subcommand runs, so a heavy import (torch) never slows ``--help``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from harness import __version__
from harness.errors import HarnessError

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("harness.cli_run", "run the shipped conformance suites (pytest's options pass through: --cluster, ...)"),
    "serve": ("harness.engine.serving.server", "serve the single-process reference engine (OpenAI-compatible API)"),
    "up": ("harness.engine.pd.topology", "start a PD topology: router + prefill and decode worker processes"),
    "presets": ("harness.engine.core.config", "list model presets with their KV bytes per token"),
    "revert": ("harness.faults.cli", "revert every fault still recorded in the fault ledger"),
    "fault": ("harness.cli_fault", "fan one fault out over targets a selector picks (--select percent:25), hold, revert"),
    "load": ("harness.probes.loadgen.cli", "drive Locust load against an OpenAI-compatible server and summarise latency"),
    "fabric": ("harness.fabric.cli", "the emulated fabric: status, remove a dead run's leftovers, measure"),
    "schema": ("harness.clusterfile.cli", "print the cluster file's (--checklist: the checklist's) JSON Schema, or --check files"),
    "sshd-test": ("harness.cli_hosts", "test sshd(s) in the emulated fabric's namespaces (or on loopback): up|down"),
    "gpu-fill": ("harness.cli_hosts", "hold N GiB (or a fraction) of a CUDA device's memory until killed"),
    "compare": ("harness.cli_compare", "a candidate run against a baseline run: regressed, within tolerance or undecided"),
    "history": ("harness.history", "every run under a reports folder, newest first: label or commit, exit code, items"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness",
        description="Chaos-engineering and SLO-conformance harness for PD-disaggregated LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        if name in [a for a in sys.argv[1:] if not a.startswith("-")][:1]:  # import only that module
            _load(module_name).add_arguments(sp)
    return parser


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HarnessError(f"subcommand module {module_name} cannot be imported: {exc}",
                           fix="reinstall the project with `pip install -e .`") from exc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] and argv[0] in SUBCOMMANDS:
            module = _load(SUBCOMMANDS[argv[0]][0])
            if getattr(module, "PASS_THROUGH", False):  # its arguments are another tool's (pytest's)
                return int(module.main(argv[1:]))
        saved, sys.argv = sys.argv, [sys.argv[0], *argv]
        parser = build_parser()
        sys.argv = saved
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if not args.command:
            parser.print_help()
            return 0
        return int(_load(args._module).run(args) or 0)
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt as exc:  # harness.signals.Terminated (SIGTERM) carries 143
        return getattr(exc, "exit_code", 130)
