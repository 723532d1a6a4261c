"""Fixtures for the fabric tests: a real emulated fabric (root and iproute2), always torn down and
checked for leftovers, even when the test fails."""

from __future__ import annotations

import fcntl
import os

import pytest

from harness.fabric.builder import SLOT_DIR, Fabric, FabricConfig, fabric_unavailable_reason, leftovers
from harness.fabric.shaping import ShapingSpec

TEST_PREFIX = "pdt-"  # not the bundled cluster's "pdh-": a test never touches a running cluster's fabric


def missing(reason: str) -> None:
    """A requirement of the test is not met here: a skip on a developer's machine, a failure in CI
    (``CI=true``: .ci/run installs and provides everything, so a skip there would hide a gap)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (in CI this is a failure, not a skip)")
    pytest.skip(reason)


def require_fabric() -> None:
    reason = fabric_unavailable_reason()
    if reason:
        missing(reason)


@pytest.fixture
def make_fabric():
    """``make_fabric(hosts=3, **shaping)`` builds a fabric; every one is torn down at the end and
    the test fails if any namespace or link with the test prefix remains."""
    require_fabric()
    built: list[Fabric] = []
    # two test processes on one machine share the test prefix: take turns rather than collide
    SLOT_DIR.mkdir(parents=True, exist_ok=True)
    lock = open(SLOT_DIR / "tests.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)

    def make(hosts: int = 3, **shaping) -> Fabric:
        fabric = Fabric(FabricConfig(hosts=hosts, prefix=TEST_PREFIX, shaping=ShapingSpec(**shaping),
                                     fabric_subnet="198.18.11.0/24", control_subnet="198.18.12.0/24"))
        built.append(fabric)
        return fabric.setup()

    try:
        yield make
    finally:
        try:
            for fabric in built:
                fabric.teardown()
            assert leftovers(prefix=TEST_PREFIX) == []
        finally:
            lock.close()
