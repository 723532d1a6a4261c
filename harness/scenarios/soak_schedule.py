"""A soak run's fault schedule: drawn from a seed and the cluster's inventory before the run starts,
so that the same seed on the same inventory replays the same faults, targets and offsets.

Faults come one after another at a jittered pace, and overlap where one is still held or being
recovered from when the next begins, but never beyond the blast radius: at most
``max_role_share`` of a role's workers faulted (or still recovering, as planned) at once, and never
two faults on one worker at once. Kinds are drawn in rounds over a seeded order of the allowed
kinds, so every allowed kind comes up before any comes twice.

Pure: no I/O. The soak scenario (harness/scenarios/soak.py) executes it; ``--dry-run`` prints it;
results.json keeps it under ``soak.schedule``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from harness.errors import ConfigError
from harness.evidence.soak import ScheduledFault
from harness.states import WorkerRole


@dataclass(frozen=True)
class KindSpec:
    """How one fault kind is scheduled: which roles it can hit, how long it is held (drawn between
    the bounds), how long recovery is planned to take after its revert (a killed worker restarts),
    and whether it needs the emulated fabric."""

    roles: tuple[str, ...]
    hold_s: tuple[float, float]
    recovery_s: float
    fabric: bool = False
    admin: bool = False   # needs the engine's admin API (fault hooks); the process kinds need only a pid


KILLABLE = (WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.AGGREGATED)


KINDS: dict[str, KindSpec] = {
    # a killed worker restarts and registers again: 27-65 s seen on a loaded 2-core machine
    "process_kill": KindSpec(KILLABLE, (2.0, 6.0), 45.0),
    # held past the router's hang detection (1-2 s), resumed by SIGCONT; under Dynamo's file-discovery
    # lease (about 10 s), past which a stopped worker never registers again (docs/dynamo.md)
    "process_hang": KindSpec(KILLABLE, (3.0, 6.0), 8.0),
    "hbm_fill": KindSpec((WorkerRole.DECODE,), (6.0, 12.0), 8.0, admin=True),
    "ecc_poison": KindSpec((WorkerRole.DECODE,), (4.0, 8.0), 8.0, admin=True),
    "nic_flap": KindSpec((WorkerRole.PREFILL, WorkerRole.DECODE), (3.0, 6.0), 10.0, fabric=True),
    "pfc_storm": KindSpec((WorkerRole.PREFILL, WorkerRole.DECODE), (3.2, 6.4), 8.0, fabric=True),
}

WARMUP_S = 20.0          # load alone first: the first fault lands on a cluster in steady state


@dataclass(frozen=True)
class SoakSchedule:
    seed: int
    duration_s: float
    faults_per_min: float
    max_role_share: float
    kinds: tuple[str, ...]
    inventory: tuple[tuple[str, str], ...]   # (worker id, role), sorted
    faults: tuple[ScheduledFault, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "duration_s": self.duration_s, "faults_per_min": self.faults_per_min,
                "max_role_share": self.max_role_share, "kinds": list(self.kinds),
                "inventory": [list(w) for w in self.inventory], "faults": [f.to_dict() for f in self.faults]}

    def overlapping(self) -> int:
        """Faults planned to begin while another is still held or recovering."""
        return sum(any(o.offset_s <= f.offset_s < o.planned_until_s for o in self.faults[:i])
                   for i, f in enumerate(self.faults))

    def lines(self) -> list[str]:
        kinds = sorted({f.kind for f in self.faults})
        head = (f"soak schedule (seed {self.seed}): {len(self.faults)} faults of {len(kinds)} kinds "
                f"({', '.join(kinds)}) over {self.duration_s:.0f} s, {self.overlapping()} overlapping; "
                f"at most {self.max_role_share:g} of a role at once")
        return [head, *(f.line() for f in self.faults)]


def role_cap(count: int, share: float) -> int:
    """Workers of a role that may be faulted at once: ``share`` of them, at least 1 where a survivor remains."""
    return max(1, math.floor(count * share + 1e-9)) if count >= 2 else 0


def eligible_kinds(allowed: Sequence[str] | None, *, fabric: bool, admin: bool = True) -> tuple[str, ...]:
    """The schedulable kinds the cluster allows (``None``: all), in KINDS order; fabric kinds only on a
    fabric, admin kinds (HBM fill, ECC poisoning) only with the engine's admin API."""
    unknown = sorted(set(allowed or ()) - set(KINDS))
    if unknown:
        raise ConfigError(f"--soak-kinds names unknown fault kinds {unknown}", fix=f"use some of {sorted(KINDS)}")
    return tuple(k for k, spec in KINDS.items()
                 if (allowed is None or k in allowed) and not left_out_because(k, fabric=fabric, admin=admin))


def left_out_because(kind: str, *, fabric: bool, admin: bool) -> str | None:
    """Why ``kind`` cannot be injected on this cluster (None: it can): what it needs and the cluster lacks."""
    spec = KINDS[kind]
    if spec.fabric and not fabric:
        return "needs the emulated fabric (a NIC and a switch queue the harness controls); this cluster has none"
    if spec.admin and not admin:
        return ("needs the engine's admin API (its fault hooks reserve or poison KV blocks); this cluster has none, "
                "and a black-box fault can only signal a process")
    return None


def generate(seed: int, inventory: Sequence[tuple[str, str]], duration_s: float, kinds: Sequence[str], *,
             faults_per_min: float = 2.0, max_role_share: float = 0.5) -> SoakSchedule:
    """The schedule for ``inventory`` ((worker id, role) pairs): see the module doc. Deterministic in
    its arguments (the inventory's order does not matter)."""
    if duration_s <= WARMUP_S + 10:
        raise ConfigError(f"a soak of {duration_s:g} s leaves no room for faults after {WARMUP_S:g} s of warm-up",
                          fix="use --soak=3m or longer")
    if faults_per_min <= 0:
        raise ConfigError(f"--soak-faults-per-min must be positive, got {faults_per_min:g}", fix="e.g. 2")
    inv = tuple(sorted((str(w), str(r)) for w, r in inventory))
    by_role: dict[str, list[str]] = {}
    for wid, role in inv:
        by_role.setdefault(role, []).append(wid)
    caps = {role: role_cap(len(ids), max_role_share) for role, ids in by_role.items()}
    usable = [k for k in kinds if any(caps.get(r, 0) for r in KINDS[k].roles)]
    if not usable:
        raise ConfigError(f"no fault kind of {list(kinds)} can hit this inventory within the blast radius "
                          f"(workers per role: { {r: len(i) for r, i in by_role.items()} })",
                          fix="a role needs at least 2 workers, so that one survives the fault")
    rng = random.Random(f"soak:{seed}")
    gap = 60.0 / faults_per_min
    n = max(1, int((duration_s - WARMUP_S) / gap))
    planned: list[ScheduledFault] = []
    order: list[str] = []
    for i in range(n):
        if not order:
            order = rng.sample(usable, len(usable))
        kind = order.pop(0)
        spec = KINDS[kind]
        hold = round(rng.uniform(*spec.hold_s), 1)
        offset = round(WARMUP_S + i * gap + rng.uniform(0.0, 0.6) * gap, 1)
        while offset + hold < duration_s:
            until = round(offset + hold + spec.recovery_s, 1)
            free = [(wid, str(role)) for role in spec.roles for wid in by_role.get(str(role), ())
                    if _fits(planned, offset, until, str(role), wid, caps[str(role)])]
            if free:
                wid, role = free[rng.randrange(len(free))]
                planned.append(ScheduledFault(len(planned), offset, kind, wid, role, hold, until))
                break
            offset = round(offset + 5.0, 1)   # the blast radius is full: a little later
    planned.sort(key=lambda f: f.offset_s)
    faults = tuple(ScheduledFault(i, f.offset_s, f.kind, f.target, f.role, f.hold_s, f.planned_until_s)
                   for i, f in enumerate(planned))
    return SoakSchedule(seed, duration_s, faults_per_min, max_role_share, tuple(kinds), inv, faults)


def _fits(planned: Sequence[ScheduledFault], start: float, until: float, role: str, target: str, cap: int) -> bool:
    """A fault on ``target`` over [start, until) keeps its role within ``cap`` at every moment and
    its target free of other faults (concurrency only changes where a fault begins)."""
    for at in [start, *(f.offset_s for f in planned if start < f.offset_s < until)]:
        live = [f for f in planned if f.offset_s <= at < f.planned_until_s]
        if sum(f.role == role for f in live) >= cap or any(f.target == target for f in live):
            return False
    return True


def parse_duration(text: str) -> float:
    """``30m``, ``90s``, ``2h``, ``1h30m`` or plain seconds -> seconds (a ConfigError naming the fix)."""
    s = str(text).strip().lower()
    total, number = 0.0, ""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    try:
        for ch in s:
            if ch.isdigit() or ch == ".":
                number += ch
            elif ch in units and number:
                total += float(number) * units[ch]
                number = ""
            else:
                raise ValueError(ch)
        if number:
            total += float(number)
    except ValueError:
        total = -1.0
    if not s or total <= 0:
        raise ConfigError(f"--soak={text!r} is not a duration", fix="write e.g. --soak=30m, --soak=3m, --soak=2h or "
                          "--soak=900 (seconds)")
    return total
