"""The rejoin watch's own requests (harness/probes/workers/rejoin.py): one short completion at a time sent
straight to a worker's API after its revert, until one gets a token: the worker serves requests sent
after the revert. Only for a worker with an API of its own (:func:`own_api`): one behind the cluster's
API (a Dynamo mocker) cannot be addressed alone."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

PROBE_TIMEOUT_S = 60.0    # one probe's whole time: a worker still draining its queue answers it late, not never

# (sent wall, first token wall or None, why it got no token or None): one request sent straight to the worker
Probe = Callable[[], "tuple[float, float | None, str | None]"]


class ProbeLoop:
    """Requests sent straight to the worker, one at a time from ``start`` on, until one gets a token."""

    def __init__(self, probe: Probe, pause_s: float, kept: Callable[[str], None]) -> None:
        self.probe, self.pause_s, self.kept = probe, pause_s, kept
        self.sent, self.served = 0, None   # served: (sent wall, first token wall) of the first with a token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rejoin-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sent += 1
            try:
                sent, first, why = self.probe()
            except Exception as exc:  # noqa: BLE001 - a probe that cannot be sent is evidence, never a crash
                sent, first, why = time.time(), None, f"{type(exc).__name__}: {exc}"
            if first is not None:
                self.served = (sent, first)   # set once the probe's request has ended: its counts are in
                return
            self.kept(f"probe sent at {time.strftime('%H:%M:%S', time.localtime(sent))}: {why}")
            self._stop.wait(self.pause_s)

    def stop(self) -> None:
        self._stop.set()


def own_api(cluster: Any, worker: Any) -> bool:
    """Does ``worker`` have an API of its own (neither the cluster's nor another worker's URL)?"""
    def norm(url: Any) -> str:
        return str(url or "").rstrip("/")
    mine = norm(worker.api)
    others = [norm(w.api) for w in cluster.workers if str(w.name) != str(worker.name)]
    return bool(mine) and mine != norm(cluster.api_url) and mine not in others


def straight_probe(cluster: Any, worker: Any, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """One short completion sent straight to ``worker``'s API, with the cluster's model, key and shape."""
    from harness.probes.client.request_shape import request_shape
    from harness.probes.client.streaming import CompletionRequest, StreamingClient

    def probe() -> tuple[float, float | None, str | None]:
        sent = time.time()
        with StreamingClient(str(worker.api), model=cluster.model, api_key=cluster.api_key(), timeout_s=timeout_s,
                             read_timeout_s=timeout_s, user="rejoin-probe",
                             request_shape=request_shape(cluster.engine)) as client:
            rec = client.send(CompletionRequest(prompt="Are you back?", max_tokens=1))
        if rec.first_token_ns is None:
            return sent, None, f"{rec.status}: {rec.error_class or ''} {rec.error_message or ''}".strip()
        return sent, rec.anchor.perf_to_wall(rec.first_token_ns) / 1e9, None
    return probe


__all__ = ["PROBE_TIMEOUT_S", "Probe", "ProbeLoop", "own_api", "straight_probe"]
