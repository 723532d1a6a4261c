"""What the reliability tests read from the machine, independently of the code under test."""

from __future__ import annotations

import os


def marked_processes(name: str, value: str) -> list[str]:
    """Live processes (not zombies) whose environment holds ``name=value``: "pid N state S"."""
    token = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if token not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry.name}/stat") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(f"pid {entry.name} state {state}")
    return found
