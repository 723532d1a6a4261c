"""The raw samples of each compared figure, as a run's results.json holds them (docs/compare.md).

harness/compare.py judges; this module reads. Each source is one kind of sample of one item:

- values (a list of numbers, one per request, fault, migration or transfer): 6.2 TTFT/TPOT (from the
  request records the 6.2 verdict links: harness/compare.py reads those), 6.1.4 rescheduling times
  (``evidence.samples``), 6.1.2 migration deltas by phase (``evidence.per_migration``: ``phase``,
  ``excess_ms``), 6.1.1 line-rate fractions (``evidence.kv_curve``'s largest size, its
  ``gbit_per_s`` over ``line_rate.gbit_per_s``; on named hosts ``evidence.repeats_line_rate_fraction``);
- :class:`RttRatio` (6.1.5): the TCP-class round trips during the storm and in the calm gaps
  (``evidence.rtts_ms``) and the loopback floor the calm p99 counts at no less than; :class:`FlowRatio`
  (6.1.5): each TCP bulk flow's throughput in the calm gaps and during the storm
  (``evidence.samples[].throughputs_bps`` of the ``calm`` and ``during`` sides);
- :class:`Recovery` (nic-flap): each verdict's recovery time as bounds, not a sample (the verdict's
  ``recovery_time_s`` interval: from the start of the last slow probe transfer to the end of the first
  good one; not back: from the start of the last transfer, unbounded above);
- :class:`Counts` (nothing-lost): per test, the requests without a final state and the requests sent.

A run that did not measure an item has no entry for its sources; a run that measured it with a
results.json written before its raw samples were kept gets a :class:`Missing` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# figure (a threshold key of its item, or a compare-only figure: harness/checklists COMPARE_ONLY_FIGURES)
# -> (sample, percentile; None for a share of counts)
FIGURES: dict[tuple[str, str], tuple[str, float | None]] = {
    ("6.2.ttft", "ttft_p50_ms"): ("ttft", 50), ("6.2.ttft", "ttft_p99_ms"): ("ttft", 99),
    ("6.2.tpot", "tpot_p50_ms"): ("tpot", 50), ("6.2.tpot", "tpot_p99_ms"): ("tpot", 99),
    ("6.1.4", "reschedule_p50_s"): ("reschedule", 50), ("6.1.4", "reschedule_p95_s"): ("reschedule", 95),
    ("6.1.2", "ttft_delta_idle_ms"): ("migration_idle", 50), ("6.1.2", "ttft_delta_loaded_ms"): ("migration_loaded", 50),
    ("6.1.1", "line_rate_fraction"): ("line_rate", 50),
    ("6.1.5", "tcp_p99_latency_ratio"): ("rtt_ratio", 99),
    ("6.1.5", "tcp_throughput_ratio"): ("flow_ratio", 50),
    ("nic-flap", "recovery_time_s"): ("recovery", None),
    ("nothing-lost", "requests_without_final_state"): ("lost", None),
}
# each sample: the verdict it comes from, what one sample is, and what a run needs to measure it
SOURCES: dict[str, tuple[str, str, str]] = {
    "ttft": ("6.2.ttft", "requests", "the 6.2 suite (`pytest suites/test_62_slo.py`)"),
    "tpot": ("6.2.ttft", "requests", "the 6.2 suite (`pytest suites/test_62_slo.py`)"),
    "reschedule": ("6.1.4", "faults", "the 6.1.4 suite (`pytest suites/test_item4_reschedule.py`)"),
    "migration_idle": ("6.1.2", "migrations", "the 6.1.2 suite (`pytest suites/test_item2_hot_migration.py`)"),
    "migration_loaded": ("6.1.2", "migrations", "the 6.1.2 suite (`pytest suites/test_item2_hot_migration.py`)"),
    "line_rate": ("6.1.1", "transfers", "the 6.1.1 suite (`pytest suites/test_item1_kv_bandwidth.py`)"),
    "rtt_ratio": ("6.1.5", "round trips", "the 6.1.5 suite (`pytest suites/test_item5_pfc_isolation.py`)"),
    "flow_ratio": ("6.1.5", "bulk flows", "the 6.1.5 suite (`pytest suites/test_item5_pfc_isolation.py`)"),
    "recovery": ("nic-flap", "flaps", "the NIC flap suite (`pytest suites/test_nic_flap.py`)"),
    "lost": ("nothing-lost", "requests", "a suite that sends load (any of suites/)"),
}
# what a sample the run lacks because the event never ended is called (a median of the rest would hide it)
NEVER: dict[str, str] = {"reschedule": "faults never rescheduled", "migration_idle": "migrations that failed",
                         "migration_loaded": "migrations that failed"}


@dataclass(frozen=True)
class RttRatio:
    """6.1.5's p99 round-trip ratio of one run: p99(during) / max(p99(calm), floor)."""

    during: list[float]
    calm: list[float]
    floor: float


@dataclass(frozen=True)
class FlowRatio(RttRatio):
    """6.1.5's throughput ratio of one run: the median bulk flow (bit/s) during the storm over the calm
    one (no floor)."""

    floor: float = 0.0


@dataclass(frozen=True)
class Recovery:
    """nic-flap: each verdict's recovery time (s after the last flap) as (lower, upper) bounds; upper
    None: the bandwidth was not back by the last probe transfer."""

    bounds: tuple[tuple[float, float | None], ...]

    def slowest(self) -> tuple[float, float | None]:
        """The slowest recovery's bounds (the max is monotone in each bound): [max lower, max upper]."""
        highs = [hi for _, hi in self.bounds]
        return max(lo for lo, _ in self.bounds), None if None in highs else max(highs)  # type: ignore[type-var]


@dataclass(frozen=True)
class Counts:
    """Per test id: (requests without a final state, requests sent)."""

    by_test: dict[str, tuple[int, int]] = field(default_factory=dict)

    def pooled(self, tests: list[str]) -> tuple[int, int]:
        return sum(self.by_test[t][0] for t in tests), sum(self.by_test[t][1] for t in tests)


@dataclass(frozen=True)
class Missing:
    """The run measured the item, but its results.json lacks the raw samples (an older harness)."""

    field: str

    def reason(self, run: str, item: str) -> str:
        name, _, what = self.field.partition(" (")
        what = f", {what[:-1]}" if what else ""
        return (f"the {run}'s {item} verdict has no {name} (its results.json predates the raw samples a comparison "
                f"needs{what}): run {item} again with this harness")


def _verdicts(results: dict[str, Any], item: str) -> list[dict[str, Any]]:
    return [v for v in results.get("verdicts") or () if v.get("item") == item]


def _measured(verdict: dict[str, Any], key: str) -> bool:
    """The verdict measured ``key`` (a verdict skipped for a missing capability measured nothing)."""
    return any(m.get("key") == key and isinstance(m.get("value"), (int, float))
               for m in (verdict.get("evidence") or {}).get("measurements") or ())


def _numbers(values: Any) -> list[float]:
    return [float(x) for x in values or () if isinstance(x, (int, float)) and not isinstance(x, bool)]


def reschedule(results: dict[str, Any], samples: dict[str, Any], never: dict[str, int]) -> None:
    """6.1.4: each fault's rescheduling time (s) as the verdict judged it; a fault never rescheduled has none."""
    if v := _verdicts(results, "6.1.4"):
        faults = [x for x in (v[0].get("evidence") or {}).get("samples") or () if isinstance(x, dict)]
        samples["reschedule"] = [float(x["value"]) for x in faults if isinstance(x.get("value"), (int, float))]
        never["reschedule"] = len(faults) - len(samples["reschedule"])


def migration(results: dict[str, Any], samples: dict[str, Any], never: dict[str, int]) -> None:
    """6.1.2: each measured migration's TTFT delta (ms) by phase; failed migrations have none."""
    for v in _verdicts(results, "6.1.2"):
        ev = v.get("evidence") or {}
        for phase in ("idle", "loaded"):
            if not _measured(v, f"ttft_delta_{phase}_ms"):
                continue
            if "per_migration" not in ev:
                samples[f"migration_{phase}"] = Missing("evidence.per_migration")
                continue
            samples[f"migration_{phase}"] = [float(m["excess_ms"]) for m in ev["per_migration"]
                                             if isinstance(m, dict) and m.get("phase") == phase
                                             and isinstance(m.get("excess_ms"), (int, float))]
            never[f"migration_{phase}"] = int(ev.get("failed_migrations") or 0)
        return


def line_rate(results: dict[str, Any], samples: dict[str, Any]) -> None:
    """6.1.1: each transfer's bandwidth at the judged size as a fraction of the line rate."""
    for v in _verdicts(results, "6.1.1"):
        if not _measured(v, "line_rate_fraction"):
            continue
        ev = v.get("evidence") or {}
        if "repeats_line_rate_fraction" in ev:   # on named hosts: the repeated raw runs
            samples["line_rate"] = _numbers(ev["repeats_line_rate_fraction"])
            return
        curve = [p for p in ev.get("kv_curve") or () if isinstance(p, dict) and isinstance(p.get("gbit_per_s"), list)]
        line = (ev.get("line_rate") or {}).get("gbit_per_s")
        if not curve or not isinstance(line, (int, float)) or line <= 0:
            samples["line_rate"] = Missing("evidence.kv_curve[].gbit_per_s (each transfer at the largest size)")
            return
        largest = max(curve, key=lambda p: p.get("size_bytes") or 0)   # the size the verdict judges
        samples["line_rate"] = [x / line for x in _numbers(largest["gbit_per_s"])]
        return


def rtt_ratio(results: dict[str, Any], samples: dict[str, Any]) -> None:
    """6.1.5: the TCP-class round trips (ms) during the storm and in the calm gaps, and the floor."""
    for v in _verdicts(results, "6.1.5"):
        if not _measured(v, "tcp_p99_latency_ratio"):
            continue
        ev = v.get("evidence") or {}
        rtts = ev.get("rtts_ms")
        if not isinstance(rtts, dict) or not rtts.get("during") or not rtts.get("calm"):
            samples["rtt_ratio"] = Missing("evidence.rtts_ms (each TCP-class round trip, calm and during the storm)")
            return
        floor = ev.get("rtt_noise_floor_ms")
        samples["rtt_ratio"] = RttRatio(_numbers(rtts["during"]), _numbers(rtts["calm"]),
                                        float(floor) if isinstance(floor, (int, float)) else 0.0)
        return


def flow_ratio(results: dict[str, Any], samples: dict[str, Any]) -> None:
    """6.1.5: each TCP bulk flow's throughput (bit/s) in the calm gaps and during the storm."""
    for v in _verdicts(results, "6.1.5"):
        if not _measured(v, "tcp_throughput_ratio"):
            continue   # no calm flow yet, or skipped: the verdict measured no ratio
        sides = {s.get("label"): s for s in (v.get("evidence") or {}).get("samples") or () if isinstance(s, dict)}
        calm, during = sides.get("calm", sides.get("before")), sides.get("during")   # "before": older runs
        if not (calm and during and isinstance(calm.get("throughputs_bps"), list)
                and isinstance(during.get("throughputs_bps"), list)):
            samples["flow_ratio"] = Missing("evidence.samples[].throughputs_bps (each TCP bulk flow, calm and during "
                                            "the storm)")
            return
        samples["flow_ratio"] = FlowRatio(_numbers(during["throughputs_bps"]), _numbers(calm["throughputs_bps"]))
        return


def recovery(results: dict[str, Any], samples: dict[str, Any]) -> None:
    """nic-flap: each verdict's recovery time bounds (s after the last flap), as the verdict judged them."""
    bounds: list[tuple[float, float | None]] = []
    for v in _verdicts(results, "nic-flap"):
        ev = v.get("evidence") or {}
        m = next((m for m in ev.get("measurements") or () if m.get("key") == "recovery_time_s"), None)
        base = ev.get("baseline_gbit_per_s")
        if m is None or not isinstance(base, (int, float)) or base <= 0:
            continue   # skipped, or no bandwidth before the flaps to recover to
        iv = m.get("interval") or {}
        if isinstance(m.get("value"), (int, float)):
            if not (isinstance(iv.get("lo"), (int, float)) and isinstance(iv.get("hi"), (int, float))):
                samples["recovery"] = Missing("evidence.measurements[recovery_time_s].interval (the bounds of the "
                                              "recovery time: the probe transfers around it)")
                return
            bounds.append((float(iv["lo"]), float(iv["hi"])))
            continue
        after = [a for a in ev.get("after") or () if isinstance(a, dict)]
        if after and not isinstance(after[-1].get("start_s"), (int, float)):
            samples["recovery"] = Missing("evidence.after[].start_s (when each probe transfer after the flaps began)")
            return
        bounds.append((float(after[-1]["start_s"]) if after else 0.0, None))   # still slow when the last began
    if bounds:
        samples["recovery"] = Recovery(tuple(bounds))


def lost(results: dict[str, Any], samples: dict[str, Any]) -> None:
    """nothing-lost: per test, the requests without a final state and the requests sent."""
    by_test: dict[str, tuple[int, int]] = {}
    for v in _verdicts(results, "nothing-lost"):
        ev = v.get("evidence") or {}
        value = next((m.get("value") for m in ev.get("measurements") or ()
                      if m.get("key") == "requests_without_final_state"), None)
        if not isinstance(value, (int, float)):
            continue   # skipped for a missing capability: nothing sent
        n = ev.get("requests")
        if not isinstance(n, int) or n < value:
            samples["lost"] = Missing("evidence.requests (the requests the suite sent)")
            return
        test = str(v.get("test") or f"#{len(by_test)}")
        old = by_test.get(test, (0, 0))
        by_test[test] = (old[0] + int(value), old[1] + n)
    if by_test:
        samples["lost"] = Counts(by_test)


def item_samples(results: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """Every source but 6.2's (which lives in the records files): (samples, never-ended counts)."""
    samples: dict[str, Any] = {}
    never: dict[str, int] = {}
    reschedule(results, samples, never)
    migration(results, samples, never)
    line_rate(results, samples)
    rtt_ratio(results, samples)
    flow_ratio(results, samples)
    recovery(results, samples)
    lost(results, samples)
    return samples, never


def measured_text(samples: dict[str, Any]) -> list[str]:
    """What a run measured beyond its 6.2 requests, for the comparison's header lines."""
    parts = []
    for source, what in (("reschedule", "faults rescheduled"), ("migration_idle", "idle migrations"),
                         ("migration_loaded", "loaded migrations"), ("line_rate", "KV transfers")):
        if isinstance(samples.get(source), list):
            parts.append(f"{len(samples[source])} {what}")
    if isinstance(rtt := samples.get("rtt_ratio"), RttRatio):
        parts.append(f"{len(rtt.during)} + {len(rtt.calm)} round trips (storm + calm)")
    if isinstance(flows := samples.get("flow_ratio"), FlowRatio):
        parts.append(f"{len(flows.during)} + {len(flows.calm)} TCP bulk flows (storm + calm)")
    if isinstance(rec := samples.get("recovery"), Recovery):
        parts.append(f"{len(rec.bounds)} NIC flap recover{'y' if len(rec.bounds) == 1 else 'ies'}")
    if isinstance(lost := samples.get("lost"), Counts):
        parts.append(f"{sum(n for _, n in lost.by_test.values())} requests checked for loss")
    return parts
