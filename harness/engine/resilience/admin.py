"""Admin endpoints and Prometheus metrics of the router's resilience control (docs/pd.md).

    GET    /admin/degradation                      level, thresholds, signals, history, counters
    POST   /admin/speculative {enabled}            speculative decoding on/off on every worker
    POST   /admin/migrate {source, rid?, target?}  live-migrate one decoding request
    POST   /admin/drain {worker}                   planned drain: migrate everything off a decode worker
    DELETE /admin/drain/{worker}                   put a drained worker back into placement
    GET    /admin/faults                           HBM-fill and ECC-poison faults and their last state
    POST   /admin/faults/hbm_fill {worker, share}  reserve that share of the worker's KV pool
    DELETE /admin/faults/hbm_fill/{fault_id}
    POST   /admin/faults/ecc_poison {worker, count | blocks}
    DELETE /admin/faults/ecc_poison/{fault_id}
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from harness.engine.resilience.control import ResilienceControl
from harness.engine.serving.metrics import PREFIX
from harness.errors import InvalidRequestError
from harness.ids import new_fault_id
from harness.states import EventKind, WorkerRole



class ResilientRouter(Protocol):
    """What the admin API and the metrics need of the router (``pd.router.Router`` is one; a
    protocol so that resilience does not import the router's package above it)."""
    resilience: ResilienceControl

    async def set_speculative(self, enabled: bool) -> None: ...

    def record_event(self, kind: EventKind, **detail: Any) -> None: ...


async def _body(request: Request, example: str) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"the body must be a JSON object, e.g. {example}")
    return body


def _text(body: dict, key: str, required: bool = True) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{key}' must be a worker or request id string, got {value!r}", param=key)
    return value


def resilience_api(router: ResilientRouter) -> APIRouter:
    api = APIRouter(prefix="/admin")
    control = router.resilience

    @api.get("/degradation")
    async def degradation() -> dict:
        return control.public()

    @api.post("/speculative")
    async def speculative(request: Request) -> dict:
        """Switch speculative decoding on every worker (suites turn it on to watch Level 2 turn it off)."""
        body = await _body(request, '{"enabled": true}')
        if not isinstance(body.get("enabled"), bool):
            raise InvalidRequestError("'enabled' must be true or false", param="enabled")
        await router.set_speculative(body["enabled"])
        router.record_event(EventKind.SPECULATIVE, enabled=body["enabled"])
        return {"enabled": body["enabled"]}

    @api.post("/migrate")
    async def migrate(request: Request) -> dict:
        body = await _body(request, '{"source": "decode-0", "rid": "cmpl-...", "target": "decode-1"}')
        return await control.migration.migrate(_text(body, "source"), _text(body, "rid", False),
                                               _text(body, "target", False), reason="admin")

    @api.post("/drain")
    async def drain(request: Request) -> dict:
        body = await _body(request, '{"worker": "decode-0"}')
        return await control.migration.drain(_text(body, "worker"))

    @api.delete("/drain/{worker}")
    async def undrain(worker: str) -> dict:
        return control.migration.undrain(worker)

    @api.get("/faults")
    async def faults() -> list[dict]:
        return [{"fault_id": fid, **state} for fid, state in control.faults.items()]

    @api.post("/faults/hbm_fill")
    async def hbm_fill(request: Request) -> dict:
        body = await _body(request, '{"worker": "decode-0", "share": 0.9}')
        return await control.hbm_fill(_text(body, "worker"), body.get("share"),
                                      _text(body, "fault_id", False) or new_fault_id())

    @api.delete("/faults/hbm_fill/{fault_id}")
    async def hbm_release(fault_id: str) -> dict:
        return await control.release("hbm_fill", fault_id)

    @api.post("/faults/ecc_poison")
    async def ecc_poison(request: Request) -> dict:
        body = await _body(request, '{"worker": "decode-0", "count": 2}')
        return await control.ecc_poison(_text(body, "worker"), body.get("count", 1), body.get("blocks"),
                                        _text(body, "fault_id", False) or new_fault_id())

    @api.delete("/faults/ecc_poison/{fault_id}")
    async def ecc_clear(fault_id: str) -> dict:
        return await control.release("ecc_poison", fault_id)

    return api


class ResilienceMetrics:
    """Prometheus collector: degradation level, health scores, KV use and offload tiers, migrations."""

    def __init__(self, router: ResilientRouter) -> None:
        self.router = router

    def collect(self):
        control = self.router.resilience
        yield GaugeMetricFamily(f"{PREFIX}_degradation_level", "Degradation level 0..5 (seed Section 4.1)",
                                value=control.degradation.level)
        changes = CounterMetricFamily(f"{PREFIX}_degradation_changes", "Degradation level changes", labels=["to_level"])
        for level in range(6):
            changes.add_metric([str(level)], sum(c.to_level == level for c in control.degradation.history))
        yield changes
        rejected = CounterMetricFamily(f"{PREFIX}_degradation_rejected_requests",
                                       "New requests refused by admission control (429) or the open circuit (503)",
                                       labels=["status"])
        rejected.add_metric(["429"], control.actions.counters["rejected_429"])
        rejected.add_metric(["503"], control.actions.counters["rejected_503"])
        yield rejected
        yield CounterMetricFamily(f"{PREFIX}_degradation_capped_requests",
                                  "Requests whose max_tokens or context Level 4 cut", value=control.actions.counters["degraded_requests"])
        migrations = CounterMetricFamily(f"{PREFIX}_migrations", "Live KV migrations by outcome", labels=["outcome"])
        for outcome, n in control.migration.counters.items():
            migrations.add_metric([outcome], n)
        yield migrations
        yield GaugeMetricFamily(f"{PREFIX}_migrations_in_flight", "Live migrations in progress",
                                value=len(control.migration.active))
        score = GaugeMetricFamily(f"{PREFIX}_worker_health_score", "Delta-based health score (seed 5.2), 0..1",
                                  labels=["worker"])
        for wid, value in control.health_scores().items():
            score.add_metric([wid], value)
        yield score
        used = GaugeMetricFamily(f"{PREFIX}_worker_kv_used_ratio", "KV pool use incl. fill reservations",
                                 labels=["worker"])
        poisoned = GaugeMetricFamily(f"{PREFIX}_worker_kv_blocks_poisoned",
                                     "KV blocks whose memory is ECC-poisoned (quarantined or not)", labels=["worker"])
        tiers = GaugeMetricFamily(f"{PREFIX}_kv_offload_bytes", "KV bytes per offload tier (seed 4.3)",
                                  labels=["worker", "tier"])
        fetch = GaugeMetricFamily(f"{PREFIX}_kv_offload_fetch_seconds", "Recent mean on-demand fetch latency",
                                  labels=["worker"])
        for w in control.table.healthy(WorkerRole.DECODE):
            used.add_metric([w.id], w.kv_used_ratio())
            poisoned.add_metric([w.id], float(w.stats.get("kv_blocks_poisoned", 0)))
            for tier, n in (w.stats.get("offload") or {}).items():
                tiers.add_metric([w.id, tier], float(n))
            if w.stats.get("offload_fetch_s") is not None:
                fetch.add_metric([w.id], float(w.stats["offload_fetch_s"]))
        yield from (used, poisoned, tiers, fetch)
