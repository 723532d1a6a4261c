"""``--dry-run``: what a run would do, on the terminal, contacting nothing.

A dry run reads the cluster file and prints the plan: each fault with its target and how long it
is held, and whether the cluster's ``safety`` settings allow it. It sends no API request, opens no
SSH connection, opens no SSH key file and sends no API key (it only checks that the key files exist
and that the API-key variable is set); what a real run would refuse for want of them is said here instead (the same checks as ``python -m harness schema
--check``, harness/clusterfile/load.py). See docs/dry-run.md.
"""

from __future__ import annotations

from typing import Any, Iterable

import pytest

from harness.errors import FaultError
from harness.plugin_state import show_line

PREFIX = "[dry-run]"


def safety_word(spec: Any, fault_kind: str) -> str:
    """``allowed`` or ``REFUSED (why)`` for ``fault_kind`` under the cluster's safety settings."""
    try:
        spec.safety.check_allowed(fault_kind, spec.name)
    except FaultError as exc:
        return f"REFUSED by safety ({exc.message})"
    return "allowed by safety"


def reads_no_admin_api(cluster: Any) -> bool:
    """A dry run of an external cluster does not read its admin API (its worker table, its
    degradation state); the bundled cluster is the harness's own, started on this machine."""
    return cluster.kind == "external"


def unread_targets(cluster: Any, fault_kind: str, targets: str, detail: str) -> str:
    """A plan line whose targets the run reads from the cluster's admin API when it starts."""
    return (f"{fault_kind} on {targets}: {detail}; the targets come from {cluster.admin_url}/admin/workers, read "
            f"when a real run starts, not by a dry run [{safety_word(cluster.spec, fault_kind)}]")


def safety_summary(spec: Any) -> str:
    """One line: what the cluster's safety settings let a run do."""
    safety = spec.safety
    allowed = "all" if safety.allowed_faults is None else f"[{', '.join(safety.allowed_faults)}]"
    head = f"safety: production: {str(safety.production).lower()}, allowed_faults: {allowed}"
    if safety.allowed_faults is None:
        return f"{head}: every fault kind may be injected"
    if not safety.allowed_faults:
        return (f"{head}: every planned fault is refused (a real run records the items that need one "
                "inconclusive and injects nothing)")
    return f"{head}: any other fault kind is refused"


def what_a_run_needs(spec: Any) -> list[str]:
    """What a real run would stop on that a dry run does not read: SSH key and known_hosts files
    (harness.clusterfile.load.check_before_start) and the API-key variable."""
    from harness.clusterfile.load import start_problems

    return [f"a real run would stop here: {problem}" for problem in start_problems(spec)]


def announce(config: pytest.Config, spec: Any) -> None:
    """The dry run's header, printed once before the suites run."""
    where = spec.endpoints.api if spec.endpoints is not None else "started on this machine"
    show_lines(config, [
        f"cluster {spec.name} ({spec.kind}, engine {spec.engine_name}, {spec.path}): nothing is contacted or "
        f"changed (API {where} not called, no SSH, no key file opened, no API key sent)",
        safety_summary(spec),
        *what_a_run_needs(spec),
    ])


def show_lines(config: pytest.Config, lines: Iterable[str]) -> None:
    """Each line as ``[dry-run] line`` on a terminal line of its own, past pytest's capture."""
    for line in lines:
        show_line(config, f"{PREFIX} {line}")
