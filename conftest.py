"""Makes `pytest suites/` work from a checkout: loads the harness pytest plugin unless the
installed package already registered it through its `pytest11` entry point."""

import os
from importlib.metadata import entry_points


def _installed_as_entry_point() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "harness.plugin" for ep in entry_points(group="pytest11"))


pytest_plugins = [] if _installed_as_entry_point() else ["harness.plugin"]
