"""What a suite test records into the report: :class:`Conformance`, the ``conformance`` fixture's
object (harness/fixtures.py). Verdicts (gated by the test machine's health), latency, fault
activities, the timeline and artifacts go into the run's RunResult (harness/plugin_state.py)."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import pytest

from harness.checks.verdict import Verdict
from harness.plugin_state import harness_state, show

if TYPE_CHECKING:
    from harness.probes.loadgen.load import LoadRunner
    from harness.probes.machine_health.machine import MachineMonitor

MACHINE = pytest.StashKey["MachineMonitor"]()  # the session's test-machine monitor while the cluster is up


class Conformance:
    """What a suite test records into the report. Verdicts are stamped with the test's node id."""

    def __init__(self, config: pytest.Config, nodeid: str) -> None:
        self._config = config
        self._state = harness_state(config)
        self.nodeid = nodeid
        self.started = time.time()  # the test's machine-health window starts here
        self.load_runs: list[LoadRunner] = []  # this test's LoadRunners (the ``load`` fixture adds them)
        self.timeline_added = False  # the suite put its timeline in (its epilogue ran)
        self._fault_entries: Counter[tuple[str, str]] = Counter()  # (fault id, fault_<action>) on the timeline

    def record(self, verdict: Verdict, windows: Sequence[tuple[float, float]] | None = None) -> Verdict:
        """Record ``verdict``, gated by the test machine's health over ``windows`` (wall-clock
        ``(start, end)`` pairs; the test so far by default): harness/checks/machine.py. Returns
        the verdict as recorded, its ``evidence["machine"]`` holding each window's figures."""
        verdict = self._machine_gate(verdict, windows)
        verdict.test = self.nodeid
        self._state.result.verdicts.append(verdict)
        self._state.verdicts_by_test.setdefault(self.nodeid, []).append(verdict)
        from harness.report.terminal import verdict_line

        show(self._config, verdict_line(verdict))
        return verdict

    def _machine_gate(self, verdict: Verdict, windows: Sequence[tuple[float, float]] | None) -> Verdict:
        monitor = self._config.stash.get(MACHINE, None)
        if monitor is None:  # no cluster session (a capability gate before bring-up)
            return verdict
        from harness.checks.machine import gate
        from harness.errors import ProbeError

        records = []
        for run in self.load_runs:  # open-loop send lateness: the load generator's own lag
            if not run.profile.open_loop:
                continue  # a closed-loop user sends when its last request ends: never late
            try:
                records.extend(run.records())
            except ProbeError:
                pass  # not started or nothing written yet
        spans = windows or [(self.started, time.time())]
        return gate(verdict, [monitor.window(start, end, records) for start, end in spans])

    def steal_bursts(self) -> list[tuple[float, float]]:
        """Wall-clock spans since the test began in which the hypervisor took over the machine
        gate's ``steal_leave_out_pct`` of the CPUs over some 5 s (none without a machine monitor)."""
        monitor = self._config.stash.get(MACHINE, None)
        if monitor is None:
            return []
        from harness.checks.machine import LIMITS

        return monitor.steal_spans(LIMITS.steal_leave_out_pct, self.started)

    def show_plan(self, lines: Sequence[str]) -> None:
        """A dry run's plan lines (``[dry-run] ...``) on the terminal while the suite runs."""
        from harness.dry_run import show_lines

        show_lines(self._config, lines)

    def phase(self, name: str) -> None:
        """Name what the test does now ("baseline", "storm", "recovery"): shown in the live display."""
        if self._state.live is not None:
            self._state.live.set_phase(name)

    def add_latency(self, records: list[Any], *, window_s: float = 2.0, frame: Any = None) -> None:
        """Percentiles over time of TTFT and TPOT (ok requests only) for the report's charts; from
        ``frame`` (``start_wall_ns``, ``ok`` and the metrics' columns) instead of records when given."""
        from harness.probes.client.analysis import requests_frame, windowed_frame

        t0_ns = int(self._state.result.started * 1e9)
        df = requests_frame(records) if frame is None else frame.copy()
        if len(df):
            df["t_s"] = (df["start_wall_ns"] - t0_ns) / 1e9
        for metric in ("ttft_ms", "tpot_ms"):
            frame_ = windowed_frame(df, window_s=window_s, metric=metric)
            for row in frame_.to_dict("records"):
                self._state.result.latency.append(
                    {"t": self._state.result.started + row["window_start_s"], "metric": metric,
                     **{k: (None if v != v else float(v)) for k, v in row.items() if k.startswith("p")},
                     "n": int(row["ok"]), "failed": int(row["failed"])})

    def add_fault_records(self, records: list[Any]) -> None:
        """Fault activities for the ledger table, and one shaded window per fault (inject to revert)."""
        spans: dict[str, list[float]] = {}
        for rec in records:
            d = rec.to_dict() if hasattr(rec, "to_dict") else dict(rec)
            self._state.result.faults.append(d)
            span = spans.setdefault(d["fault_id"], [d["started_wall"], d["ended_wall"] or d["started_wall"], 0])
            span[1] = max(span[1], d["ended_wall"] or d["started_wall"])
            if d["action"] == "inject":
                span[0], span[2] = d["started_wall"], f"{d['kind']} {d['target']}"
        for start, end, label in spans.values():
            self._state.result.fault_windows.append({"start": start, "end": end, "label": label or "fault"})

    @property
    def seen_events(self) -> set[str]:
        """The engine events the run's timeline holds already: each router event is recorded once,
        although every suite reads the router's whole log."""
        return self._state.seen_events

    def add_timeline(self, entries: list[dict[str, Any]]) -> None:
        """Entries of :func:`harness.probes.client.timeline.merge_timeline`."""
        self.timeline_added = True
        for e in entries:
            detail = e.get("detail")
            if e["source"] == "fault" and isinstance(detail, dict):
                self._fault_entries[(str(detail.get("fault_id")), e["kind"])] += 1
            if isinstance(detail, dict):
                detail = ", ".join(f"{k}={v}" for k, v in detail.items() if v not in (None, "", [], {}))
            self._state.result.timeline.append({"t": e["t_wall_ns"] / 1e9, "source": e["source"], "kind": e["kind"],
                                                "detail": str(detail or "")[:300]})

    def missing_fault_records(self, records: list[Any]) -> list[Any]:
        """The fault records this test's timeline lacks: all of them when the suite put in none (it
        stopped early), else those that came after it did (a revert in the fixture's teardown), so
        the timeline counts every ledger step (issue 37: a speculative-decoding revert was missing)."""
        left = Counter(self._fault_entries)
        missing = []
        for rec in records:
            d = rec.to_dict() if hasattr(rec, "to_dict") else dict(rec)
            key = (str(d.get("fault_id")), f"fault_{getattr(d.get('action'), 'value', d.get('action'))}")
            if left[key] > 0:
                left[key] -= 1
            else:
                missing.append(rec)
        return missing

    def artifact_dir(self, name: str) -> Path:
        """A folder for this test's raw data inside the run's report folder."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        path = self._state.options.report_dir / self._state.result.run_id / "artifacts" / safe
        path.mkdir(parents=True, exist_ok=True)
        return path


__all__ = ["MACHINE", "Conformance"]
