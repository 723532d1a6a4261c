"""The PD router's admin API as a probe: worker table snapshots and engine events.

``GET /admin/workers`` lists each worker (id, role, pid, health, queue depth, KV blocks);
``GET /admin/events`` lists what the router saw (worker down/up, reschedules, retries,
fallbacks) with wall-clock and monotonic times. A ``WorkerPoller`` snapshots the worker
table in the background during a run, so a report can show who was healthy when.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from harness.errors import ProbeError
from harness.probes.urls import http_url

log = logging.getLogger(__name__)


class AdminError(ProbeError):
    """The admin API answered a request with an error (the engine refused what was asked)."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 fix: str = "see the router's log") -> None:
        super().__init__(f"HTTP {status}: {message}", fix=fix)
        self.status, self.message, self.code, self.param = status, message, code, param


def _unwrap(payload: Any, key: str) -> list[dict]:
    """Accept a bare JSON list or an object holding it under ``key``."""
    items = payload.get(key) if isinstance(payload, dict) else payload
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ProbeError(f"/admin/{key} did not return a list of objects (got {type(items).__name__})",
                         fix="point the admin client at the PD router's base URL")
    return items


class AdminClient:
    """Reads the router's admin API: ``base_url`` is the router's address or its ``/admin``
    prefix (``Topology.admin_url``); both work."""

    def __init__(self, base_url: str, *, timeout_s: float = 5.0) -> None:
        base = http_url(base_url, "admin URL")
        self.base_url = base if base.endswith("/admin") else base + "/admin"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def _get(self, path: str, params: dict | None = None) -> Any:
        try:
            resp = self._http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise ProbeError(f"GET {self.base_url}{path} failed: {exc}", fix="check the router is up") from exc
        if resp.status_code == 404:
            raise ProbeError(f"{self.base_url}{path} does not exist (404)",
                             fix="the admin API is served by the PD router, not by a single-process server")
        if resp.status_code != 200:
            raise ProbeError(f"GET {self.base_url}{path} answered HTTP {resp.status_code}: {resp.text[:200]}",
                             fix="see the router's log")
        return resp.json()

    def workers(self) -> list[dict]:
        return _unwrap(self._get("/workers"), "workers")

    def events(self, **params: Any) -> list[dict]:
        """The router's events, oldest first (``params`` are passed as query parameters)."""
        return _unwrap(self._get("/events", params or None), "events")

    def migrate(self, source: str, *, rid: str | None = None, target: str | None = None) -> dict:
        """``POST /admin/migrate``: live-migrate one decoding request off ``source`` (the one
        named by ``rid``, else the engine's choice); returns the router's ``migration_done``
        event. An engine refusal raises :class:`AdminError` with its status, code and param."""
        body = {"source": source, **({"rid": rid} if rid else {}), **({"target": target} if target else {})}
        try:
            resp = self._http.post("/migrate", json=body)
        except httpx.HTTPError as exc:
            raise ProbeError(f"POST {self.base_url}/migrate failed: {exc}", fix="check the router is up") from exc
        if resp.status_code != 200:
            try:
                err = resp.json()["error"]
                message, code, param = str(err["message"]), err.get("code"), err.get("param")
            except (ValueError, KeyError, TypeError):
                message, code, param = resp.text[:300], None, None
            raise AdminError(resp.status_code, message, code=code, param=param)
        return resp.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class WorkerSnapshot:
    t_wall_ns: int
    t_mono_ns: int
    workers: list[dict] | None   # None: the poll failed
    error: str | None = None


class WorkerPoller:
    """Snapshots ``/admin/workers`` every ``interval_s`` in a background thread. A failed
    poll is kept as a snapshot with its error (the router may be the fault's target)."""

    def __init__(self, client: AdminClient, interval_s: float = 0.5) -> None:
        if interval_s <= 0:
            raise ProbeError(f"poll interval must be > 0 s, got {interval_s!r}", fix="pass e.g. interval_s=0.5")
        self.client = client
        self.interval_s = interval_s
        self.snapshots: list[WorkerSnapshot] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> WorkerSnapshot:
        t_wall, t_mono = time.time_ns(), time.monotonic_ns()
        try:
            snap = WorkerSnapshot(t_wall, t_mono, self.client.workers())
        except ProbeError as exc:
            snap = WorkerSnapshot(t_wall, t_mono, None, str(exc))
        with self._lock:
            self.snapshots.append(snap)
        return snap

    def start(self) -> WorkerPoller:
        if self._thread is not None:
            raise ProbeError("poller already started", fix="create one poller per run")
        first = self.poll_once()
        if first.workers is None:
            raise ProbeError(f"cannot read the worker table: {first.error}", fix="check the router's admin URL")
        self._thread = threading.Thread(target=self._loop, name="admin-worker-poller", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join()

    def __enter__(self) -> WorkerPoller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
