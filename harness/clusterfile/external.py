"""The cluster file's parts that describe a cluster the harness attaches to (docs/clusters.md,
version 2 fields): its ``endpoints``, ``auth``, ``workload`` and ``workers`` (each worker's API, health
and metrics URLs, how to find, kill, hang and restart its process, its GPUs). Re-exported by
harness/clusterfile/models.py, which assembles them into the :class:`ClusterFile`."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import StringConstraints, field_validator, model_validator

from harness.clusterfile.base import (ENV_VAR_PATTERN, WORKER_ROLES, FieldProblem, Name, StrictModel, Text, Url,
                                      field_with_fix)
from harness.clusterfile.behaviour import GpuBinding


class Endpoints(StrictModel):
    api: Url = field_with_fix("write e.g. `api: http://10.0.0.5:8000`", "OpenAI-compatible API (the router)")
    metrics: Url | None = field_with_fix("write e.g. `metrics: http://10.0.0.5:8000/metrics`", "Prometheus text", default=None)
    admin: Url | None = field_with_fix("write the base URL serving /admin/workers and /admin/events, or null",
                             "the bundled engine's admin API, if the cluster has one", default=None)
    prometheus: Url | None = field_with_fix(
        "write the Prometheus server's base URL, e.g. `prometheus: http://10.0.0.9:9090`, or leave it out",
        "a Prometheus that scrapes endpoints.metrics and every workers[].metrics: the suites then query it "
        "with PromQL instead of scraping (docs/prometheus.md)", default=None)

    @field_validator("metrics", "admin", "prometheus", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @field_validator("prometheus")
    @classmethod
    def _server_base(cls, value: str | None) -> str | None:
        path = urlparse(value).path if value else ""
        if path.endswith("/metrics") or "/api/v1" in path or "/graph" in path:
            raise FieldProblem(f"{value!r} is a page of the server, not its base URL (the harness adds /api/v1/query)",
                               f"write the base URL, e.g. {value[:len(value) - len(path)]}")
        return value


class Auth(StrictModel):
    api_key_env: Annotated[str, StringConstraints(pattern=ENV_VAR_PATTERN)] = field_with_fix(
        "write the NAME of an environment variable, e.g. `api_key_env: MY_KEY` (never the key itself)",
        "environment variable holding the API key (sent as `Authorization: Bearer`, never logged)")


class RequestShape(StrictModel):
    prompt_tokens: int = field_with_fix("write a whole number of tokens such as 200", ge=1)
    output_tokens: int = field_with_fix("write a whole number of tokens such as 64", ge=1)
    weight: float = field_with_fix("write a positive number such as 1", "relative share of requests", default=1.0, gt=0,
                         allow_inf_nan=False)


class Workload(StrictModel):
    prompt_tokens: int = field_with_fix("write a whole number of tokens such as 200", "typical prompt length", default=200,
                              ge=1)
    output_tokens: int = field_with_fix("write a whole number of tokens such as 64", "typical output length", default=64, ge=1)
    mix: tuple[RequestShape, ...] = field_with_fix("write e.g. `mix: [{prompt_tokens: 200, output_tokens: 64, weight: 1}]`",
                                         "request mix (default: the typical request only)", default=(),
                                         strict=False)


class ProcessLocator(StrictModel):
    """How to find a worker's process on its host: exactly one of the three."""

    pgrep: Text | None = field_with_fix('write e.g. `pgrep: "vllm.entrypoints.openai.api_server.*--port 8101"`', default=None)
    pid_file: Text | None = field_with_fix("write e.g. `pid_file: /run/vllm-0.pid`", default=None)
    systemd_unit: Text | None = field_with_fix("write e.g. `systemd_unit: vllm-0.service`", default=None)

    @model_validator(mode="after")
    def _exactly_one(self) -> "ProcessLocator":
        given = [k for k in ("pgrep", "pid_file", "systemd_unit") if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldProblem(f"expected exactly one of pgrep, pid_file, systemd_unit, got {given or 'none'}",
                               'write e.g. `process: {pgrep: "api_server.*--port 8101"}`')
        return self

    @property
    def how(self) -> tuple[str, str]:
        return next((k, v) for k in ("pgrep", "pid_file", "systemd_unit") if (v := getattr(self, k)) is not None)


class Restart(StrictModel):
    command: Text = field_with_fix('write e.g. `restart: {command: "systemctl restart vllm-0"}`',
                         "run on the worker's host to bring it back")


class Worker(StrictModel):
    name: Name = field_with_fix("use letters, digits, '-', '_', '.'")
    role: Literal[WORKER_ROLES] = field_with_fix("write `role: prefill`, `role: decode` or `role: aggregated`")
    host: Text = field_with_fix("write the name of an entry under `hosts:`")
    api: Url = field_with_fix("write e.g. `api: http://10.0.0.5:8101` (the worker's own OpenAI-compatible API)")
    health: Url | None = field_with_fix("write e.g. `health: http://10.0.0.5:8101/health` (GET -> 200 when healthy)",
                              default=None)
    metrics: Url | None = field_with_fix("write e.g. `metrics: http://10.0.0.5:8101/metrics`", default=None)
    process: ProcessLocator | None = field_with_fix('write e.g. `process: {pgrep: "api_server.*--port 8101"}`',
                                          "the worker's process: what a kill ends", default=None)
    hang_process: ProcessLocator | None = field_with_fix('write e.g. `hang_process: {pgrep: "^vllm-0::EngineCore"}`',
                                               "the process a hang stops (default: process), e.g. the engine "
                                               "loop behind an API server that keeps answering /health",
                                               default=None)
    restart: Restart | None = field_with_fix('write e.g. `restart: {command: "systemctl restart vllm-0"}`', default=None)
    supervised: bool = field_with_fix("write `supervised: true` when a service manager restarts it", default=False)
    gpus: tuple[GpuBinding, ...] = field_with_fix("write e.g. `gpus: [0, 1]` (DCGM / nvidia-smi GPU ids on its host)",
                                        "the GPUs this worker runs on", default=(), strict=False)

    @model_validator(mode="after")
    def _one_way_back(self) -> "Worker":
        if self.restart is not None and self.supervised:
            raise FieldProblem("a worker is either restarted by a command or by its supervisor, not both",
                               "remove `restart:` or `supervised: true`", field="supervised")
        return self

    @property
    def restartable(self) -> bool:
        return self.restart is not None or self.supervised


__all__ = ["Auth", "Endpoints", "ProcessLocator", "RequestShape", "Restart", "Worker", "Workload"]
