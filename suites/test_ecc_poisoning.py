"""ECC poisoning of KV pages (seed 5.1 Layer 2: "ECC 错误计数 / HBM 永久故障 Page → 标记 Page 为 poison").

Under load, poison KV blocks of a busy decode worker several times (blocks of running requests
first, so each poisoning bites), through the engine's fault hook. Each fault is verified (the
worker reports the blocks' memory poisoned), held while the worker keeps serving and its
``kv_blocks_quarantined`` is polled, then reverted (the "replaced page" returns, zeroed). Judged
by harness/checks/ecc.py: poisoned blocks stay out of service while poisoned, every request on
them completes token-exactly; and the run's nothing-lost invariant. An engine that ignores the
page-retirement signal (clusters/local-no-ecc.yaml) fails both.

What this exercises, honestly: the engine's handling of a page the node agent marked bad. It
does not make a GPU raise an ECC error (REFERENCE.md: DCGM injection only fakes monitoring).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from harness.checks.ecc import ITEM, Poisoning, ecc_verdict, judge_outcomes
from harness.checks.invariants import check_history, nothing_lost_verdict, oracle_expectation
from harness.checks.verdict import inconclusive
from harness.errors import FaultError
from harness.faults import EccPoison
from harness.probes.timeline import merge_timeline

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.item("ecc", "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(900)]

BLOCKS_PER_POISONING = 2
HOLD_S = 2.0     # the worker keeps serving this long with the blocks poisoned
CYCLE_S = 6.0    # load budget per poisoning
POLL_S = 0.1


def _busy_decode(timeline: Any, deadline_s: float = 20.0) -> dict[str, Any] | None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        decodes = [w for w in timeline.workers() if w["role"] == "decode" and w["health"] == "healthy"]
        busy = max(decodes, key=lambda w: w.get("num_running", 0), default=None)
        if busy is not None and busy.get("num_running", 0) > 0:
            return busy
        time.sleep(POLL_S)
    return None


def test_poisoned_kv_pages_are_quarantined_and_never_served(cluster, load, faults, timeline, conformance,
                                                            harness_options):
    checklist = cluster.thresholds
    item = checklist.item(ITEM)
    if harness_options.dry_run:  # print the poisoning's plan on each decode worker
        for w in [w for w in timeline.workers() if w["role"] == "decode" and w["health"] == "healthy"]:
            faults.inject(EccPoison(admin_url=cluster.admin_url, worker_id=w["id"], count=BLOCKS_PER_POISONING))
        faults.revert_all()
        conformance.record(inconclusive(checklist, ITEM, "dry run: the poisonings were planned, none injected"))
        return
    n = int(item.thresholds["min_poisonings"].value) + 1
    duration = harness_options.load_duration or n * CYCLE_S + 20.0
    run = load(duration_s=duration, max_tokens=128)
    poisonings: list[Poisoning] = []
    started = time.monotonic()
    for i in range(n):
        if not run.running or time.monotonic() - started > duration - CYCLE_S:
            log.warning("load ends soon: stopping after %d poisonings", i)
            break
        target = _busy_decode(timeline)
        if target is None:
            continue
        try:
            fault = faults.inject(EccPoison(admin_url=cluster.admin_url, worker_id=target["id"],
                                            count=BLOCKS_PER_POISONING))
        except FaultError as exc:  # e.g. its requests finished in between; the runner reverted it
            log.warning("poisoning %d did not take: %s", i, exc)
            continue
        p = Poisoning(target["id"], list(fault.reply["blocks"]), list(fault.reply.get("affected") or []))
        held_until = time.monotonic() + HOLD_S
        while time.monotonic() < held_until:
            w = next((w for w in timeline.workers() if w["id"] == target["id"]), {})
            seen = int(w.get("kv_blocks_quarantined", 0))
            p.min_quarantined = seen if p.min_quarantined is None else min(p.min_quarantined, seen)
            time.sleep(POLL_S)
        faults.revert(fault)
        poisonings.append(p)
    records = run.finish()  # the faults are done: no new requests, the ones in flight end
    expected = oracle_expectation(cluster.oracle, ignore_eos=run.profile.ignore_eos) if cluster.oracle else None

    def exact(rec):
        want = expected(rec) if expected else None
        return None if want is None else rec.token_ids == want

    judge_outcomes(poisonings, records, exact)
    verdict = ecc_verdict(poisonings, checklist)
    links = [f"artifacts/{run.records_path.parent.name}/{run.records_path.name}"]
    verdict.evidence.update(links=links, load_duration_s=duration)
    conformance.record(verdict)
    lost = nothing_lost_verdict(check_history(records, expected), checklist)
    lost.evidence["links"] = links
    conformance.record(lost)
    conformance.add_latency(records)
    conformance.add_timeline(merge_timeline(faults=faults.records,
                                            events=[e for e in timeline.events() if e["type"] == "fault_state"],
                                            records=records, failed_requests_only=True))
