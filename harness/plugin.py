"""pytest plugin: options such as --cluster, session fixtures, report at session end.

(Foundation placeholder: the harness-core work fills this module.)
"""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("harness", "PD conformance harness")
    group.addoption("--cluster", default="local", help="cluster name (clusters/NAME.yaml) or path to a YAML file")
