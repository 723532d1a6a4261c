"""``harness run [pytest options] [SUITE ...]``: the conformance suites shipped in the package, from
any directory. The same run as ``pytest suites/`` in a checkout: ``--cluster NAME`` reads
``./clusters/NAME.yaml`` of the current directory first (then the shipped examples), reports go to
``./reports/``, node ids read ``suites/test_62_slo.py::...``. Every argument goes to pytest; one
that names a shipped suite file (``test_62_slo.py``, ``suites/test_62_slo.py::test_x``) selects it,
``-k`` selects by name, and without either every suite runs. ``harness run --help`` is pytest's
help (the harness options are in its "PD conformance harness" group).
"""

from __future__ import annotations

import argparse
import os
import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Iterable, Iterator

import pytest

from harness.errors import ConfigError

# `harness run ARGS`: ARGS go to pytest untouched (harness/cli.py does not parse them)
PASS_THROUGH = True
_SUITE_ARG = re.compile(r"(?:suites/)?(test_\w+\.py)(::.*)?")


def suites_dir() -> Path:
    """The folder of the shipped suites (``harness/suites``; ``suites/`` links to it in a checkout)."""
    import harness.suites

    return Path(harness.suites.__file__).resolve().parent


def plugin_registered_by_entry_point() -> bool:
    """Whether pytest loads the harness plugin by itself (the installed package's ``pytest11``
    entry point); otherwise it must be named (``-p harness.plugin``, or the checkout's conftest.py)."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "harness.plugin" for ep in entry_points(group="pytest11"))


def pytest_args(args: list[str], cwd: Path | None = None) -> list[str]:
    """The pytest command line for ``harness run ARGS``."""
    cwd = cwd or Path.cwd()
    folder = suites_dir()
    picked, rest = [], []
    for arg in args:
        match = _SUITE_ARG.fullmatch(arg)
        if match is None:
            rest.append(arg)
            continue
        if not (folder / match.group(1)).is_file():
            shipped = sorted(p.name for p in folder.glob("test_*.py"))
            raise ConfigError(f"harness run: {arg}: no shipped suite named {match.group(1)}",
                              fix=f"name one of {', '.join(shipped)}, or select tests with -k")
        picked.append(f"{folder / match.group(1)}{match.group(2) or ''}")
    # rootdir = the package folder: node ids are `suites/<file>::<test>`, as in a checkout
    head = ["--rootdir", str(folder.parent)]
    if "--dry-run" in args and "cacheprovider" not in args:   # a dry run writes nothing (issue 37)
        head += ["-p", "no:cacheprovider"]
    elif "no:cacheprovider" not in args:  # pytest's cache beside the user's reports, never in site-packages
        head += ["-o", f"cache_dir={cwd / '.pytest_cache'}"]
    if not plugin_registered_by_entry_point():
        head += ["-p", "harness.plugin"]
    return [*head, *rest, *(picked or [str(folder)])]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="pytest options (--cluster NAME, --dry-run, -k ...) and shipped suite files")


def run(args: argparse.Namespace) -> int:
    return main(list(args.pytest_args))


def main(args: list[str]) -> int:
    """Become ``python -m harness.cli_run ...``, pytest with :class:`UsageErrorsExit3` (exec: the same
    process takes Ctrl-C and SIGTERM, and pytest imports the harness plugin itself, so its assertion
    rewriting applies)."""
    import sys

    argv = [sys.executable, "-m", "harness.cli_run", *pytest_args(args)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def report_usage_error(messages: tuple[object, ...], known_options: Iterable[str] = ()) -> int:
    """Print a pytest usage error (``pytest.UsageError.args``) as pytest does, and the harness's
    line: the code is 3, "harness error". pytest's own code for it, 4, is this harness's "a revert
    failed" (docs/exit-codes.md). An unrecognized option close to one of ``known_options`` gets a
    "did you mean" line (``--clustr=x``: ``--cluster``)."""
    import sys

    for message in messages:
        sys.stderr.write(f"ERROR: {message}\n")
    for hint in option_hints(messages, known_options):
        sys.stderr.write(f"{hint}\n")
    sys.stderr.write("harness: exit 3 (pytest usage error; fix: check the paths and options on the command line, "
                     "see --help)\n")
    sys.stderr.flush()
    return 3


class UsageErrorsExit3:
    """``harness run``'s pytest plugin, registered before pytest reads its command line, so every
    usage error found while reading it exits 3: a typo'd option (``--clustr=x``), a bad value of
    pytest's own options (``--maxfail=x``), ``-p nosuchplugin``, a missing ``--rootdir``. (Plain
    ``pytest`` loads the harness plugin later; harness/plugin.py covers what it can from there.)"""

    def __init__(self) -> None:
        self.parser: object = None

    def pytest_addoption(self, parser: object) -> None:
        parser.prog = "harness run"  # type: ignore[attr-defined]  # "usage: harness run [options] ..."
        self.parser = parser

    @pytest.hookimpl(wrapper=True)
    def pytest_cmdline_parse(self, pluginmanager: object, args: list[str]) -> Iterator[pytest.Config]:
        try:
            return (yield)
        except pytest.UsageError as exc:
            raise SystemExit(report_usage_error(exc.args, option_names(self.parser))) from None


def _run_pytest(args: list[str]) -> int:
    import sys

    try:
        code = int(pytest.main(args, plugins=[UsageErrorsExit3()]))
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `harness run --help | head`: as pytest's own console script does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def option_hints(messages: tuple[object, ...], known_options: Iterable[str]) -> list[str]:
    """``did you mean --cluster?`` for each unrecognized ``--option`` in pytest's usage messages
    that is close to a known one (difflib, the name before any ``=``)."""
    import difflib

    known = sorted({o for o in known_options if o.startswith("--")})
    hints = []
    for message in messages:
        if "unrecognized arguments" not in str(message):
            continue
        for word in re.findall(r"(?<!\S)(--[\w-]+)", str(message).split("unrecognized arguments:", 1)[-1]):
            close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
            if close and close[0] != word:
                hints.append(f"harness: {word}: did you mean {close[0]}?")
    return hints


def option_names(parser: object) -> list[str]:
    """Every long option the command line knows (pytest's and the plugins'), for "did you mean":
    read from the argparse parser's own help (public API; pytest 9 keeps it as ``optparser``)."""
    try:
        return sorted(set(re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", parser.optparser.format_help())))  # type: ignore[attr-defined]
    except Exception:   # no parser yet, or a pytest without it: no suggestion, the error stands
        return []


if __name__ == "__main__":  # python -m harness.cli_run PYTEST_ARGS: what `harness run` execs
    import sys

    raise SystemExit(_run_pytest(sys.argv[1:]))
