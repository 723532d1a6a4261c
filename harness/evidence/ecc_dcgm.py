"""One ECC error injected through DCGM and the polls that watched its worker drain (item ecc on a
real cluster): what harness/scenarios/ecc_dcgm.py records and harness/checks/ecc_dcgm.py judges."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from harness.stats.interval import Interval
from harness.stats.intervals import RESOLUTION, measured_within

QUIET_S = 3.0   # no running request for this long counts as drained


@dataclass
class Injection:
    """One injection and its polls. Times are seconds after the injection was confirmed (the fault's
    verify saw the host's first ``dcgmi`` injection succeed); the field took effect at most
    ``effect_window_s`` before that (from the inject step's start), and each poll's answers describe
    a moment between its start (``samples``) and when they were in (``answered_s``)."""

    worker: str
    host: str
    gpu: int
    field_name: str
    value: int
    t_inject: float                                   # wall time of the injection
    drained_after_s: float | None = None              # the first poll that saw it drained
    drained_how: str | None = None
    back_after_s: float | None = None                 # after the revert: health 200 again (None: not seen)
    samples: list[tuple[float, int | None, float | None]] = field(default_factory=list)  # (s, health, running)
    problem: str | None = None
    effect_window_s: float = 0.0                      # inject step's start -> time 0 (the confirmation)
    answered_s: list[float] = field(default_factory=list)  # per sample: when its answers were in
    drained_within: tuple[float, float] | None = None  # the drain happened between these polls

    def observe(self, t: float, health: int | None, running: float | None, ran_before: bool,
                answered: float | None = None) -> None:
        """One poll ``t`` s after the injection (its answers in at ``answered``, default ``t``):
        the health URL's status (0: no answer; None: no URL) and the running-requests gauge (None:
        not read)."""
        self.samples.append((round(t, 3), health, running))
        self.answered_s.append(round(max(t, t if answered is None else answered), 3))
        if self.drained_after_s is not None:
            return
        if health is not None and health != 200:
            self.drained_after_s, self.drained_how = t, (f"its health URL answered {health}" if health
                                                         else "its health URL stopped answering")
            self._drained_at(len(self.samples) - 1)
            return
        quiet = [s for s in self.samples if s[2] is not None]
        if not ran_before or not quiet or quiet[-1][2] != 0:
            return
        since = next((s[0] for s in reversed(quiet) if s[2] != 0), None)
        start = next(s[0] for s in quiet if since is None or s[0] > since)
        if t - start >= QUIET_S:
            self.drained_after_s, self.drained_how = start, f"no running request on it for {QUIET_S:g} s"
            first = next(i for i, s in enumerate(self.samples) if s[0] == start and s[2] == 0)
            self._drained_at(first, since=0.0 if since is None else since)

    def _drained_at(self, i: int, since: float | None = None) -> None:
        """The drain was first seen by sample ``i``: it happened after ``since`` (the last poll that
        saw the worker serving; default the poll before ``i``, none: the injection) and before sample
        ``i``'s answers were in."""
        if since is None:
            since = self.samples[i - 1][0] if i else 0.0
        self.drained_within = (since, self.answered_s[i])

    @property
    def watched_s(self) -> float | None:
        """The last poll's start: a worker not drained by then was still serving then."""
        return self.samples[-1][0] if self.samples else None

    def interval(self) -> Interval | None:
        """Where the true drain time after the injection took effect lies, at the polls' resolution
        and the injection's: [the poll before the one that saw it drained, that poll's answers + the
        effect window]; not drained: [the last poll, no upper bound]; None: never polled."""
        if self.drained_within is not None and self.drained_after_s is not None:
            lo, hi = self.drained_within
            v = self.drained_after_s
            return measured_within(v, below=max(0.0, v - lo), above=max(0.0, hi + self.effect_window_s - v),
                                   noun="injections")
        if self.watched_s is None:
            return None
        return Interval(self.watched_s, None, 1.0, RESOLUTION, 1, noun="injections")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        i = self.interval()
        d["interval"] = None if i is None else i.to_dict()
        return d


__all__ = ["Injection", "QUIET_S"]
