"""A worker's recent-window health inputs for the router's detector (seed Section 5.2).

The detector compares trends of TPOT p99, queue depth, HBM use and the transfer retransmission
rate between heartbeats. TPOT here is measured from this worker's own token events: the gap
between two events of one request divided by the tokens the later one carries (a speculative
step emits several). The retransmission rate is (sender retries + frames the receiver rejected)
per frame moved, over the same window.
"""

from __future__ import annotations

import math
import time
from collections import deque


class RecentWindow:
    def __init__(self, window_s: float = 10.0, max_samples: int = 4096) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError("window_s and max_samples must be positive")
        self.window_s = window_s
        self._tpot: deque[tuple[float, float]] = deque(maxlen=max_samples)   # (t, seconds per token)
        self._last_event: dict[str, float] = {}
        self._transfer: deque[tuple[float, float, float]] = deque()          # (t, retransmits, frames)

    def on_tokens(self, rid: str, num_tokens: int, finished: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        last = self._last_event.get(rid)
        if last is not None and num_tokens > 0:
            self._tpot.append((now, (now - last) / num_tokens))
        if finished:
            self._last_event.pop(rid, None)
        elif num_tokens > 0:
            self._last_event[rid] = now

    def forget(self, rid: str) -> None:
        """The request left this worker (migrated away, aborted)."""
        self._last_event.pop(rid, None)

    def tpot_p99_ms(self, now: float | None = None) -> float:
        """p99 of seconds-per-token over the window, in ms; 0.0 with no samples."""
        now = time.monotonic() if now is None else now
        while self._tpot and self._tpot[0][0] < now - self.window_s:
            self._tpot.popleft()
        if not self._tpot:
            return 0.0
        values = sorted(v for _, v in self._tpot)
        return 1000.0 * values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]

    def retrans_rate(self, transfer_snapshot: dict, now: float | None = None) -> float:
        """Retransmissions per frame since the oldest sample in the window (TransferStats.snapshot())."""
        now = time.monotonic() if now is None else now
        paths = transfer_snapshot.get("paths", {}).values()
        retrans = sum(p.get("retries", 0) for p in paths) + sum(transfer_snapshot.get("rejected", {}).values())
        frames = sum(p.get("frames", 0) for p in paths) + transfer_snapshot.get("received", {}).get("frames", 0)
        self._transfer.append((now, float(retrans), float(frames)))
        while len(self._transfer) > 1 and self._transfer[0][0] < now - self.window_s:
            self._transfer.popleft()
        t0, r0, f0 = self._transfer[0]
        return (retrans - r0) / (frames - f0) if frames > f0 else 0.0
