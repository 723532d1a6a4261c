"""The blast radius: never more than a set share of one role's workers faulted at once.

``safety.blast_radius: {max_role_share_down: 0.25}`` in the cluster file. :func:`check_blast_radius`
runs on the resolved selection BEFORE anything is touched (no SSH connection, no ledger entry): a
selection that would take more than the share of a role down, counting the workers of that role
some fault already holds, is refused with the largest selection that fits. The share is of the role's
workers in the inventory (the cluster file's ``workers:``), whether they are up or not: the
harness cannot know what the cluster lost by itself, so the limit is a ceiling on what the harness
adds.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from harness.errors import FaultError
from harness.faults.selectors import Candidate

SHARE_EPSILON = 1e-9  # 4 of 16 is exactly 0.25: float division must not refuse it


def role_limits(inventory: Sequence[Candidate], share: float) -> dict[str, int]:
    """Role -> how many of its workers may be down at once under ``share``."""
    totals: dict[str, int] = {}
    for c in inventory:
        totals[c.role] = totals.get(c.role, 0) + 1
    return {role: math.floor(n * share + SHARE_EPSILON) for role, n in totals.items()}


def held_by_role(active_faults: Iterable[Any], inventory: Sequence[Candidate]) -> dict[str, set[str]]:
    """Role -> names of inventory workers an active fault already holds (a process fault names its
    worker in ``worker_id``; a fault without one holds no worker)."""
    names = {c.name: c.role for c in inventory}
    out: dict[str, set[str]] = {}
    for fault in active_faults:
        worker = getattr(fault, "worker_id", None)
        if worker in names:
            out.setdefault(names[worker], set()).add(worker)
    return out


def check_blast_radius(chosen: Sequence[Candidate], inventory: Sequence[Candidate], limit: Any, *,
                       cluster: str, active_faults: Iterable[Any] = ()) -> list[str]:
    """Refuse (FaultError) a selection that takes more than ``limit.max_role_share_down`` of a role
    down, counting the workers already faulted; returns one line per role saying how it stands.
    ``limit`` None: no limit, nothing refused."""
    if limit is None:
        return [f"blast radius: no limit on cluster {cluster!r} (safety.blast_radius is not set)"]
    share = float(limit.max_role_share_down)
    limits = role_limits(inventory, share)
    held = held_by_role(active_faults, inventory)
    totals = {role: sum(1 for c in inventory if c.role == role) for role in limits}
    lines, problems = [], []
    for role in sorted({c.role for c in chosen}):
        new = {c.name for c in chosen if c.role == role} - held.get(role, set())
        already = len(held.get(role, set()))
        down = already + len(new)
        allowed = limits.get(role, 0)
        line = (f"blast radius: {down} of {totals.get(role, 0)} {role} worker(s) down at once "
                f"({already} already faulted), limit {allowed} (max_role_share_down {share:g})")
        lines.append(line)
        if down > allowed:
            problems.append((role, line, max(allowed - already, 0)))
    if problems:
        detail = "; ".join(line.removeprefix("blast radius: ") for _, line, _ in problems)
        fits = ", ".join(f"at most {room} more {role} worker(s)" for role, _, room in problems)
        raise FaultError(f"cluster {cluster!r}: the selection exceeds safety.blast_radius: {detail}; nothing was "
                         "touched", fix=f"select {fits} (e.g. a smaller fixed:N or percent), or raise "
                                        "safety.blast_radius.max_role_share_down in the cluster file")
    return lines


__all__ = ["check_blast_radius", "held_by_role", "role_limits"]
