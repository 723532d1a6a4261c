"""When the live display (harness/report/live.py) is shown: inside a conformance test's setup,
call and teardown only, as pytest hooks the plugin registers."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest

from harness.report.live import SETUP, LiveStatus


class LivePhases:
    """pytest hooks that show the live display inside a conformance test's setup, call and
    teardown only: pytest's own progress output between them is never drawn over."""

    def __init__(self, get_live: Callable[[], LiveStatus | None], marker: str) -> None:
        self._get_live, self._marker = get_live, marker

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        with self._phase(item, SETUP):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        with self._phase(item, "running"):
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        with self._phase(item, "teardown (reverting, stopping load)"):
            return (yield)

    @contextlib.contextmanager
    def _phase(self, item: pytest.Item, phase: str) -> Iterator[None]:
        live = self._get_live()
        if live is None or item.get_closest_marker(self._marker) is None:
            yield
            return
        if _cursor_mid_line(item.config):
            live.begin_line()
        live.set_phase(phase, test=item.nodeid)
        live.start()
        try:
            yield
        finally:
            live.stop()


def _cursor_mid_line(config: pytest.Config) -> bool:
    """Whether pytest's terminal writer left its cursor after text (a progress dot, a file name)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    writer = getattr(reporter, "_tw", None)
    return bool(getattr(writer, "width_of_current_line", 0))
