"""Per-path KV transfer counters of one worker (sender and receiver side); a snapshot travels in
the worker's heartbeats and feeds its /metrics."""

from __future__ import annotations

import collections
import threading


class TransferStats:
    """Thread-safe per-path counters; ``snapshot()`` is JSON-able and travels in heartbeats."""

    SENDER_FIELDS = ("bytes", "seconds", "frames", "transfers", "retries", "failures", "fallbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._paths: dict[str, dict[str, float]] = {}
        self._rejected: collections.Counter[str] = collections.Counter()
        self._received = {"frames": 0, "bytes": 0}

    def add(self, path: str, **deltas: float) -> None:
        with self._lock:
            counters = self._paths.setdefault(path, dict.fromkeys(self.SENDER_FIELDS, 0))
            for name, value in deltas.items():
                counters[name] += value

    def received(self, nbytes: int) -> None:
        with self._lock:
            self._received["frames"] += 1
            self._received["bytes"] += nbytes

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"paths": {p: dict(c) for p, c in self._paths.items()},
                    "received": dict(self._received), "rejected": dict(self._rejected)}
