"""Makes `pytest suites/` work from a checkout: loads the harness pytest plugin unless the
installed package already registered it through its `pytest11` entry point."""

from harness.cli_run import plugin_registered_by_entry_point

pytest_plugins = [] if plugin_registered_by_entry_point() else ["harness.plugin"]
