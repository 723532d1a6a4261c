"""Error control: which one-sided level each bound of a verdict's interval is computed at
(docs/statistics.md, "Error rates").

Every interval-judged measurement has two budgets, each one-sided, stated by its checklist item
(``false_fail_alpha``, ``false_pass_alpha``; origin: harness):

- **wrong fail**: the item's budget, shared equally by its interval-judged measurements; the
  items' budgets add up to the run's false-fail budget on a healthy cluster (1 % for the default
  checklist: :data:`RUN_FALSE_FAIL_BUDGET`, union bound over the family);
- **wrong pass**: per measurement (2.5 % by default).

The extension loop (harness/checks/extend.py) looks at most :data:`LOOKS` times, a number fixed
before the run, and each budget is split in :data:`SHARES` = LOOKS + 1 **equal shares**: one per
look, and one reserved for a judgment after or outside the loop (6.1.2's final verdict, which
reads the router's events again and may find a migration that arrived after the last look). At
every judgment the bound that can cause a FAIL is computed at ``fail budget / SHARES`` and the
bound that can cause a PASS at ``pass budget / SHARES`` (one-sided each). By the union bound the
chance of a wrong decision at any of the LOOKS looks or the reserved judgment is at most the
budget, however they depend on each other and whether or not the loop stopped early. Equal shares
make every judgment's level the same, so a verdict judged again on the same samples decides as
its last look did (it spends nothing); on changed samples it spends the reserved share. A second
judgment on changed samples after the loop would exceed the budget: no suite makes one.

A soak's windows are judged under an override (:func:`spending` with ``fail_alpha``): Bonferroni
over the windows known before the run times the percentiles (harness/checks/soak.py).

A leaf module: stdlib only.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Any, Iterator

LEVEL = 0.95                  # two-sided level of an interval built outside any error control
LOOKS = 5                     # the extension loop's most looks: the first judgment and 4 extensions
RESERVED = 1                  # shares kept for a judgment after or outside the loop (on changed samples)
SHARES = LOOKS + RESERVED     # each budget is split in this many equal shares
SCHEDULE = "equal shares"
FALSE_FAIL_KEY, FALSE_PASS_KEY = "false_fail_alpha", "false_pass_alpha"   # checklist threshold keys
RUN_FALSE_FAIL_BUDGET = 0.01  # what the items' false_fail_alpha add up to in checklists/section6.yaml
DEFAULT_FALSE_PASS_ALPHA = 0.025


@dataclass(frozen=True)
class Spending:
    """How much of each budget a judgment spends: look ``look`` (1-based; None: after or outside
    the loop, the reserved share) of at most ``looks``, each one of ``looks + RESERVED`` equal
    shares. ``fail_alpha`` / ``pass_alpha``, when set, replace the per-measurement shares outright
    (a soak window's Bonferroni level); ``method`` then says how."""

    look: int | None = None
    looks: int = LOOKS
    fail_alpha: float | None = None
    pass_alpha: float | None = None
    method: str | None = None

    @property
    def shares(self) -> int:
        """Equal shares each budget is split in: one per look and the reserved one."""
        return self.looks + RESERVED

    def alphas(self, item_fail: float, item_pass: float, measurements: int) -> tuple[float, float]:
        """(fail alpha, pass alpha) of one measurement at this judgment: the item's fail budget split
        over its ``measurements`` and over the shares; the pass budget over the shares."""
        fail = self.fail_alpha if self.fail_alpha is not None else item_fail / max(measurements, 1) / self.shares
        pss = self.pass_alpha if self.pass_alpha is not None else item_pass / self.shares
        return fail, pss

    def describe(self) -> str:
        if self.method:
            return self.method
        where = (f"look {self.look} of at most {self.looks}" if self.look is not None
                 else "judged after or outside the extension loop: the reserved share")
        return f"error spending, {SCHEDULE} over {self.looks} looks + {RESERVED} reserved ({where})"

    def to_dict(self, fail_alpha: float, pass_alpha: float, **extra: Any) -> dict[str, Any]:
        return {"method": self.describe(), "schedule": self.method or SCHEDULE, "look": self.look,
                "looks": self.looks, "shares": None if self.method else self.shares, "fail_alpha": fail_alpha,
                "pass_alpha": pass_alpha, **extra}


_SPENDING: contextvars.ContextVar[Spending] = contextvars.ContextVar("harness_error_spending", default=Spending())


def current() -> Spending:
    """The spending in force (outside any loop or override: the reserved share of each budget)."""
    return _SPENDING.get()


@contextlib.contextmanager
def spending(**changes: Any) -> Iterator[Spending]:
    """Judge under a changed :class:`Spending` (the extension loop: ``look=k``; a soak window:
    ``fail_alpha=..., pass_alpha=..., method=...``); restored on exit."""
    token = _SPENDING.set(replace(current(), **changes))
    try:
        yield _SPENDING.get()
    finally:
        _SPENDING.reset(token)


def one_sided(op: str, fail_alpha: float, pass_alpha: float) -> tuple[float, float]:
    """(alpha of the lower bound, alpha of the upper bound) for a threshold compared with ``op``:
    where good values are small (``<``, ``<=``) a high lower bound fails and a low upper bound
    passes; where they are large the roles swap; ``==`` takes the stricter on both sides."""
    if op in ("<", "<="):
        return fail_alpha, pass_alpha
    if op in (">", ">="):
        return pass_alpha, fail_alpha
    strict = min(fail_alpha, pass_alpha)
    return strict, strict


def percent(alpha_miss: float) -> str:
    """A one-sided confidence as text: 0.00015 -> ``99.985 %``."""
    return f"{(1 - alpha_miss) * 100:.6g} %"
