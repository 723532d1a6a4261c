"""GPU state of the cluster's hosts, read over SSH for the report: what ran the test, and what the
GPUs recorded while it ran.

For every host of the cluster file with ``ssh:`` settings, ``nvidia-smi -q -x`` (harness/probes/
nvsmi.py) gives each GPU's model, driver and CUDA version, memory, ECC counters (volatile and
aggregate), retired pages and remapped rows; the kernel log gives XID events (``NVRM: Xid``, read
with ``dmesg``, which needs root on the host; without it the XID part says so). A snapshot is
taken when the cluster is attached and again when the run ends; :func:`changes` names every counter
that moved and every XID that appeared in between: an ECC error or an XID during a chaos run is
evidence the report must show, whatever the suites' verdicts.

A host without nvidia-smi, unreachable, or refusing the key is not an error: its entry says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from harness.probes.workers.nvsmi import GpuState, parse_xid_lines, read_gpus

log = logging.getLogger(__name__)

XID_ARGV = ["sh", "-c", "dmesg 2>/dev/null | grep 'NVRM: Xid' | tail -n 200; exit 0"]


@dataclass
class HostGpus:
    host: str
    gpus: list[GpuState] = field(default_factory=list)
    xids: list[dict[str, Any]] = field(default_factory=list)
    unavailable: str | None = None        # why nothing was read

    def summary(self) -> str:
        if self.unavailable:
            return f"{self.host}: not read ({self.unavailable})"
        if not self.gpus:
            return f"{self.host}: no GPU"
        models: dict[str, int] = {}
        for g in self.gpus:
            models[g.name] = models.get(g.name, 0) + 1
        first = self.gpus[0]
        kinds = ", ".join(f"{n}x {m}" for m, n in models.items())
        return f"{self.host}: {kinds}, driver {first.driver_version}, CUDA {first.cuda_version}"

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "unavailable": self.unavailable, "gpus": [g.to_dict() for g in self.gpus],
                "xids": self.xids}


def read_host(name: str, ex: Any) -> HostGpus:
    """One host's GPUs and recent XID lines through executor ``ex`` (local or SSH)."""
    out = HostGpus(name)
    try:
        out.gpus = read_gpus(ex)
    except Exception as exc:  # noqa: BLE001 - a host we cannot read is reported, never fatal
        out.unavailable = " ".join(str(exc).split())[:300]
        return out
    try:
        res = ex.run(XID_ARGV, timeout=30, check=False)
        out.xids = parse_xid_lines(res.stdout or "")
    except Exception as exc:  # noqa: BLE001
        log.info("XID lines not read on %s: %s", name, exc)
    return out


def read_hosts(cluster: Any, executor_for: Any) -> list[HostGpus]:
    """Every host of ``cluster`` (a ClusterHandle) with ``ssh:`` settings; ``executor_for(host)``
    gives its executor (the fault runner's pool: every command is audited)."""
    found = []
    for h in cluster.spec.hosts:
        if h.ssh is None:
            continue
        try:
            ex = executor_for(h.name)
        except Exception as exc:  # noqa: BLE001
            found.append(HostGpus(h.name, unavailable=f"no executor: {exc}"))
            continue
        found.append(read_host(h.name, ex))
    return found


# dcgm-exporter series whose change during a run is news (harness/probes/workers/nvsmi.py DCGM_FIELDS names them)
EXPORTER_FIELDS = ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_XID_ERRORS",
                   "DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS")


def read_exporter(url: str, timeout_s: float = 10.0) -> dict[str, float] | str:
    """``{"FIELD gpu=N": value}`` of :data:`EXPORTER_FIELDS` from a dcgm-exporter, or why not."""
    import httpx

    from harness.probes.metrics.prometheus import parse_metrics

    try:
        resp = httpx.get(url, timeout=timeout_s)
        resp.raise_for_status()
        samples = parse_metrics(resp.text)
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return f"{url}: {' '.join(str(exc).split())[:200]}"
    out = {}
    for x in samples:  # a counter typed `counter` comes back from the parser with `_total` appended
        name = x.name[:-len("_total")] if x.name.endswith("_TOTAL_total") else x.name
        if name in EXPORTER_FIELDS:
            out[f"{name} gpu={dict(x.labels).get('gpu', '?')}"] = x.value
    return out


def exporter_changes(host: str, before: dict[str, float] | str, after: dict[str, float] | str) -> list[str]:
    if isinstance(before, str) or isinstance(after, str):
        return []
    return [f"{host} dcgm-exporter {key}: {before.get(key)} -> {value:g}" for key, value in sorted(after.items())
            if before.get(key) != value]


_COUNTERS = (("ecc", "uncorrected_volatile"), ("ecc", "corrected_volatile"), ("ecc", "uncorrected_aggregate"),
             ("ecc", "corrected_aggregate"))


def changes(before: list[HostGpus], after: list[HostGpus]) -> list[str]:
    """What moved between two snapshots: ECC counters, retired pages, remapped rows, new XIDs,
    a GPU that disappeared; one line each."""
    lines = []
    old = {h.host: h for h in before}
    for h in after:
        prev = old.get(h.host)
        if prev is None or prev.unavailable or h.unavailable:
            continue
        by_bus = {g.bus_id: g for g in prev.gpus}
        for g in h.gpus:
            p = by_bus.pop(g.bus_id, None)
            if p is None:
                lines.append(f"{h.host} GPU {g.index} ({g.bus_id}) appeared during the run")
                continue
            for group, key in _COUNTERS:
                a, b = getattr(p, group).get(key), getattr(g, group).get(key)
                if a is not None and b is not None and b != a:
                    lines.append(f"{h.host} GPU {g.index}: ECC {key.replace('_', ' ')} {a} -> {b}")
            for group in ("retired_pages", "remapped_rows"):
                a, b = getattr(p, group), getattr(g, group)
                if a != b:
                    lines.append(f"{h.host} GPU {g.index}: {group.replace('_', ' ')} {a} -> {b}")
        lines += [f"{h.host} GPU at {bus} disappeared during the run" for bus in by_bus]
        seen = {(x["bus_id"], x["xid"], x["detail"]) for x in prev.xids}
        lines += [f"{h.host}: XID {x['xid']} on {x['bus_id']}: {x['detail']}" for x in h.xids
                  if (x["bus_id"], x["xid"], x["detail"]) not in seen]
    return lines


class HostGpuWatch:
    """The two snapshots of a run (at attach, at the end) over the cluster's SSH hosts, every
    command written to the fault runner's audit log; :meth:`environment` is the report's part."""

    def __init__(self, cluster: Any, audit_path: Any) -> None:
        from harness.hosts import AuditLog, ExecutorPool

        targets = {h.name: cluster.ssh_target(h.name) for h in cluster.spec.hosts if h.ssh is not None}
        self._pool = ExecutorPool(targets, audit=AuditLog(audit_path))
        self._cluster = cluster
        self.before: list[HostGpus] = []
        self.after: list[HostGpus] = []
        self._exporters = {h.name: h.dcgm.exporter for h in cluster.spec.hosts
                           if getattr(h, "dcgm", None) is not None and h.dcgm.exporter}
        self.exporter_before: dict[str, dict[str, float] | str] = {}
        self.exporter_after: dict[str, dict[str, float] | str] = {}

    @property
    def active(self) -> bool:
        return bool(self._pool.ssh) or bool(self._exporters)

    def start(self) -> None:
        if self._pool.ssh:
            self.before = read_hosts(self._cluster, self._pool)
        self.exporter_before = {h: read_exporter(url) for h, url in self._exporters.items()}

    def finish(self) -> None:
        try:
            if self._pool.ssh:
                self.after = read_hosts(self._cluster, self._pool)
            self.exporter_after = {h: read_exporter(url) for h, url in self._exporters.items()}
        finally:
            self._pool.close()

    def environment(self) -> dict[str, Any]:
        """``gpus_on_hosts`` (one summary line per host) and ``gpu_changes_during_run``, for the
        report's environment table; the full readings under ``gpu_readings``."""
        env: dict[str, Any] = {}
        if self.before:
            env["gpus_on_hosts"] = "; ".join(h.summary() for h in self.before)
        read_twice = {h.host for h in self.before if not h.unavailable} & {h.host for h in self.after
                                                                            if not h.unavailable}
        read_twice |= {h for h, v in self.exporter_after.items() if not isinstance(v, str)
                       and not isinstance(self.exporter_before.get(h, ""), str)}
        unread = [v for v in (*self.exporter_before.values(), *self.exporter_after.values()) if isinstance(v, str)]
        if unread:
            env["dcgm_exporters_not_read"] = "; ".join(unread)
        if read_twice:
            moved = changes(self.before, self.after) + [
                line for h in self.exporter_after for line in
                exporter_changes(h, self.exporter_before.get(h, ""), self.exporter_after[h])]
            env["gpu_changes_during_run"] = ("; ".join(moved) if moved else
                                             f"none on {', '.join(sorted(read_twice))} (ECC, retired pages, "
                                             "remapped rows, XID)")
        if self.before or self._exporters:
            env["gpu_readings"] = {"start": [h.to_dict() for h in self.before],
                                   "end": [h.to_dict() for h in self.after],
                                   "dcgm_exporter": {"start": self.exporter_before, "end": self.exporter_after}}
        return env


__all__ = ["HostGpuWatch", "HostGpus", "changes", "read_host", "read_hosts"]
