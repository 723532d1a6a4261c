"""The bundled engine's admin API: one typed client (``AdminClient``) and a worker-table poller.

``GET /admin/workers`` lists each worker (id, role, pid, health, queue depth, KV blocks);
``GET /admin/events`` lists what the router saw (worker down/up, reschedules, retries,
fallbacks) with wall-clock and monotonic times; the resilience endpoints read the degradation
state, switch speculative decoding, migrate and drain, and hold the HBM-fill and ECC-poison fault
hooks. Results are typed (harness/engine/admin/models.py). A ``WorkerPoller`` snapshots the
worker table in the background during a run, so a report can show who was healthy when.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from harness.errors import ProbeError
from harness.engine.admin.models import (AdminWorker, DegradationState, DrainResult, EngineEvent, FaultState,
                                         MigrationResult, R, event_list)
from harness.urls import http_url

log = logging.getLogger(__name__)


class AdminError(ProbeError):
    """The admin API answered a request with an error status (the engine refused what was asked, or
    the endpoint does not exist): ``endpoint`` ("POST http://.../admin/migrate"), ``status``, and
    the engine's own ``message``, ``code`` and ``param`` when it sent them."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 endpoint: str = "", fix: str = "see the router's log") -> None:
        where = f"{endpoint} answered " if endpoint else ""
        super().__init__(f"{where}HTTP {status}: {message}", fix=fix)
        self.status, self.message, self.code, self.param, self.endpoint = status, message, code, param, endpoint


def _refusal(resp: httpx.Response) -> tuple[str, str | None, str | None]:
    """The engine's error body ({"error": {message, code, param}}), else the start of the text."""
    try:
        err = resp.json()["error"]
        return str(err["message"]), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError):
        return resp.text[:300], None, None


class AdminClient:
    """The bundled engine's admin API (docs/pd.md), one typed method per endpoint the harness uses.
    ``base_url`` is the router's address or its ``/admin`` prefix (``Topology.admin_url``); both work.

    Errors name the endpoint: a transport failure is a ProbeError ("GET http://.../admin/workers
    failed: ..."), an error status an :class:`AdminError` carrying the status and the engine's
    message, code and param; a 200 answer that is not what the bundled engine sends is a ProbeError
    naming the field."""

    def __init__(self, base_url: str, *, timeout_s: float = 5.0) -> None:
        base = http_url(base_url, "admin URL")
        self.base_url = base if base.endswith("/admin") else base + "/admin"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def _call(self, method: str, path: str, *, params: dict | None = None, body: Any = None,
              timeout_s: float | None = None) -> Any:
        endpoint = f"{method} {self.base_url}{path}"
        extra = {} if timeout_s is None else {"timeout": timeout_s}
        try:
            resp = self._http.request(method, path, params=params, json=body, **extra)
        except httpx.HTTPError as exc:
            raise ProbeError(f"{endpoint} failed: {type(exc).__name__}: {exc}", fix="check the router is up") from exc
        if resp.status_code == 404 and path in ("/workers", "/events", "/degradation", "/faults"):
            raise AdminError(404, "no such endpoint", endpoint=endpoint,
                             fix="the admin API is served by the bundled engine's PD router, not by a "
                                 "single-process server or a foreign engine")
        if resp.status_code != 200:
            message, code, param = _refusal(resp)
            raise AdminError(resp.status_code, message, code=code, param=param, endpoint=endpoint)
        try:
            return resp.json()
        except ValueError as exc:
            raise ProbeError(f"{endpoint} answered 200 with no JSON: {resp.text[:200]!r}",
                             fix="point the admin URL at the bundled engine's PD router") from exc

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Any admin call as plain JSON (``path`` under /admin), with this client's errors
        (:class:`AdminError` naming the endpoint and status): for callers that keep the engine's
        reply as it is, e.g. a fault hook's refusal carrying an ``error`` field, or the ledger."""
        return self._call(method, path, body=body)

    def _list(self, cls: type[R], path: str, key: str, **kw: Any) -> list[R]:
        payload = self._call("GET", path, **kw)
        items = payload.get(key) if isinstance(payload, dict) else payload
        if not isinstance(items, list):
            raise ProbeError(f"GET {self.base_url}{path} did not return a list (got {type(items).__name__})",
                             fix="point the admin client at the PD router's base URL")
        return [cls.parse(x, f"GET {self.base_url}{path}") for x in items]

    # -- reading
    def workers(self) -> list[AdminWorker]:
        """``GET /admin/workers``: every worker the router knows, healthy or not."""
        return self._list(AdminWorker, "/workers", "workers")

    def worker(self, worker_id: str) -> AdminWorker | None:
        """One row of ``workers()``; None when the router does not know ``worker_id``."""
        return next((w for w in self.workers() if w.id == worker_id), None)

    def events(self, since: int = 0, type: str | None = None) -> list[EngineEvent]:  # noqa: A002 (the API's name)
        """``GET /admin/events``: the router's events after ``since`` (a seq), oldest first, only
        those of ``type`` when given."""
        params: dict[str, Any] = {"since": since} if since else {}
        if type is not None:
            params["type"] = type
        return event_list(self._call("GET", "/events", params=params or None), f"GET {self.base_url}/events")

    def degradation(self) -> DegradationState:
        """``GET /admin/degradation``: level, thresholds, signals, history, counters."""
        return DegradationState.parse(self._call("GET", "/degradation"), f"GET {self.base_url}/degradation")

    def faults(self) -> list[FaultState]:
        """``GET /admin/faults``: the HBM-fill and ECC-poison faults the router knows and their last state."""
        return self._list(FaultState, "/faults", "faults")

    def config(self) -> dict[str, Any]:
        """``GET /admin/config``: the router's RouterConfig as JSON."""
        return self._call("GET", "/config")

    # -- acting
    def set_speculative(self, enabled: bool) -> bool:
        """``POST /admin/speculative``: speculative decoding on or off on every worker."""
        return bool(self._call("POST", "/speculative", body={"enabled": bool(enabled)})["enabled"])

    def migrate(self, source: str, *, rid: str | None = None, target: str | None = None) -> MigrationResult:
        """``POST /admin/migrate``: live-migrate one decoding request off ``source`` (the one named by
        ``rid``, else the engine's choice); returns the router's ``migration_done`` event. A refusal
        raises :class:`AdminError` with its status, code and param."""
        body = {"source": source, **({"rid": rid} if rid else {}), **({"target": target} if target else {})}
        return MigrationResult.parse(self._call("POST", "/migrate", body=body), f"POST {self.base_url}/migrate")

    def drain(self, worker: str, *, timeout_s: float = 60.0) -> DrainResult:
        """``POST /admin/drain``: migrate everything off a decode worker and keep it out of placement."""
        return DrainResult.parse(self._call("POST", "/drain", body={"worker": worker}, timeout_s=timeout_s),
                                 f"POST {self.base_url}/drain")

    def undrain(self, worker: str) -> dict[str, Any]:
        """``DELETE /admin/drain/{worker}``: put a drained worker back into placement."""
        return self._call("DELETE", f"/drain/{worker}")

    def hbm_fill(self, worker: str, share: float, *, fault_id: str | None = None) -> FaultState:
        """``POST /admin/faults/hbm_fill``: reserve ``share`` of the worker's KV pool."""
        body = {"worker": worker, "share": share, **({"fault_id": fault_id} if fault_id else {})}
        return FaultState.parse(self._call("POST", "/faults/hbm_fill", body=body),
                                f"POST {self.base_url}/faults/hbm_fill")

    def ecc_poison(self, worker: str, *, count: int | None = None, blocks: list[int] | None = None,
                   fault_id: str | None = None) -> FaultState:
        """``POST /admin/faults/ecc_poison``: poison ``count`` KV blocks (or exactly ``blocks``)."""
        body: dict[str, Any] = {"worker": worker, **({"fault_id": fault_id} if fault_id else {})}
        body.update({"blocks": blocks} if blocks is not None else {"count": 1 if count is None else count})
        return FaultState.parse(self._call("POST", "/faults/ecc_poison", body=body),
                                f"POST {self.base_url}/faults/ecc_poison")

    def release_fault(self, kind: str, fault_id: str) -> FaultState:
        """``DELETE /admin/faults/{kind}/{fault_id}`` (kind: hbm_fill or ecc_poison); idempotent."""
        if kind not in ("hbm_fill", "ecc_poison"):
            raise ProbeError(f"no fault kind {kind!r} on the admin API", fix="use hbm_fill or ecc_poison")
        return FaultState.parse(self._call("DELETE", f"/faults/{kind}/{fault_id}"),
                                f"DELETE {self.base_url}/faults/{kind}/{fault_id}")

    def set_transfer(self, settings: dict[str, Any]) -> dict[str, Any]:
        """``POST /admin/transfer``: KV transfer settings (TransferConfig fields) for later requests."""
        return self._call("POST", "/transfer", body=settings)

    def worker_fault(self, worker_id: str, **spec: int) -> dict[str, Any]:
        """``POST /admin/workers/{id}/fault``: a worker-side transfer fault (e.g. corrupt_frames=1)."""
        return self._call("POST", f"/workers/{worker_id}/fault", body=spec)

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
    workers: list[AdminWorker] | None   # None: the poll failed
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
