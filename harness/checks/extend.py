"""Measure more before saying inconclusive.

A timing verdict whose interval straddles its threshold (harness/checks/verdict.py, ``undecided``)
is not yet an answer: the suite measures more (requests, repeats, migrations) within a budget its
checklist states (``max_load_s``, ``max_repeats``, ``max_migrations_*``; origin: harness), then
judges again on all samples. Still undecided when the budget is spent: inconclusive, with what
would decide it. The loop lives here once; each suite passes how to judge and how to measure more.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from harness.checks.verdict import Verdict, undecided

log = logging.getLogger(__name__)


def measure_until_decided(judge_all: Callable[[], Sequence[Verdict]], measure_more: Callable[[int], bool], *,
                          budget: str) -> list[Verdict]:
    """``judge_all()`` -> verdicts from every sample so far; while one straddles,
    ``measure_more(wanted)`` measures about ``wanted`` more samples and returns False when the
    budget is spent. ``wanted`` is the largest "about N more would decide" among the straddling
    measurements; when none would be decided within 10x the samples as observed so far (an
    estimate that itself moves with the samples), as many again as there are. Each verdict's
    evidence gets ``extension``: rounds, budget, why it stopped."""
    verdicts = list(judge_all())
    rounds, stopped = 0, "decided"
    while pending := [u for v in verdicts for u in undecided(v)]:
        wanted = max(u["more_to_decide"] if u.get("more_to_decide") is not None else u.get("n", 1) for u in pending)
        log.info("undecided (%s): measuring about %d more", ", ".join(u["key"] for u in pending), wanted)
        if not measure_more(max(wanted, 1)):
            stopped = f"budget spent ({budget})"
            break
        rounds += 1
        verdicts = list(judge_all())
    for v in verdicts:
        v.evidence["extension"] = {"rounds": rounds, "budget": budget, "stopped": stopped}
        if undecided(v) and rounds:
            v.reason += f" (after {rounds} extension(s); {stopped})"
    return verdicts


def repeat_until_decided(judge_all: Callable[[], Sequence[Verdict]], repeat: Callable[[int], object],
                         count: Callable[[], int], *, first: int, most: int, noun: str) -> list[Verdict]:
    """The common case of :func:`measure_until_decided` for repeated measurements: ``repeat(k)``
    makes k more, ``count()`` says how many there are; at least ``first`` before judging, then
    more (at least 2 at a time) while a verdict straddles, never beyond ``most``."""
    if count() < first:
        repeat(first - count())

    def more(wanted: int) -> bool:
        have = count()
        if have >= most:
            return False
        repeat(min(most - have, max(wanted, 2)))
        return count() > have   # no progress (e.g. nothing measurable any more): stop, never loop

    return measure_until_decided(judge_all, more, budget=f"at most {most} {noun}")
