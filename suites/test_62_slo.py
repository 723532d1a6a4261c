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

import logging
from typing import Any

import httpx
import pytest

from harness.checks.invariants import check_history, nothing_lost_verdict, oracle_expectation
from harness.checks.slo import histogram_delta, slo_verdicts
from harness.errors import ProbeError
from harness.probes.prometheus import ENGINE_PROFILES, PrometheusScraper, Sample, engine_of, profile_for

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.conformance, pytest.mark.slow, pytest.mark.timeout(300)]

LOAD_S = 15.0      # seconds of load (--load-duration overrides): several hundred requests on this machine


class ServerHistograms:
    """Before/after scrapes of the engine's TTFT and TPOT histograms; a scrape that fails is a
    note in the evidence (the client verdicts stand without it), never an error."""

    def __init__(self, cluster: Any) -> None:
        self.profile_name = profile_for(cluster)
        self.note: str | None = None
        self.families: dict[str, str] = {}
        self._scraper: PrometheusScraper | None = None
        if self.profile_name is None:
            self.note = f"engine {engine_of(cluster)!r} exposes no Prometheus metrics"
        elif not cluster.metrics_url:
            self.note = "the cluster file names no metrics URL (endpoints.metrics)"
        else:
            profile = ENGINE_PROFILES[self.profile_name]
            self.families = {"ttft": profile["ttft_seconds"]}
            # TPOT per request when the engine has it, else its inter-token latency (per chunk)
            self.families["tpot"] = profile.get("tpot_seconds") or profile["itl_seconds"]
            self._scraper = PrometheusScraper(cluster.metrics_url, engine=self.profile_name)
        self.before: list[Sample] = self._scrape("before")

    def _scrape(self, when: str) -> list[Sample]:
        if self._scraper is None:
            return []
        try:
            return self._scraper.scrape_once()
        except (httpx.HTTPError, ProbeError) as exc:
            self.note = f"scrape of {self._scraper.url} {when} the load failed: {exc}"
            log.warning("%s", self.note)
            self._scraper.stop()
            self._scraper = None
            return []

    def deltas(self) -> dict[str, Any]:
        after = self._scrape("after")
        if self._scraper is not None:
            self._scraper.stop()
        if not after or not self.before:
            return {}
        out = {key: histogram_delta(self.before, after, family) for key, family in self.families.items()}
        missing = [self.families[k] for k, d in out.items() if d is None]
        if missing:
            self.note = f"the metrics endpoint exposes no {', '.join(missing)}"
        return out


def test_ttft_and_tpot_meet_the_dashboard_targets(cluster, load, conformance, harness_options):
    checklist = cluster.thresholds
    server = ServerHistograms(cluster)
    run = load(duration_s=harness_options.load_duration or LOAD_S)
    records = run.wait()
    deltas = server.deltas()

    ttft, tpot = slo_verdicts(records, checklist, server=deltas, server_families=server.families,
                              server_note=server.note)
    link = f"artifacts/{run.records_path.parent.name}/{run.records_path.name}"
    profile = run.profile
    for verdict in (ttft, tpot):
        verdict.evidence.update(links=[link], engine=engine_of(cluster), metric_profile=server.profile_name,
                                load={"mode": profile.mode, "users": profile.users, "rate": profile.rate,
                                      "duration_s": profile.duration_s, "max_tokens": profile.max_tokens,
                                      "prompt_chars": [profile.prompt_min_chars, profile.prompt_max_chars]})
        conformance.record(verdict)

    expected = oracle_expectation(cluster.oracle, ignore_eos=profile.ignore_eos) if cluster.oracle else None
    lost = nothing_lost_verdict(check_history(records, expected), checklist)
    lost.evidence["links"] = [link]
    conformance.record(lost)
    conformance.add_latency(records)
