"""Checklist item 6.1.3 (Section 6.1, "降级策略测试：模拟 KV Cache 超载，验证 Level 2/3 正确触发").

Under light load, HBM-fill faults on every decode worker raise KV use in three plateaus: between
Level 1's and Level 2's thresholds, between Level 2's and Level 3's, and above Level 3's (below
Level 4's). Each plateau must reach exactly its level, in order, with the level's action applied
(speculative decoding off at L2, KV offload on at L3); after the fills are reverted the cluster
must step back to Level 0 (harness/checks/degradation.py). Nothing may be lost meanwhile:
requests complete token-exactly or are refused with a clear 429/503.

On a foreign engine (no admin API, so no HBM fill and no router events) the item is judged by load
when the cluster file states its levels (``degradation.levels``): long-prompt streams ramp the
engine's own KV-use metric over each level's threshold and hold it there
(harness/probes/loadgen/kv_drive.py); the actions the file states for each level are checked on the
API responses and the engine's metrics, and KV use must fall back below the first threshold
after the load (harness/checks/degradation_load.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from harness import dry_run
from harness.checks.degradation import ITEM, Step, degradation_verdict
from harness.checks.degradation_load import load_degradation_verdict
from harness.checklists import Checklist
from harness.checks.verdict import inconclusive
from harness.cluster import ClusterHandle
from harness.errors import ProbeError
from harness.faults import FaultRunner, HbmFill, SpeculativeDecoding
from harness.fixtures import Conformance, Load, Timeline
from harness.plugin_state import HarnessOptions
from harness.engine.admin.client import AdminClient
from harness.engine.admin.models import DegradationState, AdminWorker
from harness.probes.loadgen.kv_drive import DrivePlan, DriveResult, KvDrive, KvMeter
from harness.probes.client.request_shape import request_shape
from harness.probes.client.streaming import AsyncStreamingClient
from harness.suites.epilogue import finish_suite, run_links
from harness.states import EventKind, WorkerRole

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.item("6.1.3", "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(900)]

LOAD_USERS = 2
POLL_S = 0.1
STEP_DOWN_TIMEOUT_S = 60.0


def _degradation(admin: str) -> DegradationState:
    """``GET /admin/degradation`` through the typed admin client."""
    with AdminClient(admin) as client:
        return client.degradation()


def _decodes(timeline: Timeline) -> list[AdminWorker]:
    return [w for w in timeline.workers() if w.role == WorkerRole.DECODE and w.healthy]


def _plateaus(state: DegradationState, checklist: Checklist) -> list[tuple[str, float, int]]:
    """(name, KV use to aim at, expected level) between the cluster's thresholds; where the
    cluster has none (controller off), the checklist's."""
    t = checklist.item(ITEM).thresholds
    th = state.thresholds
    l1 = th.get("L1", {}).get("hbm") or 0.75
    l2 = th.get("L2", {}).get("hbm") or t["trigger_utilization"].value
    l3 = th.get("L3", {}).get("hbm") or t["level3_trigger_utilization"].value
    l4 = th.get("L4", {}).get("hbm") or min(0.99, l3 + 0.05)
    return [("between L1 and L2", (l1 + l2) / 2, 1), ("between L2 and L3", (l2 + l3) / 2, 2),
            ("between L3 and L4", (l3 + l4) / 2, 3)]


def _hold(admin: str, timeline: Timeline, step: Step, hold_s: float, spec_was_on: bool) -> None:
    """Watch the level for ``hold_s``; check the level's actions on every decode worker."""
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        state = _degradation(admin)
        step.reached = max(step.reached, state.level)
        step.hbm_seen = max(step.hbm_seen, state.signals["hbm"])
        time.sleep(POLL_S)
    workers = _decodes(timeline)
    if step.reached >= 2 and spec_was_on:
        step.actions_missing += [f"{step.name}: {w.id} still decodes speculatively at Level {step.reached}"
                                 for w in workers if w.spec_enabled]
    if step.reached >= 3:
        step.actions_missing += [f"{step.name}: {w.id} has KV offload off at Level {step.reached}"
                                 for w in workers if not w.raw.get("offload_enabled")]  # not an AdminWorker field


def test_level2_then_level3_trigger_at_their_thresholds(cluster: ClusterHandle, load: Load, faults: FaultRunner,
                                                        timeline: Timeline, conformance: Conformance,
                                                        harness_options: HarnessOptions,
                                                        request: pytest.FixtureRequest) -> None:
    checklist = cluster.thresholds
    admin = cluster.admin_url
    if not admin:  # a foreign engine: by load, against the cluster file's stated levels
        _by_load(cluster, conformance, harness_options, request.node.name)
        return
    if harness_options.dry_run and dry_run.reads_no_admin_api(cluster):
        conformance.show_plan([dry_run.unread_targets(cluster, "hbm_fill", "each decode worker", "filled in steps "
                                                      "to the engine's Level 2 then Level 3 KV-use thresholds")])
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: the HBM fills were planned, none injected"))
        return
    state = _degradation(admin)
    if harness_options.dry_run:  # print each fill's plan (the shares depend on the load: the first plateau's)
        share = round(_plateaus(state, checklist)[0][1], 4)
        for w in _decodes(timeline):
            faults.inject(HbmFill(admin_url=admin, worker_id=w.id, share=share))
        faults.revert_all()
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: the HBM fills were planned, none injected"))
        return
    # on through the fault runner (safety-checked, in the ledger, reverted however the test ends),
    # so that Level 2's action has something to turn off
    spec = faults.inject(SpeculativeDecoding(admin_url=admin, enabled=True))
    spec_was_on = True
    try:
        _run_plateaus(cluster, load, faults, timeline, conformance, harness_options, state, spec_was_on)
    finally:  # the session's cluster goes to the next suite as this one found it
        faults.revert(spec)


def _run_plateaus(cluster: ClusterHandle, load: Load, faults: FaultRunner, timeline: Timeline, conformance: Conformance,
                  harness_options: HarnessOptions, state: DegradationState, spec_was_on: bool) -> None:
    checklist, admin = cluster.thresholds, cluster.admin_url
    dwell = float(state.raw.get("min_dwell_s") or 2.0)  # not a DegradationState field
    plateaus = _plateaus(state, checklist)
    # each plateau climbs at most one level per dwell, then is held for two more dwells
    hold_s = 5 * dwell + 2.0
    duration = harness_options.load_duration or len(plateaus) * hold_s + STEP_DOWN_TIMEOUT_S / 2 + 20
    run = load(duration_s=duration, users=LOAD_USERS, max_tokens=48)
    deadline = time.monotonic() + 60
    while _degradation(admin).level != 0 and time.monotonic() < deadline:
        time.sleep(POLL_S)  # a previous suite's degradation must have ended
    time.sleep(2.0)  # let the load reach its steady KV use before measuring the baseline
    base = max((w.kv_used_ratio or 0.0) for w in _decodes(timeline))
    steps, filled, fills = [], base, []
    for name, target, level in plateaus:
        step = Step(name, target, level)
        steps.append(step)
        share = target - filled
        if share > 0.005:
            for w in _decodes(timeline):
                fills.append(faults.inject(HbmFill(admin_url=admin, worker_id=w.id, share=round(share, 4))))
            filled = target
        _hold(admin, timeline, step, hold_s, spec_was_on)
    reverted_at = time.monotonic()
    for fault in reversed(fills):
        faults.revert(fault)
    step_down_s, still_up_s = None, 0.0   # still_up_s: the last poll that saw a level above 0 (its resolution)
    while time.monotonic() - reverted_at < STEP_DOWN_TIMEOUT_S:
        asked = time.monotonic() - reverted_at
        if _degradation(admin).level == 0:
            step_down_s = time.monotonic() - reverted_at
            break
        still_up_s = asked
        time.sleep(POLL_S)
    if step_down_s is None:
        step_down_s = STEP_DOWN_TIMEOUT_S  # never came back: judged as at least this long
    records = run.finish()  # the faults are done: no new requests, the ones in flight end
    events = timeline.events()
    verdict = degradation_verdict(steps, events, round(step_down_s, 3), checklist,
                                  controller_enabled=state.enabled, step_down_after_s=round(still_up_s, 3))
    links = run_links(run)
    verdict.evidence.update(links=links, baseline_kv_use=round(base, 4), dwell_s=dwell,
                            speculative_turned_on_first=spec_was_on)
    conformance.record(verdict)

    finish_suite(conformance, cluster, records, ignore_eos=run.profile.ignore_eos, links=links, faults=faults,
                 events=events,
                 event_filter=lambda e: e["type"] in (EventKind.DEGRADATION_LEVEL, EventKind.FAULT_STATE))


# -- a foreign engine: KV use driven by load, the cluster file's stated actions checked on the API --------

DRIVE_STEP_DOWN_TIMEOUT_S = 60.0
DRIVE_REQUEST_TIMEOUT_S = 300.0   # one stream's whole life, queueing included; longer counts as hung


def drive_plan(cluster: ClusterHandle, seed: int) -> DrivePlan:
    """The load that drives KV use: degradation.load, else the workload's lengths (else 512/128 tokens).
    A level with a max_tokens cap gets requests asking for twice the cap, so that a missing cap shows."""
    spec = cluster.spec.degradation
    workload = cluster.workload
    prompt = spec.load.prompt_tokens or (workload.prompt_tokens if workload else 512)
    output = spec.load.output_tokens or (workload.output_tokens if workload else 128)
    caps = [lv.expect.max_tokens_cap for lv in spec.levels if lv.expect.max_tokens_cap is not None]
    if caps:
        output = max(output, 2 * max(caps))
    return DrivePlan(thresholds=tuple(lv.kv_use_above for lv in spec.levels), prompt_tokens=prompt,
                     output_tokens=output, max_concurrency=spec.load.max_concurrency,
                     ramp_budget_s=spec.load.ramp_budget_s, hold_s=spec.load.hold_s,
                     step_down_timeout_s=DRIVE_STEP_DOWN_TIMEOUT_S, seed=seed)


def metrics_urls(cluster: ClusterHandle) -> list[str]:
    """endpoints.metrics and every worker's own (behind a router such as vllm-router, KV use is on the workers)."""
    return list(dict.fromkeys(u for u in [cluster.metrics_url, *(w.metrics for w in cluster.workers)] if u))


def _per_worker(meter: KvMeter, result: DriveResult) -> dict[str, object]:
    """Each endpoint's KV use over the drive, from the meter's source (a Prometheus: every sample it scraped)."""
    if not result.samples:
        return {}
    try:
        return meter.per_worker(result.samples[0].t_wall_ns, result.samples[-1].t_wall_ns)
    except ProbeError as exc:  # a Prometheus that fell behind: the verdict stands on the drive's own reads
        return {"error": str(exc)}


def _by_load(cluster: ClusterHandle, conformance: Conformance, harness_options: HarnessOptions, test_name: str) -> None:
    checklist = cluster.thresholds
    levels = cluster.spec.degradation.levels
    plan = drive_plan(cluster, harness_options.seed)
    described = [f"level {lv.level}: KV use above {lv.kv_use_above:.2f} -> "
                 f"{lv.expect.model_dump(mode='json', exclude_defaults=True)}" for lv in levels]
    load_line = (f"up to {plan.max_concurrency} streams of {plan.prompt_tokens}-token prompts asking "
                 f"{plan.output_tokens} tokens (+-25 %), {plan.ramp_budget_s:.0f} s per level, each held {plan.hold_s:.0f} s")
    if harness_options.dry_run:
        refused = (" [REFUSED: the cluster is marked safety.production, a real run does not overload it]"
                   if cluster.safety.production else "")
        conformance.show_plan([load_line + refused, *described])
        conformance.record(inconclusive(checklist, ITEM, code="dry_run", reason="dry run: the KV-use drive was planned, no load was sent",
                                        plan=[load_line, *described]))
        return
    if cluster.safety.production:
        conformance.record(inconclusive(checklist, ITEM, "not judged on this cluster: driving KV use over its "
                                        "degradation thresholds overloads it, and it is marked safety.production",
                                        plan=[load_line, *described]))
        return
    # the cluster's Prometheus when its file names one (endpoints.prometheus), else each URL scraped
    meter = KvMeter(metrics_urls(cluster), cluster.spec.metric_profile, api_key=cluster.api_key(),
                    source=cluster.metrics_source() if cluster.prometheus_url else None)
    try:
        meter.check()
    except ProbeError as exc:
        meter.close()
        conformance.record(inconclusive(checklist, ITEM, f"not judged on this cluster: {exc}", fix=exc.fix))
        return
    records_path = conformance.artifact_dir(f"{test_name}-kv-drive") / "requests.jsonl"
    conformance.phase("KV drive")

    async def drive() -> DriveResult:
        async with AsyncStreamingClient(cluster.api_url, model=cluster.model, api_key=cluster.api_key(),
                                        timeout_s=DRIVE_REQUEST_TIMEOUT_S, read_timeout_s=120.0,
                                        request_shape=request_shape(cluster.engine)) as client:
            return await KvDrive(client, meter, plan, records_path).run()

    try:
        result = asyncio.run(drive())
    except ProbeError as exc:  # the calibration request failed: the cluster does not serve completions
        conformance.record(inconclusive(checklist, ITEM, f"not judged: {exc}", fix=exc.fix))
        return
    else:
        per_worker = _per_worker(meter, result)
    finally:
        meter.close()
    verdict = load_degradation_verdict(levels, result, checklist, step_down_timeout_s=DRIVE_STEP_DOWN_TIMEOUT_S)
    links = [f"artifacts/{records_path.parent.name}/{records_path.name}"]
    verdict.evidence.update(links=links, load=load_line, metrics_urls=meter.urls,
                            metrics_urls_dropped=meter.dropped, scrape_errors=meter.errors[:20],
                            metrics_source=meter.source.label, kv_use_per_worker=per_worker)
    conformance.record(verdict)
    finish_suite(conformance, cluster, result.records, expected=None, links=links)
