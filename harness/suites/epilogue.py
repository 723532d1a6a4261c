"""The end every conformance suite shares: after its own item's verdict, judge and show the run.

Wiring, not a check: it records into the report (the ``conformance`` fixture) what the pure checks
return (harness/checks/invariants.py's nothing-lost verdict) beside the run's latency and timeline.

One call, :func:`finish_suite`, replaces the lines each suite used to copy::

    expected = oracle_expectation(cluster.oracle, ignore_eos=...) if cluster.oracle else None
    lost = nothing_lost_verdict(check_history(records, expected), checklist)
    lost.evidence["links"] = links
    conformance.record(lost)
    conformance.add_latency(records)
    conformance.add_timeline(merge_timeline(faults=faults.records, events=events, records=records,
                                            failed_requests_only=True))

It records, in this order:

1. the **nothing-lost** verdict over every request of the run (token-exact against the cluster's
   oracle where it has one: the bundled engine), with the links to the raw records;
2. the **latency evidence**: TTFT and TPOT percentiles over time (ok requests only) for the
   report's charts;
3. the **timeline**: the fault activities, the engine's events (extra evidence, where the cluster
   has an admin API) and the requests that failed, merged in time order.

A suite adopts it by deleting those lines and calling, at its end::

    finish_suite(conformance, cluster, records, ignore_eos=run.profile.ignore_eos,
                 links=run_links(run), faults=faults, events=timeline.events())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from harness.checks.invariants import Expected, HistoryCheck, check_history, nothing_lost_verdict, oracle_expectation
from harness.checks.verdict import Verdict
from harness.probes.client.record_digest import RecordDigest
from harness.probes.client.records import RequestRecord
from harness.probes.client.timeline import merge_timeline

if TYPE_CHECKING:
    from harness.cluster import ClusterHandle
    from harness.faults import FaultRunner
    from harness.fixtures import Conformance
    from harness.probes.loadgen.load import LoadRunner

_ORACLE = object()  # finish_suite's default: build the expectation from the cluster's oracle


def expectation(cluster: ClusterHandle, *, ignore_eos: bool) -> Expected | None:
    """The oracle's expected tokens per request record, or None for a cluster without an oracle
    (a foreign engine: nothing-lost is then judged on final states and clear errors only)."""
    return oracle_expectation(cluster.oracle, ignore_eos=ignore_eos) if cluster.oracle else None


def run_links(*runs: LoadRunner) -> list[str]:
    """Report-relative links to the records file of each load run (``LoadRunner.records_path``)."""
    return [f"artifacts/{run.records_path.parent.name}/{run.records_path.name}" for run in runs]


def finish_suite(conformance: Conformance, cluster: ClusterHandle, records: Sequence[RequestRecord], *,
                 ignore_eos: bool = False, expected: Expected | None | object = _ORACLE, links: Iterable[str] = (),
                 faults: FaultRunner | None = None, events: Iterable[Mapping[str, object]] = (),
                 event_filter: Callable[[Mapping[str, object]], bool] | None = None) -> Verdict:
    """Record the nothing-lost verdict, the latency evidence and the merged timeline of a run.

    ``records`` are every request of the run (load and probe streams alike); ``ignore_eos`` as the
    load ran (the oracle must know whether a request could stop early); ``expected`` overrides the
    oracle's expectation when the suite built it already; ``faults`` is the fault runner (its
    records go on the timeline); ``events`` the engine's events, kept where ``event_filter`` says.
    Returns the nothing-lost verdict (already recorded)."""
    want = expectation(cluster, ignore_eos=ignore_eos) if expected is _ORACLE else expected
    return _finish(conformance, check_history(records, want), cluster, lambda: conformance.add_latency(list(records)),
                   records, links=links, faults=faults, events=events, event_filter=event_filter)


def finish_streamed(conformance: Conformance, cluster: ClusterHandle, history: HistoryCheck, digest: RecordDigest, *,
                    links: Iterable[str] = (), faults: FaultRunner | None = None,
                    events: Iterable[Mapping[str, object]] = ()) -> Verdict:
    """:func:`finish_suite` for a run judged from disk in one pass (a soak of hours): ``history``
    checked every record as ``digest`` (harness/probes/client/record_digest.py) kept their timing figures;
    the latency charts come from the digest, the timeline's failed requests from those it kept."""
    return _finish(conformance, history, cluster, lambda: conformance.add_latency([], frame=digest.frame()),
                   digest.failed, links=links, faults=faults, events=events)


def _finish(conformance: Conformance, history: HistoryCheck, cluster: ClusterHandle, add_latency: Callable[[], None],
            failed: Iterable[RequestRecord], *, links: Iterable[str], faults: FaultRunner | None,
            events: Iterable[Mapping[str, object]],
            event_filter: Callable[[Mapping[str, object]], bool] | None = None) -> Verdict:
    lost = nothing_lost_verdict(history, cluster.thresholds)  # type: ignore[arg-type]
    links = list(links)
    if links:
        lost.evidence["links"] = links
    conformance.record(lost)
    add_latency()
    kept = [e for e in events if event_filter is None or event_filter(e)]
    conformance.add_timeline(merge_timeline(faults=faults.records if faults is not None else (), events=kept,
                                            records=failed, failed_requests_only=True,
                                            seen_events=getattr(conformance, "seen_events", None)))
    return lost


__all__ = ["expectation", "finish_streamed", "finish_suite", "run_links"]
