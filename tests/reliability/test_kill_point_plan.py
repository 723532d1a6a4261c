"""The kill-point run's default plan (tests/reliability/test_kill_points.py, slow), checked in the quick
half: a change of its seed or point count that stops covering what the run is for fails in minutes,
not at the end of CI's serial half."""

from __future__ import annotations

import pytest

from tests.reliability.test_kill_points import (BASE_KINDS, DEFAULT_POINTS, DEFAULT_SEED, FABRIC_KINDS, PHASES,
                                                SIGNALS, plan)


@pytest.mark.parametrize("fabric", [True, False])
def test_the_default_plan_covers_every_phase_and_signal(fabric):
    """The CI run's 9 points (fixed seed) must still exercise every phase and every signal, with or
    without the fabric, and give every kind a point before its teardown (a teardown point finds the run
    done: test_kill_points_restore_the_machine demands a live signal per kind), with at most one
    teardown. Planted defects: the old seed 3 at 8 points (no point at an active fault, no double
    SIGINT) and seed 78 at 8 points (live_migration's one point at its teardown: the kill-point run
    failed on it, 2026-12-07); this test fails on each (checked)."""
    kinds = BASE_KINDS + (FABRIC_KINDS if fabric else [])
    points = plan(DEFAULT_SEED, DEFAULT_POINTS, kinds)
    assert {p.phase for p in points} == set(PHASES) and {p.signal for p in points} == set(SIGNALS), points
    assert sum(p.phase == "teardown" for p in points) <= 1, points
    assert {p.kind for p in points if p.phase != "teardown"} == set(kinds), points
