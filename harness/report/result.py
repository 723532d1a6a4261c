"""One run's results (:class:`RunResult`), JSON-able: filled by the plugin during the session and
rendered once at the end by the writers of this package (harness/report/__init__.py's
``write_reports``: HTML, JSON, JUnit XML). Kept apart from the package's ``__init__`` so the writers
import it without importing the package that calls them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from harness.checks.verdict import Verdict

EXIT_MEANINGS = {0: "conformant", 1: "not conformant", 2: "inconclusive", 3: "harness error",
                 4: "a revert failed (cluster may be dirty)"}


@dataclass
class RunResult:
    """Everything one run produced. Times are wall-clock seconds (``time.time()``).

    ``latency`` rows: ``{"t": window start, "metric": "ttft_ms", "p50": .., "p90": .., "p99": .., "n": ..}``;
    ``fault_windows``: ``{"start": t, "end": t, "label": "kill decode-0"}``;
    ``timeline``: ``{"t": t, "source": "router", "kind": "worker_down", "detail": "..."}``;
    ``faults``: fault ledger records (``FaultRecord.to_dict()``);
    ``cluster_samples``: ``{"t": t, "kv_usage": 0.42, "degradation_level": 1, ...}`` sampled from the
    cluster's metrics while suites ran (docs/results-schema.md);
    ``machine``: the test machine's health while the cluster was up: ``{"interval_s", "cpus",
    "psi_note", "limits", "samples": [{"t", "psi_some_pct", "timer_lag_max_ms", ...}]}``.
    """

    run_id: str
    started: float
    finished: float | None = None
    exit_code: int | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    cluster: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    latency: list[dict[str, Any]] = field(default_factory=list)
    fault_windows: list[dict[str, Any]] = field(default_factory=list)
    cluster_samples: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    tests: list[dict[str, Any]] = field(default_factory=list)  # {"nodeid", "outcome", "duration_s", "message"}
    harness_errors: list[str] = field(default_factory=list)
    revert_failures: list[str] = field(default_factory=list)
    # what the cluster provides ({capability: {provided, why_not, provided_by}}) and which items
    # were judged ({"judged": {item: status}, "not_judged": {item: [reasons]}, "not_run": [item]})
    capabilities: dict[str, Any] = field(default_factory=dict)
    coverage: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    # a soak run (suites/test_soak.py): its schedule, fault outcomes, windows and leak series
    soak: dict[str, Any] = field(default_factory=dict)
    # --baseline: this run against a stored baseline run (harness/compare.py Comparison.to_dict(), or
    # {"baseline", "error"} when it could not be compared); empty without --baseline
    regression: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_meaning(self) -> str:
        return EXIT_MEANINGS.get(self.exit_code, "unknown") if self.exit_code is not None else "running"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdicts"] = [v.to_dict() for v in self.verdicts]
        data["exit_meaning"] = self.exit_meaning
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunResult":
        data = {k: v for k, v in data.items() if k != "exit_meaning"}
        data["verdicts"] = [Verdict.from_dict(v) for v in data.get("verdicts", [])]
        return cls(**data)


__all__ = ["EXIT_MEANINGS", "RunResult"]
