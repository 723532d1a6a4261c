"""Identifiers shared across packages (faults, the engine's fault hooks), kept here so neither
has to import the other for a one-line id."""

from __future__ import annotations

import uuid


def new_fault_id() -> str:
    """A fault's id: the key of its ledger record and of the engine hook that holds its state."""
    return uuid.uuid4().hex[:12]


__all__ = ["new_fault_id"]
