"""The cluster handle a conformance test receives, and bringing a cluster up (bundled) or
attaching to it (external) for the session.

Wiring (the top layer of docs/architecture.md): the handle opens probes' clients, the fabric and
the engine's topology, so it sits above them; the cluster file's models and loading are in
``harness.clusterfile``, below."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from harness.checklists import Checklist
from harness.checklists.validation import field_error
from harness.clusterfile.models import ClusterSpec, FabricSettings, Host, Safety, Worker, Workload
from harness.errors import ConfigError, ProbeError

log = logging.getLogger(__name__)


@dataclass
class ClusterHandle:
    """What a conformance test gets: endpoints, hosts, thresholds and safety of one cluster, and
    for the bundled kind the running Topology (restart and health hooks) and the oracle."""

    spec: ClusterSpec
    thresholds: Checklist
    api_url: str
    metrics_url: str | None
    admin_url: str | None
    topology: Any = None
    # oracle(prompt_token_ids, max_tokens, stop=(), ignore_eos=False) -> expected token ids
    oracle: Callable[..., list[int]] | None = None
    fabric: Any = None                  # harness.fabric.builder.Fabric when the workers run on it
    fabric_unavailable: str | None = None  # why not, when the cluster file asked for it
    run: Any = None                     # harness.faults.runs.RunRecord of the run that started it (bundled)
    dry_run: bool = False               # attached for a dry run: nothing is contacted, no key file read

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def hosts(self) -> tuple[Host, ...]:
        return self.spec.hosts

    @property
    def engine(self) -> str:
        """bundled | vllm | sglang | dynamo | openai (the kind's default when the file names none)."""
        return self.spec.engine_name

    @property
    def model(self) -> str | None:
        """The served model name from the cluster file (None: the first of /v1/models)."""
        return self.spec.model

    @property
    def workers(self) -> tuple[Worker, ...]:
        """The external cluster's worker inventory (empty for bundled: see ``topology``)."""
        return self.spec.workers

    @property
    def workload(self) -> Workload | None:
        return self.spec.workload

    def api_key(self) -> str | None:
        """The API key (from ``auth.api_key_env``), None when the cluster has no auth; a clear
        ConfigError naming the variable when it is unset. Never log or report it."""
        return self.spec.api_key()

    def auth_headers(self) -> dict[str, str]:
        key = self.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def streaming_client(self, **kwargs: Any) -> Any:
        """A StreamingClient for this cluster's API with its model and API key (kwargs override)."""
        from harness.probes.client.request_shape import request_shape
        from harness.probes.client.streaming import StreamingClient

        return StreamingClient(self.api_url, **{"model": self.model, "api_key": self.api_key(),
                                                "request_shape": request_shape(self.engine), **kwargs})

    def scraper(self, url: str | None = None, **kwargs: Any) -> Any:
        """A PrometheusScraper of ``url`` (default: endpoints.metrics) read with this engine's metric
        profile and API key; a ConfigError when there is no metrics URL or no profile."""
        from harness.probes.metrics.prometheus import PrometheusScraper

        url = url or self.metrics_url
        if url is None or self.spec.metric_profile is None:
            why = "no endpoints.metrics" if url is None else f"engine {self.engine!r} has no metric profile"
            raise ConfigError(f"cluster {self.name!r} has no engine metrics to scrape ({why})",
                              fix="set endpoints.metrics and engine (bundled, vllm, sglang, dynamo) in the cluster file")
        return PrometheusScraper(url, **{"engine": self.spec.metric_profile, "api_key": self.api_key(), **kwargs})

    @property
    def prometheus_url(self) -> str | None:
        """``endpoints.prometheus``: the cluster's own Prometheus, which the suites query with PromQL
        instead of scraping each metrics URL themselves (docs/prometheus.md)."""
        return self.spec.endpoints.prometheus if self.spec.endpoints is not None else None

    def metrics_source(self, profile: str | None = None) -> Any:
        """Where the suites read engine metrics: a PrometheusSource of ``prometheus_url`` when set, else a
        ScrapeSource with this cluster's API key (harness.probes.metrics.metrics_source); close it after use."""
        from harness.probes.metrics.metrics_source import metrics_source

        return metrics_source(self, profile)

    def capabilities(self) -> Any:
        """What this cluster provides (harness.checks.capabilities.Capabilities)."""
        from harness.checks.capabilities import capabilities_of

        return capabilities_of(self)

    @property
    def safety(self) -> Safety:
        return self.spec.safety

    def check_fault_allowed(self, fault_kind: str) -> None:
        self.spec.safety.check_allowed(fault_kind, self.spec.name)

    def ssh_target(self, host: str) -> Any:
        """The SSH target for a worker's host (matched by host name or address), or None when
        commands for that host run locally. Built on demand: key files are checked only for
        hosts a fault actually touches (never in a dry run: its SSH commands are only printed)."""
        from harness.hosts import SSHTarget

        h = next((h for h in self.hosts if host in (h.name, h.address) and h.ssh is not None), None)
        if h is None or h.ssh is None:
            return None
        key_file, known = (str(Path(p).expanduser()) for p in (h.ssh.key_file, h.ssh.known_hosts))
        return SSHTarget(host=h.address, user=h.ssh.user, key_filename=key_file, known_hosts_file=known,
                         port=h.ssh.port, connect_timeout_s=h.ssh.connect_timeout_s, require_files=not self.dry_run)

    def this_machine(self, host: str) -> bool:
        """Whether commands for ``host`` (a host's name or address) run on this machine: a host of the
        cluster file without ``ssh:`` is this machine, whatever its name (docs/clusters.md)."""
        return any(host in (h.name, h.address) and h.ssh is None for h in self.hosts)

    def describe(self) -> dict[str, Any]:
        """JSON-able description for the report."""
        return {"name": self.name, "kind": self.kind, "path": self.spec.path, "description": self.spec.description,
                "api_url": self.api_url, "metrics_url": self.metrics_url, "admin_url": self.admin_url,
                "prometheus_url": self.prometheus_url,
                "hosts": [{"name": h.name, "address": h.address, "roles": list(h.roles),
                           "ssh": None if h.ssh is None else f"{h.ssh.user}@{h.address}:{h.ssh.port}"}
                          for h in self.hosts],
                "engine": self.engine, "model": self.model,
                "auth": None if self.spec.auth is None else {"api_key_env": self.spec.auth.api_key_env},
                "workers": [w.model_dump(mode="json") for w in self.workers],
                "workload": None if self.workload is None else self.workload.model_dump(mode="json"),
                "bundled": None if self.spec.bundled is None else self.spec.bundled.model_dump(mode="json"),
                "safety": {"production": self.safety.production,
                           "allowed_faults": "all" if self.safety.allowed_faults is None
                           else list(self.safety.allowed_faults)},
                "threshold_overrides": self.spec.threshold_overrides,
                "fabric": (self.fabric.describe() if self.fabric is not None
                           else {"unavailable": self.fabric_unavailable})}


def settings_spec(settings: FabricSettings) -> Any:
    """The harness.fabric ShapingSpec of a cluster file's fabric settings (validates them)."""
    from harness.fabric.shaping import ShapingSpec

    return ShapingSpec(line_rate_bps=settings.line_rate_bps, mtu=settings.mtu,
                       lossless_share=settings.lossless_share, tcp_in_lossless=settings.tcp_in_lossless)


@contextlib.contextmanager
def open_cluster(spec: ClusterSpec, checklist: Checklist | None = None, *,
                 log_dir: Path | None = None, run: Any = None, send: bool = True) -> Iterator[ClusterHandle]:
    """Bring a bundled cluster up for the duration of the block (process logs in ``log_dir``),
    or attach to an external one (with ``send``, checking first that it answers and accepts the
    requests its engine's request shape makes; a dry run, ``send=False``, contacts nothing).
    ``run`` (a harness.faults.runs.RunRecord) is told the router and the fabric slot, so a later run can clean up if this one dies. Whatever was built is torn down
    on every way out, bring-up errors included; SIGINT and SIGTERM wait until the teardown is done."""
    from harness.signals import deferred

    thresholds = spec.checklist(checklist)
    if spec.kind == "external":
        assert spec.endpoints is not None
        if send:  # a dry run contacts nothing: it needs neither the API nor its key
            _check_reachable(spec.endpoints.api, spec, spec.api_key())
            from harness.probes.client.request_shape import check_request_shape, request_shape

            # a server that rejects a field the harness sends would fail every request: say so now
            check_request_shape(spec.endpoints.api, request_shape(spec.engine_name), model=spec.model,
                                api_key=spec.api_key())
        yield ClusterHandle(spec, thresholds, spec.endpoints.api, spec.endpoints.metrics, spec.endpoints.admin,
                            dry_run=not send)
        return
    with deferred():  # an interrupt raised inside torch's import can abort the process (-6)
        from harness.engine.core.oracle import greedy_reference
        from harness.engine.pd.topology import Topology

    b = spec.bundled
    assert b is not None
    log.info("bringing up bundled cluster %s: %d prefill + %d decode, preset %s", spec.name, b.prefill, b.decode,
             b.preset)
    stack = contextlib.ExitStack()
    try:
        fabric, unavailable, placement = _bundled_fabric(spec, stack, None if run is None else run.set_fabric)
        try:
            topo = Topology(prefill=b.prefill, decode=b.decode, preset=b.preset, host=b.host,
                            router_config=b.router.model_dump(exclude_unset=True),
                            engine_config=b.engine.model_dump(exclude_unset=True),
                            startup_timeout_s=b.ready_timeout_s, log_dir=log_dir,
                            **placement)
        except ConfigError as exc:  # the router rejected a knob: point at the cluster file, not the engine
            raise field_error(spec.path, "bundled.router", str(exc), exc.fix or "see docs/clusters.md") from exc
        stack.push(lambda *exc: topo.stop())  # the workers stop before their fabric is torn down
        topo.start()
        if run is not None:
            run.set_router(topo.router_pid, topo.api_url)
    except BaseException:
        with deferred():
            stack.close()
        raise

    def oracle(prompt_token_ids: list[int], max_tokens: int, stop: tuple[str, ...] = (),
               ignore_eos: bool = False) -> list[int]:
        return greedy_reference(b.preset, prompt_token_ids, max_tokens, stop=stop, ignore_eos=ignore_eos)

    try:
        # the router serves /admin/* under its API address: that base URL is the admin endpoint
        yield ClusterHandle(spec, thresholds, topo.api_url, f"{topo.api_url}/metrics", topo.api_url,
                            topology=topo, oracle=oracle, fabric=fabric, fabric_unavailable=unavailable)
    finally:
        with deferred():
            stack.close()


def _bundled_fabric(spec: ClusterSpec, stack: contextlib.ExitStack,
                    on_prefix: Callable[[str], Any] | None = None) -> tuple[Any, str | None, dict[str, Any]]:
    """Build the emulated fabric (docs/fabric.md) when the cluster file enables it and this machine
    can; else say why and run on loopback. Returns (Fabric or None, reason or None, Topology kwargs).
    ``on_prefix`` learns the slot's namespace prefix before the first namespace is made (the run
    record: a run killed while it builds leaves namespaces a later run must find)."""
    if not spec.fabric.enabled:
        return None, "the cluster file does not enable the emulated fabric (fabric.enabled)", {}
    from harness.fabric.builder import Fabric, fabric_unavailable_reason

    reason = fabric_unavailable_reason()
    if reason:
        log.warning("cluster %s: no emulated fabric (%s); running on loopback", spec.name, reason)
        return None, reason, {}
    b = spec.bundled
    assert b is not None
    ids = [f"prefill-{i}" for i in range(b.prefill)] + [f"decode-{i}" for i in range(b.decode)]
    fabric = Fabric.in_free_slot(len(ids), settings_spec(spec.fabric))  # the slot, nothing built yet
    if on_prefix is not None:
        on_prefix(fabric.config.prefix)
    stack.enter_context(fabric)
    return fabric, None, fabric.topology_kwargs(ids)


def _check_reachable(api_url: str, spec: ClusterSpec, api_key: str | None) -> None:
    import httpx

    try:
        httpx.get(f"{api_url}/health", timeout=10.0, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    except httpx.HTTPError as exc:
        raise ProbeError(f"cluster {spec.name!r}: API {api_url} is not reachable ({exc.__class__.__name__}: {exc})",
                         fix=f"check endpoints.api in {spec.path} and that this machine can reach it") from exc
