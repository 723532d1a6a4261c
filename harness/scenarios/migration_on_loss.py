"""Item 6.1.2 on an engine that migrates streams when their worker is lost (Dynamo's request
migration; see harness/checks/migration_blackbox.py for what is measured): kill a worker of the
cluster file's inventory while the harness's own streams decode on it.

One kill (:func:`kill_under_streams`):

1. ``streams`` streaming requests start at once (threads, one client each); the kill waits until
   every one of them has ``after_tokens`` tokens (each has a steady gap to compare with) or ended;
2. the engine's migration counter is read (when its profile has one and a metrics URL is known), from
   the cluster's Prometheus when its file names one (``endpoints.prometheus``), else scraped: only the
   migrations of streams that had begun (``migrations_ongoing``: Dynamo's
   ``migration_type="ongoing_request"``) where the profile tells them apart, never requests re-sent
   before their first token (``new_request``: no stream crossed anything);
3. a worker of the role that decodes (decode, else aggregated) is killed through the fault runner
   (harness/scenarios/blackbox_faults.py: ledger first, restart or supervisor, wait for the new process
   and its health URL), held ``observe_s`` so the engine must move the streams by itself;
4. the streams are awaited, the counter read again: a :class:`KillWindow` and the streams' records.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from harness.errors import ProbeError
from harness.probes.metrics.metrics_source import MetricsSource, ScrapeSource
from harness.probes.metrics.prometheus import ENGINE_PROFILES, quantity_labels
from harness.probes.client.records import RequestRecord
from harness.probes.client.streaming import CompletionRequest
from harness.scenarios import blackbox_faults as blackbox
from harness.evidence.records import KillWindow

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0   # for every stream to reach after_tokens (CPU prefill of a loaded machine)


def kill_role(workers: Any) -> str:
    """The role whose workers decode streams: decode, else aggregated."""
    roles = {str(w.role) for w in workers if w.restartable}
    for role in ("decode", "aggregated"):
        if role in roles:
            return role
    raise ProbeError("no restartable decode or aggregated worker in the cluster file's `workers:`",
                     fix="list the decode workers with `restart:` or `supervised: true`")


def migration_quantity(profile: str | None) -> str:
    """The profile's counter of moved streams: ``migrations_ongoing`` (streams that had begun, e.g.
    Dynamo's ``migration_type="ongoing_request"``) where it has one, else ``migrations``."""
    return "migrations_ongoing" if "migrations_ongoing" in ENGINE_PROFILES.get(profile or "", {}) else "migrations"


def counter_name(profile: str | None, quantity: str) -> str | None:
    """``family{label="value"}`` as the evidence names the counter read (None: the profile has none)."""
    family = ENGINE_PROFILES.get(profile or "", {}).get(quantity)
    if family is None:
        return None
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(quantity_labels(profile, quantity).items()))
    return f"{family}{{{labels}}}" if labels else f"{family} (every series)"


def migration_count(metrics_url: str | None, profile: str | None, api_key: str | None = None, *,
                    source: MetricsSource | None = None, settled: bool = False,
                    quantity: str = "migrations") -> float | None:
    """Sum of the engine's migration counter (``quantity`` of its profile) over its series, or None when it
    has none or it cannot be read. ``source``: where to read it (default: scrape ``metrics_url``);
    ``settled``: the value as of now even through a Prometheus that has not scraped since (it waits)."""
    family = ENGINE_PROFILES.get(profile or "", {}).get(quantity)
    if not metrics_url or not family or profile is None:
        return None
    reader = source if source is not None else ScrapeSource(profile, api_key=api_key, timeout_s=10)
    try:
        reading = reader.read([metrics_url], [quantity], settled=settled)
    except ProbeError as exc:
        log.warning("migration counter not read from %s (%s): %s", metrics_url, reader.label, exc)
        return None
    finally:
        if source is None:
            reader.close()
    if metrics_url in reading.errors:
        log.warning("migration counter not read from %s (%s): %s", metrics_url, reader.label,
                    reading.errors[metrics_url])
        return None
    return reading.values.get(metrics_url, {}).get(quantity, 0.0)


@dataclass
class _Stream:
    index: int
    request: CompletionRequest
    after_tokens: int
    ready: threading.Event = field(default_factory=threading.Event)
    record: RequestRecord | None = None


def kill_under_streams(cluster: Any, faults: Any, *, phase: str, index: int, seed: int, streams: int,
                       after_tokens: int, tokens_after: int, observe_s: float,
                       before_kill: Callable[[], None] | None = None) -> tuple[KillWindow, list[RequestRecord]]:
    """One kill with ``streams`` of the harness's own streams decoding (see the module doc)."""
    api_key = cluster.api_key()
    todo = [_Stream(i, CompletionRequest(prompt=f"Migration on worker loss, {phase} kill {index}, stream {i}:",
                                         max_tokens=after_tokens + tokens_after, ignore_eos=True), after_tokens)
            for i in range(streams)]

    def run(s: _Stream) -> None:
        def seen(rec: RequestRecord, _msg: dict) -> None:
            if sum(rec.chunk_tokens) >= s.after_tokens:
                s.ready.set()

        try:
            with cluster.streaming_client(user=f"6.1.2-{phase}-{index}") as client:
                s.record = client.send(s.request, request_id=f"mig-{phase}-{index}-{s.index}", on_message=seen)
        finally:
            s.ready.set()  # ended (or failed) before after_tokens: nothing to wait for

    threads = [threading.Thread(target=run, args=(s,), name=f"6.1.2-stream-{s.index}", daemon=True) for s in todo]
    profile = cluster.spec.metric_profile
    # the migration counter from the cluster's Prometheus when its file names one, else scraped
    source = cluster.metrics_source() if cluster.prometheus_url and profile else None
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for s in todo:
            if not s.ready.wait(max(0.0, deadline - time.monotonic())):
                raise ProbeError(f"6.1.2 {phase} kill {index}: stream {s.index} had fewer than {after_tokens} tokens "
                                 f"after {READY_TIMEOUT_S:.0f} s", fix="check the cluster serves streams")
        if before_kill is not None:
            before_kill()
        quantity = migration_quantity(profile)
        before = migration_count(cluster.metrics_url, profile, api_key, source=source, quantity=quantity)
        done = blackbox.run_faults(cluster, faults, [("process_kill", kill_role(cluster.workers))],
                                   seed=seed + index, observe_s=observe_s, nudge_traffic=True)
        fault = done.faults[0]
    except BaseException:
        if source is not None:
            source.close()
        raise
    finally:
        for t in threads:  # the streams end: resumed elsewhere, failed, or the client's own timeout
            t.join()
    try:  # through a Prometheus: once it has scraped again, so the kill's last migrations count
        after = migration_count(cluster.metrics_url, profile, api_key, source=source, settled=True,
                                quantity=quantity)
    finally:
        if source is not None:
            source.close()
    rise = None if before is None or after is None else after - before
    records = [s.record for s in todo if s.record is not None]
    log.info("6.1.2 %s kill %d (%s): %d streams, migration counter %s", phase, index, fault.label, len(records),
             "n/a" if rise is None else f"+{rise:g}")
    return KillWindow(phase, fault, rise, window_s=observe_s, counter=counter_name(profile, quantity)), records


__all__ = ["counter_name", "kill_role", "kill_under_streams", "migration_count", "migration_quantity"]
