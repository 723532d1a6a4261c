"""GPU memory faults through the engine's admin API: HBM fill and ECC poisoning.

``HbmFill`` makes a decode worker reserve a share of its KV block pool (on CUDA also that many
bytes of real device memory), as if another tenant took the HBM; it is verified by the worker's
``kv_used_ratio`` in ``GET /admin/workers`` reaching the share, and reverted by releasing exactly
those blocks. ``EccPoison`` marks physical KV blocks poisoned (blocks of running requests first,
so the fault bites): a worker that handles ECC quarantines them and recomputes the requests that
used them. It is verified by ``kv_blocks_poisoned`` (the blocks' memory is bad: the injection took
effect, whatever the engine does about it; ``kv_blocks_quarantined`` is what the ECC check judges)
and reverted by returning the blocks (the "replaced page").

What these exercise, honestly labelled (REFERENCE.md): the ENGINE's reaction to memory pressure
and to bad pages, through the same hooks a real node agent would drive. They do not make a GPU
report an ECC error; on a real cluster point ``admin_url`` at an engine that serves these hooks.
The fault id is sent to the router, so a later process can revert from the ledger alone.
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
POLL_S = 0.1  # polling the admin API while a heartbeat carries the new state


@dataclass
class AdminFault(Fault):
    """Shared plumbing of the two admin-API faults (not a fault kind itself)."""

    admin_url: str
    worker_id: str
    host: str = "localhost"
    timeout_s: float = 10.0
    fault_id: str = field(default_factory=new_fault_id)
    reply: dict = field(default_factory=dict)   # the worker's fault_state after inject
    revert_reply: dict = field(default_factory=dict)  # and after the revert

    endpoint: ClassVar[str]

    def __post_init__(self) -> None:
        if not self.admin_url.startswith(("http://", "https://")):
            raise ConfigError(f"{self.kind}: admin_url must be an http(s) URL, got {self.admin_url!r}",
                              fix="pass the router's base URL, e.g. cluster.admin_url")
        self.admin_url = self.admin_url.rstrip("/").removesuffix("/admin")
        if not self.worker_id:
            raise ConfigError(f"{self.kind}: worker_id is required", fix="target a decode worker by id")
        if self.timeout_s <= 0:
            raise ConfigError(f"{self.kind}: timeout_s must be > 0", fix="pass a positive timeout")

    @property
    def target(self) -> str:
        return f"{self.worker_id} via {self.admin_url}/admin"

    def _call(self, method: str, path: str, body: dict | None = None, *, ok_404: bool = False) -> dict | list | None:
        """One admin call through the typed client, as the engine's JSON (the reply goes to the ledger)."""
        from harness.engine.admin.client import AdminClient, AdminError

        try:
            with AdminClient(self.admin_url, timeout_s=HTTP_TIMEOUT_S) as admin:
                return admin.request(method, path, body)
        except AdminError as exc:
            if exc.status == 404 and ok_404:
                return None
            raise FaultError(f"{self.kind}: {exc}", fix="see the router's log; the engine must serve the "
                                                        "resilience admin API (docs/pd.md)") from exc
        except HarnessError as exc:  # transport: the router did not answer
            raise FaultError(f"{self.kind}: {method} {self.admin_url}/admin{path} failed: {exc}",
                             fix="check that the router is up") from exc

    def worker(self) -> dict[str, Any]:
        for w in self._call("GET", "/workers") or []:
            if w.get("id") == self.worker_id:
                return w
        raise FaultError(f"{self.kind}: worker {self.worker_id} is not in the router's table",
                         fix="refresh the worker list and retarget")

    def _wait(self, what: str, done) -> dict[str, Any]:
        try:  # heartbeats carry the worker's state to the router's table
            return wait_until(self.worker, self.timeout_s, POLL_S, what=f"{what} on {self.worker_id}", accept=done)
        except WaitTimeoutError as exc:
            raise FaultError(f"{self.kind}: {what} not seen on {self.worker_id} within {self.timeout_s:.0f} s "
                             f"(worker reports {_brief(self.worker())})", fix="see the worker's log") from exc

    def prepare(self, ex: Executor) -> str:
        w = self.worker()
        if w.get("role") != WorkerRole.DECODE or w.get("health") != WorkerHealth.HEALTHY:
            raise FaultError(f"{self.kind}: {self.worker_id} is not a healthy decode worker ({_brief(w)})",
                             fix="target a healthy decode worker")
        return f"{self.worker_id} before the fault: {_brief(w)}"

    def _state(self) -> dict[str, Any] | None:
        for f in self._call("GET", "/faults") or []:
            if f.get("fault_id") == self.fault_id:
                return f
        return None

    def revert(self, ex: Executor) -> str:
        reply = self._call("DELETE", f"/faults/{self.endpoint}/{self.fault_id}", ok_404=True)
        if reply is None:
            return f"the router knows no fault {self.fault_id} (restarted?): nothing held any more"
        self.revert_reply = dict(reply) if isinstance(reply, dict) else {}
        return f"released: {json.dumps(_strip(reply))}"

    def verify_reverted(self, ex: Executor) -> str:
        state = self._state()
        if state is not None and state.get("active"):
            raise FaultError(f"{self.kind}: fault {self.fault_id} on {self.worker_id} is still active after the revert",
                             fix=f"DELETE {self.admin_url}/admin/faults/{self.endpoint}/{self.fault_id} by hand")
        return f"fault {self.fault_id} is inactive on {self.worker_id}"

    def _plan(self, body: dict, verify: str, revert_verify: str) -> list[str]:
        base = f"{self.admin_url}/admin"
        return [f"prepare: GET {base}/workers  # {self.worker_id} must be a healthy decode worker",
                f"inject: POST {base}/faults/{self.endpoint} {json.dumps(body)}",
                f"verify: GET {base}/workers  # {verify}",
                f"revert: DELETE {base}/faults/{self.endpoint}/{self.fault_id}",
                f"verify_reverted: GET {base}/faults  # {revert_verify}"]


@dataclass
class HbmFill(AdminFault):
    """Reserve ``share`` of a decode worker's KV pool; verified by its kv_used_ratio."""

    kind: ClassVar[str] = "hbm_fill"
    endpoint: ClassVar[str] = "hbm_fill"
    share: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.share, bool) or not isinstance(self.share, (int, float)) or not 0 < self.share < 1:
            raise ConfigError(f"hbm_fill: share must be in (0, 1), got {self.share!r}", fix="pass e.g. share=0.9")

    def inject(self, ex: Executor) -> str:
        self.reply = self._call("POST", "/faults/hbm_fill", {"worker": self.worker_id, "share": self.share,
                                                             "fault_id": self.fault_id})
        if self.reply.get("error") or not self.reply.get("active"):
            raise FaultError(f"hbm_fill: {self.worker_id} refused: {self.reply.get('error') or self.reply}",
                             fix="target a worker with free KV blocks")
        return f"{self.worker_id} holds {self.reply.get('blocks')} KV blocks ({json.dumps(_strip(self.reply))})"

    def verify(self, ex: Executor) -> str:
        held = int(self.reply.get("blocks") or 0)
        wanted = int(self.reply.get("requested_blocks") or held)
        if held <= 0 or held < 0.9 * wanted:
            raise FaultError(f"hbm_fill: {self.worker_id} holds {held} of the {wanted} blocks asked for: the pool "
                             "had too little free KV", fix="fill an idle worker, or a smaller share")
        floor = self.share * held / max(wanted, 1) - 0.02  # block rounding
        w = self._wait(f"kv_used_ratio >= {floor:.3f}", lambda w: float(w.get("kv_used_ratio", 0)) >= floor)
        return f"{self.worker_id} kv_used_ratio {float(w['kv_used_ratio']):.3f} >= {floor:.3f} ({held} blocks held)"

    def plan(self) -> list[str]:
        return self._plan({"worker": self.worker_id, "share": self.share, "fault_id": self.fault_id},
                          f"kv_used_ratio >= {self.share} within {self.timeout_s:.0f} s",
                          "the fault is inactive (its blocks are back in the free list)")


@dataclass
class EccPoison(AdminFault):
    """Poison ``count`` KV blocks of a decode worker; verified by its kv_blocks_poisoned."""

    kind: ClassVar[str] = "ecc_poison"
    endpoint: ClassVar[str] = "ecc_poison"
    count: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ConfigError(f"ecc_poison: count must be a positive integer, got {self.count!r}", fix="pass count=1")

    def inject(self, ex: Executor) -> str:
        self.reply = self._call("POST", "/faults/ecc_poison", {"worker": self.worker_id, "count": self.count,
                                                               "fault_id": self.fault_id})
        if self.reply.get("error") or not self.reply.get("blocks"):
            raise FaultError(f"ecc_poison: {self.worker_id} refused: {self.reply.get('error') or self.reply}",
                             fix="poison while the worker decodes, or name free blocks")
        handling = "recomputing" if self.reply.get("ecc_handling", True) else "ECC handling off, still serving"
        return (f"{self.worker_id}: blocks {self.reply['blocks']} poisoned, {handling} "
                f"{self.reply.get('affected') or 'no request'}")

    def verify(self, ex: Executor) -> str:
        n = len(self.reply.get("blocks") or [])
        w = self._wait(f"kv_blocks_poisoned >= {n}", lambda w: int(w.get("kv_blocks_poisoned", 0)) >= n)
        return (f"{self.worker_id} reports {w['kv_blocks_poisoned']} poisoned block(s) (>= {n}), "
                f"{w.get('kv_blocks_quarantined', '?')} quarantined")

    def revert_seen(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the router's table shows the revert: a heartbeat sent
        after the worker's clear (``kv_blocks_poisoned`` down to its reply's count). Until then the
        table still shows this poisoning, and a next one's ``verify`` would pass on it, reading this
        one's blocks as its own (issue 33). False if not seen, or nothing to wait for."""
        want = self.revert_reply.get("kv_blocks_poisoned")
        if want is None:
            return False
        try:
            wait_until(self.worker, timeout_s, POLL_S, what=f"the revert of {self.fault_id} on {self.worker_id}",
                       accept=lambda w: int(w.get("kv_blocks_poisoned", 0)) <= int(want))
        except (WaitTimeoutError, FaultError):
            return False
        return True

    def plan(self) -> list[str]:
        return self._plan({"worker": self.worker_id, "count": self.count, "fault_id": self.fault_id},
                          f"kv_blocks_poisoned >= {self.count} within {self.timeout_s:.0f} s",
                          "the fault is inactive (its blocks are back, zeroed)")


def _brief(w: dict[str, Any]) -> str:
    keys = ("role", "health", "kv_used_ratio", "kv_blocks_used", "kv_blocks_total", "kv_blocks_poisoned",
            "kv_blocks_quarantined")
    return ", ".join(f"{k}={w.get(k)}" for k in keys if k in w)


def _strip(reply: Any) -> Any:
    return {k: v for k, v in reply.items() if k not in ("type",)} if isinstance(reply, dict) else reply


__all__ = ["EccPoison", "HbmFill"]
