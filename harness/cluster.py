"""Cluster inventories (``clusters/*.yaml``): schema, validation, and the handle tests receive.

A cluster is either ``bundled`` (the reference PD engine, brought up on this machine for the
session) or ``external`` (already running; the harness attaches to its endpoints). The file
also lists hosts with roles and SSH settings, threshold overrides and safety settings. Every
validation error names the file, the field and the fix; see ``docs/clusters.md``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

from harness.checks.thresholds import (Checklist, as_number, display_path, field_error,
                                      load_yaml_mapping)
from harness.errors import ConfigError, FaultError, ProbeError

log = logging.getLogger(__name__)

# the shipped examples (a link to clusters/ in a checkout); `--cluster NAME` looks in ./clusters/ first
CLUSTERS_DIR = Path(__file__).resolve().parent / "clusters"
KINDS = ("bundled", "external")
ROLES = ("router", "prefill", "decode")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TOP_KEYS = {"name", "kind", "description", "bundled", "endpoints", "hosts", "thresholds", "safety", "fabric"}
_FABRIC_KEYS = {"enabled", "line_rate_bps", "mtu", "lossless_share", "tcp_in_lossless"}
_BUNDLED_KEYS = {"prefill", "decode", "preset", "host", "router", "engine", "ready_timeout_s"}
# set by the harness per worker, not by a cluster file
_ENGINE_RESERVED = {"preset": "bundled.preset", "name": "the worker id"}


@dataclass(frozen=True)
class SSHSettings:
    user: str
    port: int
    key_file: str
    known_hosts: str  # the only host keys accepted for this host
    connect_timeout_s: float = 10.0


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    roles: tuple[str, ...]
    ssh: SSHSettings | None = None  # None: the host is this machine, commands run locally


@dataclass(frozen=True)
class Safety:
    production: bool = False
    allowed_faults: tuple[str, ...] | None = None  # None: every fault kind (never for production)

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


@dataclass(frozen=True)
class BundledSettings:
    prefill: int = 2
    decode: int = 2
    preset: str = "tiny"
    host: str = "127.0.0.1"
    router: dict[str, Any] = field(default_factory=dict)  # router config knobs (sabotage included)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields of every worker
    ready_timeout_s: float = 120.0


@dataclass(frozen=True)
class FabricSettings:
    """The bundled cluster's emulated fabric (docs/fabric.md); needs root and iproute2."""

    enabled: bool = False
    line_rate_bps: float = 5e8
    mtu: int = 9000
    lossless_share: float = 0.5
    tcp_in_lossless: bool = False  # deliberately broken: TCP/IP traffic shares the paused class


@dataclass(frozen=True)
class Endpoints:
    api: str
    metrics: str | None = None
    admin: str | None = None


@dataclass(frozen=True)
class ClusterSpec:
    """A validated cluster inventory."""

    name: str
    kind: str
    path: str
    description: str = ""
    bundled: BundledSettings | None = None
    endpoints: Endpoints | None = None
    hosts: tuple[Host, ...] = ()
    safety: Safety = field(default_factory=Safety)
    threshold_overrides: dict[str, Any] = field(default_factory=dict)
    fabric: FabricSettings = field(default_factory=FabricSettings)

    def checklist(self, base: Checklist | None = None) -> Checklist:
        """The checklist thresholds with this cluster's overrides applied."""
        return (base or Checklist.load()).with_overrides(self.threshold_overrides or None, origin=self.path)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        return asdict(self)


def cluster_search_path(cwd: Path | None = None) -> list[Path]:
    """Where ``--cluster NAME`` looks, in order: the user's ``./clusters/``, then the shipped examples."""
    dirs = [(cwd or Path.cwd()) / "clusters", CLUSTERS_DIR]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and all(d.resolve() != u.resolve() for u in unique):
            unique.append(d)
    return unique


def resolve_cluster_path(name_or_path: str, clusters_dir: Path | None = None) -> Path:
    """``local`` -> ``./clusters/local.yaml`` if it exists, else the shipped ``local.yaml``
    (or only ``clusters_dir`` when given); anything with a slash or a .yaml suffix is a path."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return Path(name_or_path)
    if not _NAME.match(name_or_path):
        raise ConfigError(f"--cluster {name_or_path!r} is neither a cluster name nor a path",
                          fix="pass a name from clusters/ (e.g. local) or a path to a .yaml file")
    dirs = [clusters_dir] if clusters_dir is not None else cluster_search_path()
    for d in dirs:
        path = d / f"{name_or_path}.yaml"
        if path.is_file():
            return path
    known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
    looked = " and ".join(str(d) for d in dirs) or f"{Path.cwd() / 'clusters'} (missing)"
    raise ConfigError(f"--cluster {name_or_path}: no cluster named {name_or_path!r} (looked in {looked})",
                      fix=f"use one of {', '.join(known) or '(none)'}, put {name_or_path}.yaml in ./clusters/ "
                          "or pass a path to a cluster file")


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """Read and validate a cluster inventory (name under ``clusters/`` or a path)."""
    path = resolve_cluster_path(str(name_or_path))
    data = load_yaml_mapping(path)
    spec = parse_cluster(data, source=display_path(path))
    spec.checklist()  # validates the threshold overrides against the checklist now, not mid-run
    return spec


def parse_cluster(data: dict[str, Any], *, source: str) -> ClusterSpec:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        key = sorted(unknown)[0]
        raise field_error(source, key, "unknown field", f"use only {', '.join(sorted(_TOP_KEYS))}")
    name = _text(source, "name", data.get("name", Path(source).stem))
    if not _NAME.match(name):
        raise field_error(source, "name", f"{name!r} is not a valid name", "use letters, digits, '-', '_', '.'")
    kind = data.get("kind")
    if kind not in KINDS:
        raise field_error(source, "kind", f"expected one of {KINDS}, got {kind!r}",
                          "write `kind: bundled` (reference engine here) or `kind: external` (attach)")
    bundled = endpoints = None
    if kind == "bundled":
        bundled = _parse_bundled(source, data.get("bundled") or {})
        if data.get("endpoints"):
            raise field_error(source, "endpoints", "a bundled cluster's endpoints are chosen at start-up",
                              "remove `endpoints:` or use `kind: external`")
    else:
        if data.get("bundled"):
            raise field_error(source, "bundled", "only a bundled cluster has bundled settings",
                              "remove `bundled:` or use `kind: bundled`")
        endpoints = _parse_endpoints(source, data.get("endpoints"))
    hosts = _parse_hosts(source, data.get("hosts") or [])
    safety = _parse_safety(source, data.get("safety") or {})
    overrides = data.get("thresholds") or {}
    if not isinstance(overrides, dict):
        raise field_error(source, "thresholds", "expected a mapping", 'write `"6.1.4": {reschedule_p100_s: 3}`')
    fabric = _parse_fabric(source, data.get("fabric") or {})
    if fabric.enabled and kind != "bundled":
        raise field_error(source, "fabric.enabled", "only the bundled cluster runs on the emulated fabric",
                          "remove `fabric:` (a real cluster brings its own fabric)")
    return ClusterSpec(name=name, kind=kind, path=source, description=str(data.get("description", "")).strip(),
                       bundled=bundled, endpoints=endpoints, hosts=hosts, safety=safety,
                       threshold_overrides=overrides, fabric=fabric)


def _parse_fabric(source: str, raw: Any) -> FabricSettings:
    raw = _mapping(source, "fabric", raw, _FABRIC_KEYS)
    for key in ("enabled", "tcp_in_lossless"):
        if not isinstance(raw.get(key, False), bool):
            raise field_error(source, f"fabric.{key}", f"expected true or false, got {raw[key]!r}",
                              f"write `{key}: true` or `{key}: false`")
    settings = FabricSettings(
        enabled=raw.get("enabled", False), tcp_in_lossless=raw.get("tcp_in_lossless", False),
        line_rate_bps=as_number(source, "fabric.line_rate_bps", raw.get("line_rate_bps", 5e8)),
        mtu=_positive_int(source, "fabric.mtu", raw.get("mtu", 9000)),
        lossless_share=as_number(source, "fabric.lossless_share", raw.get("lossless_share", 0.5)))
    try:
        settings_spec(settings)
    except ConfigError as exc:
        raise field_error(source, "fabric", str(exc), exc.fix or "see docs/fabric.md") from None
    return settings


def settings_spec(settings: FabricSettings) -> Any:
    """The harness.fabric ShapingSpec of these settings (validates them)."""
    from harness.fabric.shaping import ShapingSpec

    return ShapingSpec(line_rate_bps=settings.line_rate_bps, mtu=settings.mtu,
                       lossless_share=settings.lossless_share, tcp_in_lossless=settings.tcp_in_lossless)


def _text(source: str, where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise field_error(source, where, f"expected non-empty text, got {value!r}", f"write `{where}: some-text`")
    return value.strip()


def _positive_int(source: str, where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise field_error(source, where, f"expected an integer >= {minimum}, got {value!r}",
                          f"write a whole number such as {max(minimum, 2)}")
    return value


def _mapping(source: str, where: str, value: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise field_error(source, where, f"expected a mapping, got {type(value).__name__}",
                          f"write `{where}:` followed by indented `key: value` lines")
    for key in value:
        if key not in allowed:
            raise field_error(source, f"{where}.{key}", "unknown field", f"use only {', '.join(sorted(allowed))}")
    return value


def _url(source: str, where: str, value: Any) -> str:
    text = _text(source, where, value)
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise field_error(source, where, f"{text!r} is not an http(s) URL", "write e.g. http://10.0.0.5:8000")
    return text.rstrip("/")


def _parse_bundled(source: str, raw: Any) -> BundledSettings:
    raw = _mapping(source, "bundled", raw, _BUNDLED_KEYS)
    router = raw.get("router") or {}
    if not isinstance(router, dict):
        raise field_error(source, "bundled.router", "expected a mapping of router settings",
                          "write e.g. `router: {reschedule_enabled: true}`")
    timeout = as_number(source, "bundled.ready_timeout_s", raw.get("ready_timeout_s", 120.0))
    if timeout <= 0:
        raise field_error(source, "bundled.ready_timeout_s", "must be positive", "write e.g. 120")
    return BundledSettings(
        prefill=_positive_int(source, "bundled.prefill", raw.get("prefill", 2)),
        decode=_positive_int(source, "bundled.decode", raw.get("decode", 2)),
        preset=_text(source, "bundled.preset", raw.get("preset", "tiny")),
        host=_text(source, "bundled.host", raw.get("host", "127.0.0.1")),
        router=dict(router), engine=_parse_engine(source, raw.get("engine"), raw.get("preset", "tiny")),
        ready_timeout_s=timeout)


def _parse_engine(source: str, raw: Any, preset: Any) -> dict[str, Any]:
    """``bundled.engine``: EngineConfig fields, checked by EngineConfig's own validation one key
    at a time (so the error names the key), then together."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise field_error(source, "bundled.engine", f"expected a mapping of engine settings, got {raw!r}",
                          "write e.g. `engine: {ecc_handling: false}`")
    if not raw:
        return {}
    from harness.engine.config import EngineConfig  # imports torch: only when a file sets engine fields

    def check(where: str, **values: Any) -> None:
        try:
            EngineConfig(preset=preset, **values)
        except (ConfigError, TypeError, ValueError) as exc:
            fix = getattr(exc, "fix", None)
            problem = str(exc).removesuffix(f" (fix: {fix})") if fix else str(exc)
            raise field_error(source, where, problem, fix or "see EngineConfig in harness/engine/config.py") from exc

    check("bundled.preset")
    allowed = {f.name for f in fields(EngineConfig)} - set(_ENGINE_RESERVED)
    for key, value in raw.items():
        if key in _ENGINE_RESERVED:
            raise field_error(source, f"bundled.engine.{key}", f"is set by the harness ({_ENGINE_RESERVED[key]})",
                              "remove it" + ("; set bundled.preset instead" if key == "preset" else ""))
        if key not in allowed:
            raise field_error(source, f"bundled.engine.{key}", "unknown engine setting",
                              f"use only {', '.join(sorted(allowed))}")
        check(f"bundled.engine.{key}", **{key: value})
    check("bundled.engine", **raw)
    return dict(raw)


def _parse_endpoints(source: str, raw: Any) -> Endpoints:
    if raw is None:
        raise field_error(source, "endpoints", "an external cluster needs its endpoints",
                          "add `endpoints: {api: http://HOST:PORT, metrics: http://HOST:PORT/metrics}`")
    raw = _mapping(source, "endpoints", raw, {"api", "metrics", "admin"})
    return Endpoints(api=_url(source, "endpoints.api", raw.get("api")),
                     metrics=_url(source, "endpoints.metrics", raw["metrics"]) if raw.get("metrics") else None,
                     admin=_url(source, "endpoints.admin", raw["admin"]) if raw.get("admin") else None)


def _parse_hosts(source: str, raw: Any) -> tuple[Host, ...]:
    if not isinstance(raw, list):
        raise field_error(source, "hosts", "expected a list", "write `hosts:` followed by `- name: ...` entries")
    hosts, seen = [], set()
    for i, entry in enumerate(raw):
        where = f"hosts[{i}]"
        entry = _mapping(source, where, entry, {"name", "address", "roles", "ssh"})
        name = _text(source, f"{where}.name", entry.get("name"))
        if name in seen:
            raise field_error(source, f"{where}.name", f"duplicate host name {name!r}", "give each host its own name")
        seen.add(name)
        roles = entry.get("roles")
        if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
            raise field_error(source, f"{where}.roles", f"expected a non-empty list from {ROLES}, got {roles!r}",
                              "write e.g. `roles: [prefill]`")
        ssh = None
        if entry.get("ssh") is not None:
            raw_ssh = _mapping(source, f"{where}.ssh", entry["ssh"],
                               {"user", "port", "key_file", "known_hosts", "connect_timeout_s"})
            port = _positive_int(source, f"{where}.ssh.port", raw_ssh.get("port", 22))
            if port > 65535:
                raise field_error(source, f"{where}.ssh.port", f"{port} is not a TCP port", "use 1..65535")
            for key in ("key_file", "known_hosts"):  # host keys are never learned blindly
                if key not in raw_ssh:
                    raise field_error(source, f"{where}.ssh.{key}", "missing",
                                      f"add `{key}: PATH` (the private key / the file holding the host's key)")
            ssh = SSHSettings(
                user=_text(source, f"{where}.ssh.user", raw_ssh.get("user", "root")), port=port,
                key_file=_text(source, f"{where}.ssh.key_file", raw_ssh["key_file"]),
                known_hosts=_text(source, f"{where}.ssh.known_hosts", raw_ssh["known_hosts"]),
                connect_timeout_s=as_number(source, f"{where}.ssh.connect_timeout_s",
                                            raw_ssh.get("connect_timeout_s", 10.0)))
        hosts.append(Host(name=name, address=_text(source, f"{where}.address", entry.get("address")),
                          roles=tuple(roles), ssh=ssh))
    return tuple(hosts)


def _parse_safety(source: str, raw: Any) -> Safety:
    raw = _mapping(source, "safety", raw, {"production", "allowed_faults"})
    production = raw.get("production", False)
    if not isinstance(production, bool):
        raise field_error(source, "safety.production", f"expected true or false, got {production!r}",
                          "write `production: true` for a cluster that serves users")
    allowed = raw.get("allowed_faults", [] if production else "all")
    if allowed == "all":
        if production:
            raise field_error(source, "safety.allowed_faults", "a production cluster cannot allow every fault",
                              "list each fault kind you accept, e.g. [process_kill]")
        return Safety(production=False, allowed_faults=None)
    if not isinstance(allowed, list) or any(not isinstance(k, str) or not k for k in allowed):
        raise field_error(source, "safety.allowed_faults", f"expected `all` or a list of fault kinds, got {allowed!r}",
                          "write e.g. `allowed_faults: [process_kill, process_hang]`")
    known = _known_fault_kinds()
    for i, kind in enumerate(allowed):
        if known and kind not in known:
            raise field_error(source, f"safety.allowed_faults[{i}]", f"unknown fault kind {kind!r}",
                              f"use one of {', '.join(sorted(known))}")
    return Safety(production=production, allowed_faults=tuple(allowed))


def _known_fault_kinds() -> set[str]:
    """Fault kinds registered by harness.faults (empty if that package cannot be imported)."""
    try:
        import harness.faults  # noqa: F401  (importing registers the catalogue)
        from harness.faults.base import Fault
    except ImportError:
        log.warning("harness.faults is not importable; fault kinds in safety settings are not checked")
        return set()
    return set(Fault.registry)


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
    def safety(self) -> Safety:
        return self.spec.safety

    def check_fault_allowed(self, fault_kind: str) -> None:
        self.spec.safety.check_allowed(fault_kind, self.spec.name)

    def ssh_target(self, host: str) -> Any:
        """The SSH target for a worker's host (matched by host name or address), or None when
        commands for that host run locally. Built on demand: key files are checked only for
        hosts a fault actually touches."""
        from harness.faults import SSHTarget

        h = next((h for h in self.hosts if host in (h.name, h.address) and h.ssh is not None), None)
        if h is None or h.ssh is None:
            return None
        key_file, known = (str(Path(p).expanduser()) for p in (h.ssh.key_file, h.ssh.known_hosts))
        return SSHTarget(host=h.address, user=h.ssh.user, key_filename=key_file, known_hosts_file=known,
                         port=h.ssh.port, connect_timeout_s=h.ssh.connect_timeout_s)

    def describe(self) -> dict[str, Any]:
        """JSON-able description for the report."""
        return {"name": self.name, "kind": self.kind, "path": self.spec.path, "description": self.spec.description,
                "api_url": self.api_url, "metrics_url": self.metrics_url, "admin_url": self.admin_url,
                "hosts": [{"name": h.name, "address": h.address, "roles": list(h.roles),
                           "ssh": None if h.ssh is None else f"{h.ssh.user}@{h.address}:{h.ssh.port}"}
                          for h in self.hosts],
                "bundled": None if self.spec.bundled is None else vars(self.spec.bundled),
                "safety": {"production": self.safety.production,
                           "allowed_faults": "all" if self.safety.allowed_faults is None
                           else list(self.safety.allowed_faults)},
                "threshold_overrides": self.spec.threshold_overrides,
                "fabric": (self.fabric.describe() if self.fabric is not None
                           else {"unavailable": self.fabric_unavailable})}


@contextlib.contextmanager
def open_cluster(spec: ClusterSpec, checklist: Checklist | None = None, *,
                 log_dir: Path | None = None) -> Iterator[ClusterHandle]:
    """Bring a bundled cluster up for the duration of the block (process logs in ``log_dir``),
    or attach to an external one."""
    thresholds = spec.checklist(checklist)
    if spec.kind == "external":
        assert spec.endpoints is not None
        _check_reachable(spec.endpoints.api, spec)
        yield ClusterHandle(spec, thresholds, spec.endpoints.api, spec.endpoints.metrics, spec.endpoints.admin)
        return
    from harness.engine.oracle import greedy_reference
    from harness.engine.topology import Topology

    b = spec.bundled
    assert b is not None
    log.info("bringing up bundled cluster %s: %d prefill + %d decode, preset %s", spec.name, b.prefill, b.decode,
             b.preset)
    fabric_stack = contextlib.ExitStack()
    fabric, unavailable, placement = _bundled_fabric(spec, fabric_stack)
    try:
        topo = Topology(prefill=b.prefill, decode=b.decode, preset=b.preset, host=b.host,
                        router_config=dict(b.router), engine_config=dict(b.engine),
                        startup_timeout_s=b.ready_timeout_s, log_dir=log_dir,
                        **placement)
    except ConfigError as exc:  # the router rejected a knob: point at the cluster file, not the engine
        raise field_error(spec.path, "bundled.router", str(exc), exc.fix or "see docs/clusters.md") from exc

    def oracle(prompt_token_ids: list[int], max_tokens: int, stop: tuple[str, ...] = (),
               ignore_eos: bool = False) -> list[int]:
        return greedy_reference(b.preset, prompt_token_ids, max_tokens, stop=stop, ignore_eos=ignore_eos)

    with fabric_stack, topo:  # the workers stop before their fabric is torn down
        # the router serves /admin/* under its API address: that base URL is the admin endpoint
        yield ClusterHandle(spec, thresholds, topo.api_url, f"{topo.api_url}/metrics", topo.api_url,
                            topology=topo, oracle=oracle, fabric=fabric, fabric_unavailable=unavailable)


def _bundled_fabric(spec: ClusterSpec, stack: contextlib.ExitStack) -> tuple[Any, str | None, dict[str, Any]]:
    """Build the emulated fabric (docs/fabric.md) when the cluster file enables it and this machine
    can; else say why and run on loopback. Returns (Fabric or None, reason or None, Topology kwargs)."""
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
    fabric = stack.enter_context(Fabric.in_free_slot(len(ids), settings_spec(spec.fabric)))
    return fabric, None, fabric.topology_kwargs(ids)


def _check_reachable(api_url: str, spec: ClusterSpec) -> None:
    import httpx

    try:
        httpx.get(f"{api_url}/health", timeout=10.0)
    except httpx.HTTPError as exc:
        raise ProbeError(f"cluster {spec.name!r}: API {api_url} is not reachable ({exc.__class__.__name__}: {exc})",
                         fix=f"check endpoints.api in {spec.path} and that this machine can reach it") from exc
