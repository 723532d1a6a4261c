import pytest

from harness.stats.intervals import measured_within
from harness.checklists import Checklist
from harness.checks.verdict import Measurement, Verdict, judge
from harness.report import RunResult, collect_environment


@pytest.fixture
def sample_result() -> RunResult:
    """A run with one passing, one failing and one inconclusive verdict (test input for rendering)."""
    cl = Checklist.load()
    item4 = cl.item("6.1.4")
    samples = [{"label": "kill prefill-0 #1", "value": 0.8}, {"label": "kill decode-1 #1", "value": 3.6},
               {"label": "hang decode-0 #1", "value": 2.1}]
    failing = judge(item4, [Measurement(item4.thresholds["reschedule_p100_s"], 3.6, "p100 rescheduling time",
                                        measured_within(3.6, below=0.05, above=0.001, n=3, noun="faults")),
                            Measurement(item4.thresholds["reschedule_p95_s"], 3.45, "p95 rescheduling time")],
                    evidence={"samples": samples, "links": ["https://example.invalid/run/1"]})
    failing.test = "suites/test_item4_reschedule.py::test_kill_reschedules_within_3s"
    lost = cl.item("nothing-lost")
    passing = judge(lost, [Measurement(lost.thresholds["requests_without_final_state"], 0, "requests <hang>")])
    unknown = Verdict(item="6.1.1", title=cl.item("6.1.1").title, status="inconclusive",
                      reason="inconclusive: no fabric line rate known")
    t0 = 1_800_000_000.0
    return RunResult(
        run_id="20270115T080000Z-1", started=t0, finished=t0 + 60, exit_code=1,
        verdicts=[failing, passing, unknown],
        cluster={"name": "local", "kind": "bundled"}, environment=collect_environment(),
        options={"load_users": 4},
        latency=[{"t": t0 + i * 5, "metric": m, "p50": base + i, "p99": base * 2 + 3 * i, "n": 20}
                 for i in range(12) for m, base in (("ttft_ms", 40.0), ("tpot_ms", 8.0))],
        fault_windows=[{"start": t0 + 20, "end": t0 + 24, "label": "kill decode-1"}],
        timeline=[{"t": t0 + 20, "source": "faults", "kind": "inject", "detail": "SIGKILL decode-1"},
                  {"t": t0 + 23.6, "source": "router", "kind": "reschedule", "detail": "3 requests re-placed"}],
        faults=[{"fault_id": "f1", "kind": "process_kill", "target": "decode-1", "action": "inject",
                 "started_wall": t0 + 20, "started_mono": 1.0, "ended_wall": t0 + 20.01, "ended_mono": 1.01,
                 "status": "succeeded", "output": "pid 123 gone", "error": None, "duration_s": 0.01}],
        tests=[{"nodeid": failing.test, "outcome": "failed", "duration_s": 55.0, "message": failing.reason}],
    )
