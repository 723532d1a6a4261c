"""Cluster mutations that are not failures but still change the cluster, as fault kinds: they go
through the FaultRunner, so they are checked against the cluster's safety rules before anything
is touched, written to the ledger before they happen, and undone on every way out (a SIGKILLed
run's change is undone by the next run or ``python -m harness revert``).

- ``SpeculativeDecoding``: ``POST /admin/speculative {enabled}``; ``prepare`` records every decode
  worker's ``spec_enabled`` (stored in the ledger), the revert puts that setting back.
- ``LiveMigration``: ``POST /admin/migrate {source, rid?, target?}``; the stream moves for good (a
  migration is not undone by moving it back), so the revert makes sure no migration is left in
  flight (``migrating`` of ``GET /admin/degradation`` is 0): nothing is left half-moved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness.errors import ConfigError, FaultError, HarnessError
from harness.faults.base import Fault
from harness.ids import new_fault_id
from harness.hosts import Executor
from harness.waiting import WaitTimeoutError, wait_until
from harness.states import WorkerHealth, WorkerRole

HTTP_TIMEOUT_S = 15.0
POLL_S = 0.1


@dataclass
class _AdminSetting(Fault):
    """Shared plumbing: the router's admin API at ``admin_url`` (not a fault kind itself)."""

    admin_url: str

    def _base(self) -> str:
        return self.admin_url.rstrip("/").removesuffix("/admin")

    def _check_url(self) -> None:
        if not self.admin_url.startswith(("http://", "https://")):
            raise ConfigError(f"{self.kind}: admin_url must be an http(s) URL, got {self.admin_url!r}",
                              fix="pass the router's base URL, e.g. cluster.admin_url")
        self.admin_url = self._base()
        if self.timeout_s <= 0:  # type: ignore[attr-defined]
            raise ConfigError(f"{self.kind}: timeout_s must be > 0", fix="pass a positive timeout")

    def _get(self, path: str) -> Any:
        """``GET /admin{path}`` through the typed admin client, as plain JSON (it goes to the ledger)."""
        from harness.engine.admin.client import AdminClient

        try:
            with AdminClient(self.admin_url, timeout_s=HTTP_TIMEOUT_S) as admin:
                if path == "/workers":
                    return [dict(w.raw) for w in admin.workers()]
                if path == "/degradation":
                    return dict(admin.degradation().raw)
        except HarnessError as exc:
            raise FaultError(f"{self.kind}: GET {self.admin_url}/admin{path} failed: {exc}",
                             fix="check that the router is up and serves the resilience admin API (docs/pd.md)") from exc
        raise ValueError(f"no typed admin call for {path}")

    def _wait(self, what: str, done: Any, read: Any) -> Any:
        try:  # a heartbeat carries the new state to the router's table
            return wait_until(read, self.timeout_s, POLL_S, what=what, accept=done)  # type: ignore[attr-defined]
        except WaitTimeoutError as exc:
            raise FaultError(f"{self.kind}: {exc}", fix="see the router's log") from exc


@dataclass
class SpeculativeDecoding(_AdminSetting):
    """Speculative decoding on (or off) on every decode worker; reverted to what each had before."""

    kind: ClassVar[str] = "speculative_decoding"
    enabled: bool = True
    host: str = "localhost"
    timeout_s: float = 10.0
    before: dict = field(default_factory=dict)   # worker id -> spec_enabled, filled by prepare()
    fault_id: str = field(default_factory=new_fault_id)

    def __post_init__(self) -> None:
        self._check_url()
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{self.kind}: enabled must be true or false, got {self.enabled!r}",
                              fix="pass enabled=True or enabled=False")

    @property
    def target(self) -> str:
        return f"speculative decoding {'on' if self.enabled else 'off'} via {self.admin_url}/admin"

    def _settings(self) -> dict[str, bool]:
        return {w["id"]: bool(w.get("spec_enabled")) for w in self._get("/workers") or []
                if w.get("role") == WorkerRole.DECODE and w.get("health") == WorkerHealth.HEALTHY}

    def _set(self, enabled: bool) -> str:
        from harness.engine.admin.client import AdminClient

        try:
            with AdminClient(self.admin_url, timeout_s=HTTP_TIMEOUT_S) as admin:
                admin.set_speculative(enabled)
        except HarnessError as exc:
            raise FaultError(f"{self.kind}: POST {self.admin_url}/admin/speculative failed: {exc}",
                             fix="check that the router is up and serves POST /admin/speculative (docs/pd.md)") from exc
        return f"POST /admin/speculative enabled={str(enabled).lower()}"

    @property
    def restore(self) -> bool:
        """The setting the revert puts back (the API switches every worker at once)."""
        return any(self.before.values())

    def prepare(self, ex: Executor) -> str:
        self.before = self._settings()
        if not self.before:
            raise FaultError(f"{self.kind}: no healthy decode worker reports spec_enabled",
                             fix="start the cluster first; the engine must report spec_enabled in /admin/workers")
        return f"before: {json.dumps(self.before, sort_keys=True)}"

    def inject(self, ex: Executor) -> str:
        return self._set(self.enabled)

    def verify(self, ex: Executor) -> str:
        want = self.enabled
        got = self._wait(f"spec_enabled={want} on {sorted(self.before)}",
                         lambda s: all(s.get(w) == want for w in self.before if w in s), self._settings)
        return f"spec_enabled: {json.dumps(got, sort_keys=True)}"

    def revert(self, ex: Executor) -> str:
        return self._set(self.restore)

    def _level(self) -> int:
        return int((self._get("/degradation") or {}).get("level", 0))

    def verify_reverted(self, ex: Executor) -> str:
        want = self.restore

        def back(settings: dict[str, bool]) -> bool:
            # Level 2 and above hold speculative decoding off by the cluster's own choice (and
            # restore it on the way down): that is the cluster acting, not this revert failing
            return all(v == want for v in settings.values()) or (want and self._level() >= 2)

        got = self._wait(f"spec_enabled={want} again", back, self._settings)
        if not all(v == want for v in got.values()):
            return (f"speculative decoding set back to {want}; the cluster's degradation level (>= 2) holds it off "
                    f"for now: {json.dumps(got, sort_keys=True)}")
        return f"spec_enabled back to {want}: {json.dumps(got, sort_keys=True)}"

    def plan(self) -> list[str]:
        base = f"{self.admin_url}/admin"
        return [f"prepare: GET {base}/workers  # record each decode worker's spec_enabled",
                f"inject: POST {base}/speculative {json.dumps({'enabled': self.enabled})}",
                f"verify: GET {base}/workers  # every decode worker reports spec_enabled={self.enabled}",
                f"revert: POST {base}/speculative {{\"enabled\": <what the workers had before>}}",
                f"verify_reverted: GET {base}/workers  # spec_enabled is what it was before"]


@dataclass
class LiveMigration(_AdminSetting):
    """Live-migrate one decoding request off ``source``; ``reply`` is the router's migration_done
    event. Refusals raise the admin client's :class:`~harness.engine.admin.client.AdminError` (status,
    code, param) so a caller can tell "too late" from "the engine failed"."""

    kind: ClassVar[str] = "live_migration"
    source: str = ""
    rid: str | None = None
    target_worker: str | None = None
    host: str = "localhost"
    timeout_s: float = 60.0
    reply: dict = field(default_factory=dict)
    fault_id: str = field(default_factory=new_fault_id)

    def __post_init__(self) -> None:
        self._check_url()
        if not self.source:
            raise ConfigError(f"{self.kind}: source is required", fix="name the decode worker to migrate off")

    @property
    def target(self) -> str:
        what = self.rid or "a request"
        return f"{what} off {self.source}{' to ' + self.target_worker if self.target_worker else ''}"

    def _ours_in_flight(self) -> list[dict]:
        """The in-flight migrations this fault started: the request it moved (the router's answer
        names it; else the ``rid`` it asked for) or, when neither is known (the call failed before an
        answer), any migration the admin API started off ``source``. Migrations the cluster starts by
        itself (health, degradation, drain) are not this fault's to wait for: they are evidence."""
        state = self._get("/degradation") or {}
        flights = state.get("migrations_in_flight")
        if flights is None:  # an engine without the list: only the count, which cannot tell whose
            n = int(state.get("migrating", 0))
            return [{"request_id": "?", "reason": "unknown"}] * n
        rid = self.reply.get("request_id") or self.rid
        if rid:
            return [m for m in flights if m.get("request_id") == rid]
        return [m for m in flights if m.get("source") == self.source and m.get("reason") == "admin"]

    def inject(self, ex: Executor) -> str:
        from harness.engine.admin.client import AdminClient

        with AdminClient(self.admin_url, timeout_s=self.timeout_s) as admin:
            self.reply = dict(admin.migrate(self.source, rid=self.rid, target=self.target_worker).raw)
        return f"{self.source} -> {self.reply.get('target')} in {self.reply.get('total_s')} s"

    def verify(self, ex: Executor) -> str:
        if self.reply.get("source") not in (None, self.source) or not self.reply.get("target"):
            raise FaultError(f"{self.kind}: the router's answer names no migration off {self.source}: {self.reply}",
                             fix="see the router's log")
        return f"migration_done: {self.reply.get('source', self.source)} -> {self.reply['target']}"

    def revert(self, ex: Executor) -> str:
        if self.reply.get("target"):  # the router answered migration_done: this migration has ended
            return f"the stream stays where it was moved ({self.reply.get('request_id')} on {self.reply['target']})"
        left = self._wait("this fault's migration to end", lambda ours: not ours, self._ours_in_flight)
        return f"the stream stays where it is; {len(left)} migration(s) of this fault in flight"

    def verify_reverted(self, ex: Executor) -> str:
        if self.reply.get("target"):
            return f"migration {self.reply.get('request_id')} ended (migration_done)"
        ours = self._ours_in_flight()
        if ours:
            raise FaultError(f"{self.kind}: {len(ours)} migration(s) this fault started still in flight: "
                             f"{', '.join(str(m.get('request_id')) for m in ours)}", fix="see the router's log")
        return "none of this fault's migrations in flight"

    def plan(self) -> list[str]:
        base = f"{self.admin_url}/admin"
        body = {"source": self.source, **({"rid": self.rid} if self.rid else {}),
                **({"target": self.target_worker} if self.target_worker else {})}
        return [f"inject: POST {base}/migrate {json.dumps(body)}",
                "verify: the answer is the router's migration_done event",
                f"revert: GET {base}/degradation  # wait until this fault's migration (by request id) is not in "
                "flight; a move is not undone, and migrations the cluster starts itself are not waited for",
                f"verify_reverted: GET {base}/degradation  # this fault's request id not in migrations_in_flight"]


__all__ = ["LiveMigration", "SpeculativeDecoding"]
