"""The PD router as a process: ``python -m harness.engine.pd.router_server`` serves the OpenAI API
(``api.build_app``) over a ``Router``, plus its admin API (``/admin/*``) and its Prometheus
collector; docs/pd.md lists both. ``topology.py`` starts it."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from harness.engine.serving.metrics import PREFIX
from harness.engine.resilience.admin import ResilienceMetrics, resilience_api
from harness.engine.pd.router import Router
from harness.engine.pd.router_config import RouterConfig
from harness.engine import DEFAULT_PRESET
from harness.errors import InvalidRequestError
from harness.states import WorkerHealth

log = logging.getLogger(__name__)


async def _json_object(request: Request, param: str, example: str) -> dict:
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise InvalidRequestError(f"{param} body must be a JSON object, e.g. {example}", param=param)
    return body


class RouterMetrics:
    """Prometheus collector: transfer counters per worker and path, liveness, scheduling."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        router = self.router
        labels = ["worker", "path"]
        fams = {f: CounterMetricFamily(f"{PREFIX}_kv_transfer_{f}", f"KV transfer {f} per sending worker and path "
                                       "(docs/pd.md)", labels=labels)
                for f in ("bytes", "seconds", "frames", "transfers", "retries", "failures", "fallbacks")}
        rejected = CounterMetricFamily(f"{PREFIX}_kv_transfer_rejected_frames", "KV frames a receiver rejected "
                                       "(crc, header, shape, truncated, unknown_request)", labels=["worker", "reason"])
        up = GaugeMetricFamily(f"{PREFIX}_worker_up", "1 while a worker is in the routing table",
                               labels=["worker", "role"])
        queue = GaugeMetricFamily(f"{PREFIX}_worker_queue_depth", "Requests queued or running on a worker",
                                  labels=["worker", "role"])
        for w in router.workers.values():
            for path, counters in w.transfer.get("paths", {}).items():
                for f, fam in fams.items():
                    fam.add_metric([w.id, path], counters.get(f, 0))
            for reason, count in w.transfer.get("rejected", {}).items():
                rejected.add_metric([w.id, reason], count)
            up.add_metric([w.id, w.role], 1.0 if w.health == WorkerHealth.HEALTHY else 0.0)
            queue.add_metric([w.id, w.role], w.public()["queue_depth"])
        yield from fams.values()
        yield from (rejected, up, queue)
        for name, value in router.counters.items():
            yield CounterMetricFamily(f"{PREFIX}_router_{name}", f"Router {name.replace('_', ' ')}", value=value)
        down = CounterMetricFamily(f"{PREFIX}_router_worker_down_events", "Workers declared down", labels=["reason"])
        for reason in ("connection_lost", "heartbeat_timeout", "no_progress", "protocol_error"):
            down.add_metric([reason], sum(e["type"] == "worker_down" and e["reason"] == reason for e in router.events))
        yield down
        yield GaugeMetricFamily(f"{PREFIX}_router_admission_queue", "Requests waiting for a placement",
                                value=router.waiting)


def worker_health_api(router: Router) -> APIRouter:
    """``GET /health/workers/{id}``: 200 while the router counts that worker healthy, else 503 (404:
    no such worker). The per-worker health URL a cluster file's ``workers:`` entry names, as a real
    engine's per-instance health port (Dynamo's system port, vLLM's /health per instance) would be;
    outside /admin because it is not the admin API a foreign engine lacks."""
    api = APIRouter()

    @api.get("/health/workers/{worker_id}")
    async def worker_health(worker_id: str) -> JSONResponse:
        w = router.workers.get(worker_id)
        if w is None:
            return JSONResponse({"error": f"no worker {worker_id!r}", "workers": sorted(router.workers)},
                                status_code=404)
        row = w.public()
        return JSONResponse({"id": worker_id, "health": row["health"], "pid": row["pid"]},
                            status_code=200 if row["health"] == WorkerHealth.HEALTHY else 503)

    return api


def admin_api(router: Router) -> APIRouter:
    api = APIRouter(prefix="/admin")

    @api.get("/workers")
    async def workers() -> list[dict]:
        return [w.public() for w in router.workers.values()]

    @api.get("/events")
    async def events(since: int = 0, type: str | None = None) -> list[dict]:
        return [e for e in router.events if e["seq"] > since and (type is None or e["type"] == type)]

    @api.get("/config")
    async def config() -> dict:
        return asdict(router.config)

    @api.post("/transfer")
    async def transfer(request: Request) -> dict:
        """Replace the KV transfer settings for later requests (TransferConfig fields)."""
        return router.set_transfer(await _json_object(request, "transfer", '{"mode": "whole"}'))

    @api.post("/workers/{worker_id}/fault")
    async def fault(worker_id: str, request: Request) -> dict:
        return router.fault(worker_id, await _json_object(request, "fault", '{"corrupt_frames": 1}'))

    return api


# ---------------------------------------------------------------- process main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.engine.pd.router_server", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=DEFAULT_PRESET)
    p.add_argument("--host", default="127.0.0.1", help="API address")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--control-host", default="127.0.0.1", help="address workers connect to")
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--config-json", default="{}", help="RouterConfig fields as JSON")
    p.add_argument("--max-model-len", type=int, default=None, help="as the workers' EngineConfig.max_model_len")
    p.add_argument("--ready-file", type=Path, help="write {api, control, pid} here once listening")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument("-v", "--verbose", action="count", default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` dumps every thread's stack to the log
    config = RouterConfig.from_dict(json.loads(args.config_json))
    return asyncio.run(_serve(args, config))


async def _serve(args, config: RouterConfig) -> int:
    import uvicorn

    from harness.engine.serving.api import build_app
    from harness.engine.serving.server import bind_socket

    router = Router(args.preset, config, max_model_len=args.max_model_len)
    registry = CollectorRegistry()
    registry.register(RouterMetrics(router))
    registry.register(ResilienceMetrics(router))
    app = build_app(router, registry=registry, extra_routers=[admin_api(router), resilience_api(router),
                                                                     worker_health_api(router)])
    api_sock = bind_socket(args.host, args.port)
    control = await router.start_control(args.control_host, args.control_port)
    server = uvicorn.Server(uvicorn.Config(app, log_level=logging.WARNING, access_log=False,
                                           timeout_graceful_shutdown=2))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    if args.ready_file:
        tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
        tmp.write_text(json.dumps({"api": list(api_sock.getsockname()[:2]), "control": list(control),
                                   "pid": os.getpid()}))
        tmp.replace(args.ready_file)

    async def watch_parent() -> None:
        while args.parent_pid:
            await asyncio.sleep(1.0)
            if os.getppid() != args.parent_pid:
                log.warning("parent %d is gone; router exits", args.parent_pid)
                server.should_exit = True
                return

    watcher = loop.create_task(watch_parent())
    try:
        await server.serve(sockets=[api_sock])
    finally:
        watcher.cancel()
        await router.close()
        api_sock.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything was closed explicitly above. Skip interpreter finalization: its final garbage
    # collection over torch's object graph took more than 10 s on a loaded 2-core machine.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
