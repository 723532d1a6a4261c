"""The harness's pytest options, each value checked as it is parsed (harness/plugin.py adds them).
A value that fails is kept as :class:`Invalid` (not raised) so the run exits 3, the harness-error
code, naming it, instead of pytest's usage-error code 4 (our "revert failed")."""

from __future__ import annotations

from typing import Any, Callable

from harness.errors import HarnessError


class Invalid:
    """An option value that failed its check. Kept (not raised) so the run can exit with code 3,
    the harness-error code, instead of pytest's usage-error code 4 (our "revert failed")."""

    def __init__(self, message: str) -> None:
        self.message = message


def number(kind: type, minimum: float, what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            return Invalid(f"{what}: {text!r} is not a{'n integer' if kind is int else ' number'}")
        if value < minimum:
            return Invalid(f"{what}: {text!r} must be >= {minimum:g}")
        return value
    parse.__name__ = what
    return parse


def non_empty(text: str) -> Any:
    return text if text.strip() else Invalid("--cluster: empty value")


def soak_duration(text: str) -> Any:
    from harness.errors import ConfigError
    from harness.scenarios.soak_schedule import parse_duration

    try:
        return parse_duration(text)
    except ConfigError as exc:
        return Invalid(f"{exc.message} (fix: {exc.fix})")


def baseline_path(text: str) -> Any:
    """The baseline's results.json, found before the run starts (a typo must not cost a whole run)."""
    from harness.compare import results_file

    try:
        return str(results_file(text))
    except HarnessError as exc:
        return Invalid(f"--baseline {text}: {exc}")


def live_mode(text: str) -> Any:
    from harness.report.live import MODES

    return text if text in MODES else Invalid(f"--live: {text!r} is not one of {', '.join(MODES)}")
