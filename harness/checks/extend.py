"""Measure more before saying inconclusive, with error rates that hold at every look.

A timing verdict whose interval straddles its threshold (harness/checks/verdict.py, ``undecided``)
is not yet an answer: the suite measures more (requests, repeats, migrations) within a budget its
checklist states (``max_load_s``, ``max_repeats``, ``max_migrations_*``; origin: harness), then
judges again on all samples. Still undecided when the budget is spent: inconclusive, with what
would decide it. The loop lives here once; each suite passes how to judge and how to measure more.

Looking again until something decides would inflate the chance of a wrong decision (every look
is another chance), so the loop looks at most :data:`harness.stats.levels.LOOKS` times (the
first judgment and LOOKS - 1 extensions), a number fixed before the run, and each look judges
under its share of the error budgets (harness/stats/levels.py: equal shares, union bound). To
reach the budget within those looks every extension asks for at least as many samples again as
there are (the samples at least double). Each verdict's evidence says how many looks were used
(``extension``, ``error_control.looks_used``).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from harness.checks.verdict import Verdict, undecided
from harness.stats import levels

log = logging.getLogger(__name__)


def measure_until_decided(judge_all: Callable[[], Sequence[Verdict]], measure_more: Callable[[int], bool], *,
                          budget: str) -> list[Verdict]:
    """``judge_all()`` -> verdicts from every sample so far, each judged at its look's share of the
    error budgets; while one straddles and looks are left, ``measure_more(wanted)`` measures about
    ``wanted`` more samples and returns False when the budget is spent. ``wanted`` is the largest of
    "about N more would decide" among the straddling measurements and the samples they already
    have (so the samples at least double: the budget is reached within the looks). Each verdict's
    evidence gets ``extension``: rounds, looks, budget, why it stopped."""
    looks = levels.LOOKS
    with levels.spending(look=1, looks=looks):
        verdicts = list(judge_all())
    rounds, stopped = 0, "decided"
    while pending := [u for v in verdicts for u in undecided(v)]:
        if rounds + 1 >= looks:
            stopped = f"looked {looks} times, the most the error budget is split over"
            break
        wanted = max(max(u["more_to_decide"] or 0, u.get("n") or 1) for u in pending)
        log.info("undecided (%s): measuring about %d more", ", ".join(u["key"] for u in pending), wanted)
        if not measure_more(max(wanted, 1)):
            stopped = f"budget spent ({budget})"
            break
        rounds += 1
        with levels.spending(look=rounds + 1, looks=looks):
            verdicts = list(judge_all())
    for v in verdicts:
        v.evidence["extension"] = {"rounds": rounds, "looks": rounds + 1, "most_looks": looks, "budget": budget,
                                   "stopped": stopped}
        if isinstance(v.evidence.get("error_control"), dict):
            v.evidence["error_control"]["looks_used"] = rounds + 1
        if undecided(v) and rounds:
            v.add("extended", rounds=rounds, stopped=stopped)
    return verdicts


def repeat_until_decided(judge_all: Callable[[], Sequence[Verdict]], repeat: Callable[[int], object],
                         count: Callable[[], int], *, first: int, most: int, noun: str) -> list[Verdict]:
    """The common case of :func:`measure_until_decided` for repeated measurements: ``repeat(k)``
    makes k more, ``count()`` says how many there are; at least ``first`` before judging, then
    more (at least 2 at a time, and at least as many again as there are) while a verdict
    straddles, never beyond ``most``; the last extension the looks allow takes all that is left."""
    if count() < first:
        repeat(first - count())
    extensions = 0

    def more(wanted: int) -> bool:
        nonlocal extensions
        have = count()
        if have >= most:
            return False
        extensions += 1
        last = extensions >= levels.LOOKS - 1
        repeat(most - have if last else min(most - have, max(wanted, 2)))
        return count() > have   # no progress (e.g. nothing measurable any more): stop, never loop

    return measure_until_decided(judge_all, more, budget=f"at most {most} {noun}")


def repeat_undecided(verdict: Verdict | None, k: int, repeats: dict[str, Callable[[int], object]]) -> list[str]:
    """``k`` more of each figure of one verdict (``repeats``: threshold key -> make k more) whose
    interval still straddles in ``verdict``; of all of them before the first judgment (None), or when
    none is listed as undecided. Returns the keys repeated. A verdict with two figures (6.1.1: the raw
    probe and the engine's own transfers) so spends no runs on the one already decided."""
    pending = {u["key"] for u in undecided(verdict)} & set(repeats) if verdict is not None else set()
    keys = [key for key in repeats if key in pending] or list(repeats)
    for key in keys:
        repeats[key](k)
    return keys
