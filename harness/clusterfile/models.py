"""The cluster file's schema as pydantic v2 models (``clusters/*.yaml``, docs/clusters.md).

The models are the validated spec itself: ``load.load_cluster`` returns a :class:`ClusterSpec`.
Every field carries the fix shown when it is wrong (``json_schema_extra["x-fix"]``), so a
pydantic error's ``loc`` becomes the project's one config-error shape (file, field, fix) in
``load.py``. Unknown keys are errors everywhere (``extra="forbid"``). Cross-field checks raise
:class:`FieldProblem`, which names the field relative to the model that raised it.

Version 1 files (no ``version:``) keep their meaning; the version 2 fields (``engine``, ``model``,
``auth``, ``workload``, ``workers``) are optional in both.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import Strict, field_serializer, field_validator, model_validator

from harness.checklists import Checklist, default_checklist
# base names are re-exported: callers import them from here
from harness.clusterfile.base import (ENGINES, ENV_VAR_PATTERN, FAULT_KINDS, KINDS, METRIC_PROFILES, NAME_PATTERN,  # noqa: F401
                                      MAX_BUNDLED_WORKERS, ROLES, WORKER_ROLES, FieldProblem, Name, SSHSettings, Text, Url,
                                      field_with_fix, StrictModel)
from harness.clusterfile.behaviour import (Degradation, DegradationLevel, DegradationLoad,  # noqa: F401
                                           GpuBinding, HostDcgm, LevelExpectation, MigrationSettings, Rejection)
from harness.clusterfile.engine_settings import EngineSettings, RouterSettings, check_engine
from harness.clusterfile.external import (Auth, Endpoints, ProcessLocator, RequestShape, Restart,  # noqa: F401
                                          Worker, Workload)
from harness.clusterfile.load_hosts import LoadHost, LoadMaster, check_load_hosts
from harness.errors import FaultError


class HostFabric(StrictModel):
    """A host's KV fabric NIC as the fabric items reach it over SSH (docs/fabric.md, "Real hosts")."""

    interface: Text = field_with_fix("write e.g. `interface: eth1` (the netdev of the KV fabric NIC)", "fabric netdev")
    address: Text = field_with_fix("write e.g. `address: 10.40.1.10` (the fabric NIC's IP)", "the fabric NIC's IP")
    tcp_interface: Text | None = field_with_fix("write e.g. `tcp_interface: eth1`", "the NIC carrying TCP/IP traffic "
                                      "(default: the fabric interface, both classes on one NIC)", default=None)
    tcp_address: Text | None = field_with_fix("write e.g. `tcp_address: 10.40.1.10`", "default: the fabric address",
                                    default=None)
    lossless_class: Text | None = field_with_fix("write e.g. `lossless_class: \"1:10\"` (a tc class id) or null",
                                       "tc class of the lossless traffic on the interface, when it has one",
                                       default=None)
    lossless_ports: tuple[int, ...] = field_with_fix("write e.g. `lossless_ports: [7472]`", "TCP ports classified "
                                           "into the lossless class (the raw bench and storm flood use the "
                                           "last: one no KV listener of the engine holds)", default=(), strict=False)
    rdma_device: Text | None = field_with_fix("write e.g. `rdma_device: mlx5_0`", "RDMA CA: ib_write_bw is used "
                                    "when set and installed", default=None)
    python: Text = field_with_fix("write e.g. `python: /usr/bin/python3`", "interpreter for the TCP probe ends",
                        default="python3")


class Host(StrictModel):
    name: Text = field_with_fix("write `name: some-host`")
    address: Text = field_with_fix("write `address: 10.0.0.5` (or a DNS name)")
    roles: tuple[Literal[ROLES], ...] = field_with_fix("write e.g. `roles: [prefill]`", "what the host serves",
                                              min_length=1, strict=False)
    ssh: SSHSettings | None = field_with_fix("write `ssh: {user: ops, key_file: PATH, known_hosts: PATH}`",
                                   "None: the host is this machine, commands run locally", default=None)
    fabric: HostFabric | None = field_with_fix("write `fabric: {interface: eth1, address: 10.40.1.10}`",
                                     "the host's KV fabric NIC (the fabric items over SSH)", default=None)
    dcgm: HostDcgm | None = field_with_fix("write `dcgm: {dcgmi: dcgmi}` on a host running DCGM",
                                 "the host runs DCGM: GPU errors can be injected into its monitoring", default=None)
    rack: Text | None = field_with_fix("write e.g. `rack: r12`", "a label fault selectors filter on "
                                       "(`--rack r12`, docs/faults.md \"Faults fanned out\")", default=None)


class BlastRadius(StrictModel):
    """How much of the cluster fanned-out faults may take down at once (checked before anything is touched)."""

    max_role_share_down: float = field_with_fix(
        "write a share in (0, 1], e.g. `max_role_share_down: 0.25` (a quarter of a role's workers)",
        "never more than this share of one role's workers faulted at once", gt=0, le=1, allow_inf_nan=False)


class Safety(StrictModel):
    production: bool = field_with_fix("write `production: true` for a cluster that serves users", default=False)
    # None: every fault kind (never for production); absent: none for production, all otherwise
    allowed_faults: Literal["all"] | Annotated[tuple[str, ...], Strict(False)] | None = field_with_fix(
        "write e.g. `allowed_faults: [process_kill, process_hang]`", "`all` or a list of fault kinds",
        default=None, validate_default=True)
    blast_radius: BlastRadius | None = field_with_fix("write `blast_radius: {max_role_share_down: 0.25}`",
                                                      "limit of fanned-out faults (None: no limit)", default=None)

    @field_validator("allowed_faults")
    @classmethod
    def _normalise(cls, value: Any, info: Any) -> tuple[str, ...] | None:
        production = info.data.get("production", False)
        if value is None:
            return () if production else None
        if value == "all":
            if production:
                raise FieldProblem("a production cluster cannot allow every fault",
                                   "list each fault kind you accept, e.g. [process_kill]")
            return None
        for i, kind in enumerate(value):
            if kind not in FAULT_KINDS:
                raise FieldProblem(f"unknown fault kind {kind!r}", f"use one of {', '.join(FAULT_KINDS)}",
                                   field=f"[{i}]")
        return tuple(value)

    def check_allowed(self, fault_kind: str, cluster: str) -> None:
        """Refuse a fault the cluster does not allow, with the fix in the message."""
        if self.allowed_faults is not None and fault_kind in self.allowed_faults:
            return
        if self.allowed_faults is None and not self.production:
            return
        if self.production:
            raise FaultError(f"cluster {cluster!r} is marked production: fault {fault_kind!r} is refused",
                             fix=f"list {fault_kind!r} under safety.allowed_faults in the cluster file "
                                 "if you really mean to inject it on this cluster")
        raise FaultError(f"fault {fault_kind!r} is not allowed on cluster {cluster!r} "
                         f"(allowed: {', '.join(self.allowed_faults or ()) or 'none'})",
                         fix=f"add {fault_kind!r} to safety.allowed_faults in the cluster file")


class BundledSettings(StrictModel):
    prefill: int = field_with_fix(f"write a whole number from 1 to {MAX_BUNDLED_WORKERS}", "prefill workers", default=2, ge=1,
                        le=MAX_BUNDLED_WORKERS)
    decode: int = field_with_fix(f"write a whole number from 1 to {MAX_BUNDLED_WORKERS}", "decode workers", default=2, ge=1,
                       le=MAX_BUNDLED_WORKERS)
    preset: Text = field_with_fix("write e.g. `preset: tiny` (`python -m harness presets` lists them)", default="tiny")
    host: Text = field_with_fix("write e.g. `host: 127.0.0.1`", default="127.0.0.1")
    router: RouterSettings = field_with_fix("write e.g. `router: {reschedule_enabled: true}`",
                                            "router config knobs (sabotage included)", default_factory=RouterSettings)
    engine: EngineSettings = field_with_fix("write e.g. `engine: {ecc_handling: false}`",
                                            "EngineConfig fields of every worker", default_factory=EngineSettings)
    ready_timeout_s: float = field_with_fix("write e.g. 120", default=120.0, gt=0, allow_inf_nan=False)

    @field_validator("router", "engine", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @model_validator(mode="after")
    def _engine_runs_the_preset(self) -> "BundledSettings":
        check_engine(self.preset, self.engine)
        return self

    @field_serializer("router", "engine")
    def _as_written(self, settings: StrictModel) -> dict[str, Any]:
        """What the file set (the engine's defaults are its own), as ``dict(...)`` of it was before."""
        return settings.model_dump(mode="json", exclude_unset=True)


class FabricSettings(StrictModel):
    """The bundled cluster's emulated fabric (docs/fabric.md); needs root and iproute2."""

    enabled: bool = field_with_fix("write `enabled: true` or `enabled: false`", default=False)
    # the ranges harness.fabric.shaping.ShapingSpec accepts (it checks them again when the fabric is built)
    line_rate_bps: float = field_with_fix("use 1e6..1e11 bit/s (the bundled default, 1e9, is what the KV data plane "
                                          "fills on 2 cores)", default=1e9, ge=1e6, le=100e9, allow_inf_nan=False)
    mtu: int = field_with_fix("use 1280..65000 (9000 = jumbo frames)", default=9000, ge=1280, le=65000)
    lossless_share: float = field_with_fix("leave room for both classes, e.g. 0.5", "guaranteed share of the line "
                                           "rate for the lossless class", default=0.5, ge=0.05, le=0.95,
                                           allow_inf_nan=False)
    tcp_in_lossless: bool = field_with_fix("write `tcp_in_lossless: true` or `tcp_in_lossless: false`",
                                 "deliberately broken: TCP/IP traffic shares the paused class", default=False)


class ClusterFile(StrictModel):
    """One cluster file (the JSON Schema printed by ``python -m harness schema``)."""

    version: Literal[1, 2] | None = field_with_fix("write `version: 2` (or leave it out for version 1)", default=None)
    name: Name = field_with_fix("use letters, digits, '-', '_', '.'", "default: the file name")
    kind: Literal[KINDS] = field_with_fix("write `kind: bundled` (reference engine here) or `kind: external` (attach)")
    description: str = field_with_fix("write one line of text", default="")
    engine: Literal[ENGINES] | None = field_with_fix(
        f"write one of {', '.join(ENGINES)}", "selects the metric profile and the capability set "
        "(default: bundled for kind bundled, openai for kind external)", default=None)
    model: Text | None = field_with_fix("write the served model name, e.g. `model: tiny-llama`",
                              "default: the first of /v1/models", default=None)
    auth: Auth | None = field_with_fix("write `auth: {api_key_env: MY_KEY}`", default=None)
    bundled: BundledSettings | None = field_with_fix("write `bundled: {prefill: 2, decode: 2, preset: tiny}`", default=None)
    endpoints: Endpoints | None = field_with_fix("add `endpoints: {api: http://HOST:PORT, metrics: http://HOST:PORT/metrics}`",
                                       default=None)
    workload: Workload | None = field_with_fix("write `workload: {prompt_tokens: 200, output_tokens: 64}`", default=None)
    workers: tuple[Worker, ...] = field_with_fix("write `workers:` followed by `- name: ...` entries", default=(),
                                       strict=False)
    migration: MigrationSettings | None = field_with_fix("write `migration: {on_worker_loss: true}`",
                                               "how the engine migrates streams (item 6.1.2 without an admin API)",
                                               default=None)
    hosts: tuple[Host, ...] = field_with_fix("write `hosts:` followed by `- name: ...` entries", default=(), strict=False)
    thresholds: dict[str, Any] = field_with_fix('write `"6.1.4": {reschedule_p100_s: 3}`',
                                      "overrides of checklists/section6.yaml values", default_factory=dict)
    regression: dict[str, Any] | None = field_with_fix('write `regression: {figures: {"6.2.ttft": {ttft_p99_ms: '
                                                       '{max_increase: 0.2}}}}`', "overrides of the checklist's "
                                                       "regression: alpha and tolerances (docs/compare.md)", default=None)
    safety: Safety = field_with_fix("write `safety: {production: false, allowed_faults: all}`", default_factory=Safety)
    fabric: FabricSettings = field_with_fix("write `fabric: {enabled: true}`", default_factory=FabricSettings)
    degradation: Degradation | None = field_with_fix("write `degradation: {levels: [{level: 2, kv_use_above: 0.8, "
                                           "expect: {queue: true}}]}`", "6.1.3 on a foreign engine", default=None)
    load_hosts: tuple[LoadHost, ...] = field_with_fix("write `load_hosts: [gen-0, gen-1]` (hosts under `hosts:`) or "
                                                      "entries with name, address and ssh", "machines that each run a "
                                                      "Locust worker of the load (none: load from this machine)",
                                                      default=(), strict=False)
    load_master: LoadMaster = field_with_fix("write `load_master: {bind: 10.0.0.5, port: 5557}`",
                                             "where the load hosts reach this machine's Locust master",
                                             default_factory=LoadMaster)

    @field_validator("bundled", "safety", "fabric", "thresholds", "hosts", "workers", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: Any) -> Any:
        if value is None:  # `hosts:` with nothing under it means the default, as it always did
            return {"bundled": None, "hosts": (), "workers": ()}.get(info.field_name, {})
        return value

    @model_validator(mode="before")
    @classmethod
    def _bundled_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") == "bundled" and data.get("bundled") is None:
            data = {**data, "bundled": {}}  # `kind: bundled` alone means the default topology
        return data

    @field_validator("description", mode="before")
    @classmethod
    def _description_text(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterFile":
        if self.kind == "bundled":
            if self.endpoints is not None:
                raise FieldProblem("a bundled cluster's endpoints are chosen at start-up",
                                   "remove `endpoints:` or use `kind: external`", field="endpoints")
            if self.engine not in (None, "bundled"):
                raise FieldProblem(f"a bundled cluster runs the bundled engine, not {self.engine!r}",
                                   "remove `engine:` or use `kind: external`", field="engine")
            if self.workers:
                raise FieldProblem("a bundled cluster's workers are started by the harness",
                                   "remove `workers:` (set bundled.prefill / bundled.decode) or use `kind: external`",
                                   field="workers")
        else:
            if self.bundled is not None:
                raise FieldProblem("only a bundled cluster has bundled settings",
                                   "remove `bundled:` or use `kind: bundled`", field="bundled")
            if self.endpoints is None:
                raise FieldProblem("an external cluster needs its endpoints",
                                   "add `endpoints: {api: http://HOST:PORT, metrics: http://HOST:PORT/metrics}`",
                                   field="endpoints")
            if self.engine == "bundled":
                raise FieldProblem("engine `bundled` is the harness's own engine, started with `kind: bundled`",
                                   "write the engine the cluster runs (vllm, sglang, dynamo, openai)", field="engine")
            if self.fabric.enabled:
                raise FieldProblem("only the bundled cluster runs on the emulated fabric",
                                   "remove `fabric:` (a real cluster brings its own fabric)", field="fabric.enabled")
        seen: set[str] = set()
        for i, h in enumerate(self.hosts):
            if h.name in seen:
                raise FieldProblem(f"duplicate host name {h.name!r}", "give each host its own name",
                                   field=f"hosts[{i}].name")
            seen.add(h.name)
        check_load_hosts(self.load_hosts, self.hosts)
        names: set[str] = set()
        for i, w in enumerate(self.workers):
            if w.name in names:
                raise FieldProblem(f"duplicate worker name {w.name!r}", "give each worker its own name",
                                   field=f"workers[{i}].name")
            names.add(w.name)
            if w.host not in seen:
                raise FieldProblem(f"host {w.host!r} is not listed under `hosts:`",
                                   f"use one of {', '.join(sorted(seen)) or '(none: add a hosts: entry)'}",
                                   field=f"workers[{i}].host")
        return self


class ClusterSpec(ClusterFile):
    """A validated cluster inventory: the file plus where it came from (``path`` is not a file key)."""

    path: str

    @property
    def engine_name(self) -> str:
        """The engine, with the kind's default filled in."""
        return self.engine or ("bundled" if self.kind == "bundled" else "openai")

    @property
    def metric_profile(self) -> str | None:
        """Key of harness.probes.metrics.prometheus.ENGINE_PROFILES for this engine (None: no known profile)."""
        return METRIC_PROFILES.get(self.engine_name)

    @property
    def threshold_overrides(self) -> dict[str, Any]:
        return self.thresholds

    def checklist(self, base: Checklist | None = None) -> Checklist:
        """The checklist thresholds and regression tolerances with this cluster's overrides applied to
        ``base`` (the run's parsed checklist; None: the shipped one)."""
        return ((base or default_checklist()).with_overrides(self.thresholds or None, origin=self.path)
                .with_regression(self.regression, origin=self.path))

    def api_key(self) -> str | None:
        """The API key from the environment variable named by ``auth.api_key_env`` (None: no auth)."""
        if self.auth is None:
            return None
        key = os.environ.get(self.auth.api_key_env, "")
        if not key.strip():
            from harness.errors import ConfigError

            raise ConfigError(f"cluster {self.name!r}: environment variable {self.auth.api_key_env} "
                              f"(auth.api_key_env in {self.path}) is not set",
                              fix=f"export {self.auth.api_key_env}=<the API key> before the run")
        return key.strip()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

