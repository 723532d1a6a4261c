"""Capabilities, not crashes: what a cluster provides, what each checklist item needs, and the
inconclusive verdict of an item whose needs the cluster cannot meet.

A suite declares its items with ``pytest.mark.item("6.1.4", "nothing-lost")`` on its
``pytestmark``; before its body runs the plugin compares :data:`ITEM_NEEDS` (or the marker's own
``needs=``) with :func:`capabilities_of` the cluster and, for a missing capability, records an
INCONCLUSIVE verdict per item whose reason names the capability and what would provide it.
An item may have other ways to be judged (:data:`ITEM_ALTERNATIVES`, e.g. 6.1.3 by load on a
foreign engine): it runs when the cluster meets any one of them, and the reason names each.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from itertools import product
from typing import Any, Iterable, Sequence

from harness.checks import reasons
from harness.checks.verdict import Status, Verdict
from harness.errors import ConfigError

# capability -> what would provide it (the second half of every "needs ..." reason)
PROVIDERS: dict[str, str] = {
    "admin_api": "`kind: bundled`, or endpoints.admin serving the bundled engine's /admin API",
    "live_migration": "an engine that migrates a stream on request (the bundled engine's POST /admin/migrate), "
                      "or one that resumes streams elsewhere when their worker is lost (`migration: "
                      "{on_worker_loss: true}`, e.g. Dynamo's --migration-limit) with a restartable `workers:` list",
    "fault_hooks": "the bundled engine's /admin fault hooks (HBM fill, ECC poisoning)",
    "emulated_fabric": "the emulated fabric (`kind: bundled`, fabric.enabled, root and iproute2) or `ssh:` and "
                       "`fabric:` settings on two or more hosts of an external cluster (docs/fabric.md)",
    "ssh_hosts": "`ssh:` settings on the cluster file's hosts",
    "gpu": "an NVIDIA GPU the harness can read (bundled engine on CUDA, or GPU hosts over SSH)",
    "worker_inventory": "a `workers:` list in the cluster file, endpoints.admin, or the bundled topology",
    "restartable_workers": "`restart: {command: ...}` or `supervised: true` on every worker (or the bundled "
                           "topology)",
    "engine_metrics": "endpoints.metrics and an engine with a metric profile (bundled, vllm, sglang, dynamo)",
    "kv_use_metric": "an engine whose metric profile reads KV use (vllm, sglang, dynamo) and endpoints.metrics or "
                     "workers[].metrics",
    "gpu_fault_injection": "DCGM on the workers' hosts (`hosts[].dcgm`) and the GPUs each decode or aggregated "
                           "worker runs on (`workers[].gpus`): ECC/XID errors injected into the monitoring path",
    "degradation_expectations": "a `degradation: {levels: [...]}` section in the cluster file stating each level's "
                                "KV-use threshold and expected actions (docs/clusters.md)",
}

# item -> capabilities its suite needs (a suite marker's needs= overrides; absent: needs nothing)
ITEM_NEEDS: dict[str, tuple[str, ...]] = {
    "6.1.1": ("emulated_fabric",),
    # with an admin API streams are live-migrated on request; without one, workers of the inventory are
    # killed and the streams the engine moved are judged from the client (suites/test_item2_hot_migration.py)
    "6.1.2": ("live_migration",),
    "6.1.3": ("admin_api", "fault_hooks"),
    "ecc": ("admin_api", "fault_hooks"),
    # with an admin API the router's events are read too; without one, the inventory's processes are
    # killed and hung and the item is judged from the client records (suites/test_item4_reschedule.py)
    "6.1.4": ("worker_inventory", "restartable_workers"),
    "6.1.5": ("emulated_fabric",),
    "nic-flap": ("emulated_fabric",),
    "6.2.ttft": (),
    "6.2.tpot": (),
    "nothing-lost": (),
    # the soak needs the admin API (router events, worker table), but it checks that itself: the gate
    # would record its items inconclusive on every external run, where without --soak they are "not run"
    "soak.faults": (),
    "soak.slo": (),
    "soak.leaks": (),
}

# item -> other capability sets that also let it be judged (with a different measurement); the
# ITEM_NEEDS set comes first
ITEM_ALTERNATIVES: dict[str, tuple[tuple[str, ...], ...]] = {
    # by load: long-prompt streams drive the engine's own KV-use metric over the cluster file's thresholds
    # and the stated actions are checked on the API (suites/test_item3_degradation.py)
    "6.1.3": (("kv_use_metric", "degradation_expectations"),),
    # through DCGM: an ECC error injected into a worker's GPU monitoring must get that worker drained
    # (suites/test_ecc_poisoning.py, harness/faults/dcgm.py)
    "ecc": (("gpu_fault_injection", "worker_inventory"),),
}


@dataclass(frozen=True)
class Capabilities:
    """``provided``: capability -> bool; ``why_not``: capability -> why this cluster lacks it."""

    provided: dict[str, bool]
    why_not: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.provided) - set(PROVIDERS)
        if unknown:
            raise ConfigError(f"unknown capabilities {sorted(unknown)}", fix=f"use names from {sorted(PROVIDERS)}")

    def missing(self, needs: Iterable[str]) -> list[str]:
        return [c for c in dict.fromkeys(needs) if not self.provided.get(c, False)]

    def cause(self, missing_per_way: Sequence[Sequence[str]]) -> dict[str, Any]:
        """The ``capability`` cause (harness/checks/reasons.py): per way the item could be judged, each
        missing capability, why it is missing here and what would provide it."""
        return reasons.cause("capability", missing=[
            [{"capability": cap, "why_not": self.why_not.get(cap) or None, "provided_by": PROVIDERS[cap]} for cap in way]
            for way in missing_per_way])

    def reason(self, missing: Sequence[str]) -> str:
        """One line naming each missing capability, why it is missing here and what would provide it."""
        return self.reason_any([missing])

    def reason_any(self, missing_per_way: Sequence[Sequence[str]]) -> str:
        """:meth:`reason` for an item with several ways to be judged: each way's gaps, joined by "or"."""
        return reasons.render([self.cause(missing_per_way)])

    def to_dict(self) -> dict[str, Any]:
        return {c: {"provided": self.provided.get(c, False), "why_not": self.why_not.get(c),
                    "provided_by": PROVIDERS[c]} for c in PROVIDERS}


def check_capability_names(needs: Iterable[str], where: str) -> None:
    for cap in needs:
        if cap not in PROVIDERS:
            raise ConfigError(f"{where}: unknown capability {cap!r}", fix=f"use one of {', '.join(PROVIDERS)}")


def needs_of(items: Sequence[str], override: Sequence[str] | None = None) -> tuple[str, ...]:
    """The capabilities a suite covering ``items`` needs (``override``: the suite's own list)."""
    if override is not None:
        return tuple(override)
    return tuple(dict.fromkeys(c for item in items for c in ITEM_NEEDS.get(item, ())))


def ways_of(items: Sequence[str], override: Sequence[str] | None = None) -> list[tuple[str, ...]]:
    """Every capability set that lets a suite covering ``items`` run: one per combination of its
    items' ways (ITEM_NEEDS, then ITEM_ALTERNATIVES); ``override``: the suite's own single set."""
    if override is not None:
        return [tuple(override)]
    per_item = [[ITEM_NEEDS.get(i, ()), *ITEM_ALTERNATIVES.get(i, ())] for i in items]
    return list(dict.fromkeys(tuple(dict.fromkeys(c for needs in combo for c in needs))
                              for combo in product(*per_item)))


def capabilities_of(cluster: Any) -> Capabilities:
    """What ``cluster`` (a ClusterHandle) provides, derived from its kind, engine, endpoints,
    fabric, hosts and workers."""
    spec = cluster.spec
    bundled = spec.kind == "bundled"
    admin = bool(cluster.admin_url)
    no_admin = "no endpoints.admin in the cluster file" if not admin else None
    workers = spec.workers
    not_back = [w.name for w in workers if not w.restartable]
    ssh = any(h.ssh is not None for h in spec.hosts)
    kv_urls = bool(cluster.metrics_url) or any(w.metrics for w in workers)
    profile = spec.metric_profile
    kv_metric = kv_urls and profile is not None and "kv_usage" in _profile(profile)
    from harness.fabric.ssh_hosts import ssh_fabric_reason

    ssh_fabric = None if bundled else ssh_fabric_reason(spec)   # None: the fabric is reached over SSH
    provided = {
        "admin_api": admin,
        "live_migration": admin or (spec.migration is not None and spec.migration.on_worker_loss
                                    and bool(workers) and not not_back),
        "fault_hooks": admin,
        "emulated_fabric": cluster.fabric is not None or (not bundled and ssh_fabric is None),
        "ssh_hosts": ssh,
        "gpu": bundled and _local_gpu(),
        "worker_inventory": cluster.topology is not None or admin or bool(workers),
        "restartable_workers": cluster.topology is not None or (bool(workers) and not not_back),
        "engine_metrics": bool(cluster.metrics_url) and spec.metric_profile is not None,
        "kv_use_metric": kv_metric,
        "degradation_expectations": getattr(spec, "degradation", None) is not None,
        "gpu_fault_injection": bool(dcgm_workers(spec)),
    }
    why = {
        "admin_api": no_admin, "fault_hooks": no_admin,
        "live_migration": ("no endpoints.admin, and the cluster file does not say the engine migrates streams "
                           "on worker loss (`migration: {on_worker_loss: true}`)"
                           if spec.migration is None or not spec.migration.on_worker_loss else
                           "the engine migrates on worker loss, but "
                           + (f"{', '.join(not_back)} cannot come back after a kill" if not_back
                              else "the cluster file lists no `workers:` to kill")),
        "emulated_fabric": cluster.fabric_unavailable or (ssh_fabric if not bundled
                                                          else "the cluster has no emulated fabric"),
        "ssh_hosts": "no host has `ssh:` settings",
        "gpu": "no NVIDIA device on this machine" if bundled else "GPU state of remote hosts is not read",
        "worker_inventory": "no `workers:` list and no endpoints.admin",
        "restartable_workers": (f"no way back for {', '.join(not_back)} (no restart command, not supervised)"
                                if not_back else "no `workers:` list"),
        "engine_metrics": ("no endpoints.metrics" if not cluster.metrics_url
                           else f"engine {spec.engine_name!r} has no metric profile"),
        "kv_use_metric": ("no endpoints.metrics or workers[].metrics" if not kv_urls
                          else f"engine {spec.engine_name!r} has no metric profile" if profile is None
                          else f"the {profile} metric profile names no KV-use metric"),
        "degradation_expectations": "the cluster file states no degradation expectations (degradation.levels)",
        "gpu_fault_injection": "no decode or aggregated worker names its GPUs (`workers[].gpus`) on a host with "
                               "`dcgm:`",
    }
    return Capabilities(provided, {c: w for c, w in why.items() if w and not provided[c]})


def dcgm_workers(spec: Any) -> list[Any]:
    """Decode or aggregated workers whose GPUs are named and whose host runs DCGM."""
    dcgm_hosts = {h.name for h in spec.hosts if getattr(h, "dcgm", None) is not None}
    return [w for w in spec.workers if w.gpus and w.host in dcgm_hosts and str(w.role) in ("decode", "aggregated")]


def _profile(name: str) -> dict[str, str]:
    from harness.probes.metrics.prometheus import ENGINE_PROFILES

    return ENGINE_PROFILES.get(name, {})


def _local_gpu() -> bool:
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def not_supported(checklist: Any, items: Sequence[str], caps: Capabilities, missing: Sequence[str],
                  other_ways: Sequence[Sequence[str]] = ()) -> list[Verdict]:
    """One INCONCLUSIVE verdict per item, naming the missing capabilities and their providers
    (``other_ways``: what each other way of judging the items lacks, named after "or")."""
    ways = [list(missing), *(list(m) for m in other_ways)]
    why = caps.cause(ways)
    every = list(dict.fromkeys(c for m in ways for c in m))
    evidence: dict[str, Any] = {"missing_capabilities": list(missing), "provided_by": {c: PROVIDERS[c] for c in every}}
    if other_ways:
        evidence["missing_per_way"] = ways
    return [Verdict(item=item, title=checklist.item(item).title, status=Status.INCONCLUSIVE, causes=(why,),
                    evidence=dict(evidence)) for item in items]


def coverage(verdicts: Iterable[Verdict], checklist_items: Iterable[str] = ()) -> dict[str, Any]:
    """Which items were judged (a pass or fail), which could not be (inconclusive or error, with
    the reasons), and which no suite of this run reported on."""
    by_item: dict[str, list[Verdict]] = {}
    for v in verdicts:
        by_item.setdefault(v.item, []).append(v)
    judged, not_judged = {}, {}
    for item, vs in by_item.items():
        decided = [v for v in vs if v.status in (Status.PASS, Status.FAIL)]
        if decided:
            judged[item] = "fail" if any(v.status == Status.FAIL for v in decided) else "pass"
        else:
            not_judged[item] = sorted({v.reason for v in vs})
    return {"judged": judged, "not_judged": not_judged,
            "not_run": [i for i in checklist_items if i not in by_item]}


# -- the suite side: pytest.mark.item on a suite, checked at collection and before each test --------

ITEM_MARKER = "item"


def item_marker(node: Any) -> tuple[tuple[str, ...], tuple[str, ...] | None] | None:
    """(item ids, needs override) of a pytest node's ``item`` marker, or None."""
    marker = node.get_closest_marker(ITEM_MARKER)
    if marker is None:
        return None
    needs = marker.kwargs.get("needs")
    return tuple(marker.args), None if needs is None else tuple(needs)


def check_item_markers(nodes: Iterable[Any], checklist: Any) -> None:
    """Every marker names known checklist items and capabilities (a ConfigError, exit 3, if not)."""
    for node in nodes:
        found = item_marker(node)
        if found is None:
            continue
        ids, needs = found
        if not ids:
            raise ConfigError(f"{node.nodeid}: pytest.mark.item() names no checklist item",
                              fix='write e.g. pytest.mark.item("6.1.4", "nothing-lost")')
        for item_id in ids:
            checklist.item(item_id)  # ConfigError naming the known items
        check_capability_names(needs or (), node.nodeid)


def gate(node: Any, fixture: Any) -> list[str]:
    """For a suite test ``node``: the capabilities its items need that the cluster lacks, after
    recording one inconclusive verdict per item through the ``conformance`` fixture. ``fixture``:
    pytest's ``request.getfixturevalue``. Empty: the test may run."""
    found = item_marker(node)
    if found is None:
        return []
    ids, override = found
    ways = ways_of(ids, override)
    if not any(ways):
        return []
    cluster = fixture("cluster")
    caps = cluster.capabilities()
    missing = [caps.missing(needs) for needs in ways]
    if all(missing):
        conformance = fixture("conformance")
        for verdict in not_supported(cluster.thresholds, ids, caps, missing[0], missing[1:]):
            conformance.record(verdict)
        return missing[0]
    return []
