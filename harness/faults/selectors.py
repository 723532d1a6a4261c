"""Which targets a fanned-out fault hits: a selector over the cluster's inventory.

The modes are Chaos Mesh's (``spec.mode`` of its experiments), so a selection reads the same here and
in a Kubernetes chaos experiment:

* ``one``: one matching target;
* ``all``: every matching target;
* ``fixed:N``: N of them (refused when fewer than N match);
* ``fixed-percent:P`` (also ``percent:P`` or ``P%``): P % of them, rounded down as Chaos Mesh does
  (refused when that is 0: a chaos run that faults nothing proves nothing);
* ``random-max-percent:P``: a random count from 1 to P % of them (rounded down; Chaos Mesh may
  also pick 0, the harness never does, for the same reason).

Filters narrow the candidates first: role, host, rack (the host's ``rack:`` in the cluster file) and
worker name (shell patterns, ``mocker-0*``); within one filter any value matches, across filters all
must. Which targets are picked is a seeded sample of the matches sorted by name: the same seed
(``--harness-seed``) picks the same targets on the same inventory.
"""

from __future__ import annotations

import fnmatch
import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from harness.errors import ConfigError

MODES = ("one", "all", "fixed", "fixed-percent", "random-max-percent")
ALIASES = {"percent": "fixed-percent", "count": "fixed", "n": "fixed"}
SYNTAX = "one | all | fixed:N | percent:P (fixed-percent:P, P%) | random-max-percent:P"


@dataclass(frozen=True)
class Candidate:
    """One target the inventory offers: a worker (its process) on a host, with the labels a
    selector filters on. ``source`` is what the caller builds the fault from (the cluster file's
    worker entry, or an admin API worker dict)."""

    name: str
    role: str
    host: str
    rack: str | None = None
    source: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        rack = f", rack {self.rack}" if self.rack else ""
        return f"{self.name} ({self.role} on {self.host}{rack})"


def candidates_from_inventory(spec: Any) -> list[Candidate]:
    """The workers of a cluster file (``workers:``), each with its host's rack."""
    racks = {h.name: getattr(h, "rack", None) for h in spec.hosts}
    return [Candidate(str(w.name), str(w.role), str(w.host), racks.get(w.host), w) for w in spec.workers]


def candidates_from_workers(workers: Iterable[Mapping[str, Any]]) -> list[Candidate]:
    """Workers as the bundled engine's admin API lists them (``{"id", "role", "pid", "host"}``);
    only those with a pid can be faulted."""
    return [Candidate(str(w.get("id")), str(w.get("role")), str(w.get("host") or "localhost"), w.get("rack"), dict(w))
            for w in workers if w.get("pid")]


@dataclass(frozen=True)
class Selection:
    """The outcome of a selector on an inventory: what matched, what was picked, and why."""

    selector: Selector
    seed: int
    matching: tuple[Candidate, ...]
    chosen: tuple[Candidate, ...]

    def lines(self) -> list[str]:
        """What a dry run prints: the selector, the count, then each chosen target."""
        head = (f"selector {self.selector.describe()} (seed {self.seed}): {len(self.chosen)} of "
                f"{len(self.matching)} matching target(s)")
        return [head] + [f"  target {c.describe()}" for c in self.chosen]


@dataclass(frozen=True)
class Selector:
    mode: str = "one"
    value: float | None = None
    roles: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    racks: tuple[str, ...] = ()
    names: tuple[str, ...] = ()   # fnmatch patterns

    def __post_init__(self) -> None:
        mode = ALIASES.get(self.mode, self.mode)
        object.__setattr__(self, "mode", mode)
        if mode not in MODES:
            raise ConfigError(f"unknown selector mode {self.mode!r}", fix=f"write one of: {SYNTAX}")
        if mode in ("one", "all"):
            if self.value is not None:
                raise ConfigError(f"selector mode {mode!r} takes no value (got {self.value!r})",
                                  fix=f"write `{mode}`, or `fixed:N` / `percent:P` to pick several")
        elif mode == "fixed":
            if self.value is None or self.value != int(self.value) or self.value < 1:
                raise ConfigError(f"selector `fixed` needs a whole number of targets >= 1, got {self.value!r}",
                                  fix="write e.g. `fixed:3`")
        elif self.value is None or not 0 < self.value <= 100:
            raise ConfigError(f"selector `{mode}` needs a percentage in (0, 100], got {self.value!r}",
                              fix=f"write e.g. `{mode}:25` (at most 100; `all` for every target)")

    @classmethod
    def parse(cls, text: str, *, roles: Sequence[str] = (), hosts: Sequence[str] = (), racks: Sequence[str] = (),
              names: Sequence[str] = ()) -> Selector:
        """``one``, ``all``, ``fixed:3`` (or ``3``), ``percent:25`` (or ``25%``), ``random-max-percent:30``."""
        raw = text.strip().lower()
        if raw.endswith("%"):
            mode, value = "fixed-percent", raw[:-1]
        elif raw.isdigit():
            mode, value = "fixed", raw
        else:
            mode, _, value = raw.partition(":")
        try:
            number = float(value) if value else None
        except ValueError:
            raise ConfigError(f"selector {text!r}: {value!r} is not a number", fix=f"write one of: {SYNTAX}") from None
        if number is not None and not math.isfinite(number):
            raise ConfigError(f"selector {text!r}: {value!r} is not a finite number", fix=f"write one of: {SYNTAX}")
        return cls(mode, number, tuple(roles), tuple(hosts), tuple(racks), tuple(names))

    def describe(self) -> str:
        what = self.mode if self.value is None else f"{self.mode}:{self.value:g}"
        filters = [f"{label}={','.join(values)}" for label, values in
                   (("role", self.roles), ("host", self.hosts), ("rack", self.racks), ("name", self.names)) if values]
        return " ".join([what, *filters])

    def matches(self, c: Candidate) -> bool:
        return ((not self.roles or c.role in self.roles) and (not self.hosts or c.host in self.hosts)
                and (not self.racks or c.rack in self.racks)
                and (not self.names or any(fnmatch.fnmatchcase(c.name, p) for p in self.names)))

    def select(self, candidates: Sequence[Candidate], seed: int = 0) -> Selection:
        """The seeded pick; a ConfigError naming the fix when the selector cannot be met."""
        matching = sorted((c for c in candidates if self.matches(c)), key=lambda c: c.name)
        if not matching:
            raise ConfigError(f"selector {self.describe()!r} matches no target ({self._offered(candidates)})",
                              fix="loosen the filters: use a role, host, rack or name the inventory has")
        rng = random.Random(seed)
        n = len(matching)
        if self.mode == "one":
            count = 1
        elif self.mode == "all":
            count = n
        elif self.mode == "fixed":
            count = int(self.value)  # type: ignore[arg-type]
            if count > n:
                raise ConfigError(f"selector {self.describe()!r} asks for {count} targets but only {n} match",
                                  fix=f"ask for at most fixed:{n}, or loosen the filters")
        else:
            assert self.value is not None
            most = math.floor(n * self.value / 100)
            if most < 1:
                least = math.ceil(100 / n)
                raise ConfigError(f"selector {self.describe()!r}: {self.value:g} % of {n} matching target(s) is 0 "
                                  "(rounded down, as Chaos Mesh does)",
                                  fix=f"use at least {least} %, or `one` / `fixed:1`")
            count = most if self.mode == "fixed-percent" else rng.randint(1, most)
        return Selection(self, seed, tuple(matching), tuple(sorted(rng.sample(matching, count), key=lambda c: c.name)))

    @staticmethod
    def _offered(candidates: Sequence[Candidate]) -> str:
        if not candidates:
            return "the inventory lists no workers"
        return (f"roles: {', '.join(sorted({c.role for c in candidates}))}; "
                f"hosts: {', '.join(sorted({c.host for c in candidates}))}; "
                f"racks: {', '.join(sorted({c.rack for c in candidates if c.rack})) or 'none'}")


__all__ = ["ALIASES", "Candidate", "MODES", "SYNTAX", "Selection", "Selector", "candidates_from_inventory",
           "candidates_from_workers"]
