"""Checklist items 6.2.ttft and 6.2.tpot (Section 6.2, "监控仪表板核心指标": TTFT P50/P99 < 200/500 ms,
TPOT P50/P99 < 30/80 ms).

Drive the default load (closed loop, --load-users users; --load-rate makes it open loop) for
LOAD_S seconds and judge TTFT and TPOT percentiles from the client records
(harness/checks/slo.py). Beside them, the server's own histograms, scraped with the engine's
metric profile just before and just after the load (the delta holds exactly this run's
requests): evidence, never the verdict. An engine without a metrics endpoint (``engine: openai``,
or no metrics URL) is still judged from the client. Every request must also satisfy the
nothing-lost invariant. No fault is injected.
"""

from __future__ import annotations

import pytest

from harness.checks.epilogue import finish_suite, run_links
from harness.checks.slo import TPOT_ITEM, TTFT_ITEM, ServerHistograms, slo_verdicts
from harness.checks.verdict import inconclusive
from harness.probes.prometheus import engine_of

pytestmark = [pytest.mark.conformance, pytest.mark.item("6.2.ttft", "6.2.tpot", "nothing-lost"), pytest.mark.slow,
              pytest.mark.timeout(300)]

LOAD_S = 15.0      # seconds of load (--load-duration overrides): several hundred requests on this machine


def test_ttft_and_tpot_meet_the_dashboard_targets(cluster, load, conformance, harness_options):
    checklist = cluster.thresholds
    if harness_options.dry_run:  # a dry run sends nothing to the cluster, load included
        for item in (TTFT_ITEM, TPOT_ITEM):
            conformance.record(inconclusive(checklist, item, "dry run: no load was sent"))
        return
    server = ServerHistograms(cluster)
    run = load(duration_s=harness_options.load_duration or LOAD_S)
    records = run.wait()
    deltas = server.deltas()

    ttft, tpot = slo_verdicts(records, checklist, server=deltas, server_families=server.families,
                              server_note=server.note)
    links = run_links(run)
    profile = run.profile
    for verdict in (ttft, tpot):
        verdict.evidence.update(links=links, engine=engine_of(cluster), metric_profile=server.profile_name,
                                load={"mode": profile.mode, "users": profile.users, "rate": profile.rate,
                                      "duration_s": profile.duration_s, "max_tokens": profile.max_tokens,
                                      "prompt_chars": [profile.prompt_min_chars, profile.prompt_max_chars]})
        conformance.record(verdict)

    finish_suite(conformance, cluster, records, ignore_eos=profile.ignore_eos, links=links)
