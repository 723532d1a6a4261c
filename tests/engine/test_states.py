"""harness/states.py: the shared states are their wire strings (JSON, comparisons, f-strings), so the
admin API and the event log read the same before and after the enums."""

from __future__ import annotations

import json

import pytest

from harness.states import PD_ROLES, EventKind, TransferEventKind, WorkerHealth, WorkerRole


def test_members_are_their_strings_on_the_wire():
    row = {"health": WorkerHealth.DEAD, "role": WorkerRole.DECODE, "type": EventKind.WORKER_DOWN}
    assert json.loads(json.dumps(row)) == {"health": "dead", "role": "decode", "type": "worker_down"}
    assert f"{WorkerRole.PREFILL}-0" == "prefill-0" and WorkerHealth("healthy") is WorkerHealth.HEALTHY


def test_the_engine_runs_only_the_two_halves():
    assert PD_ROLES == ("prefill", "decode") and "aggregated" not in PD_ROLES


@pytest.mark.parametrize("kind", list(TransferEventKind))
def test_every_transfer_event_has_its_event_log_kind(kind):
    assert EventKind.of_transfer(kind) == f"transfer_{kind}"


def test_an_unknown_transfer_event_is_refused():
    with pytest.raises(ValueError):
        EventKind.of_transfer("teleport")
