"""The fabric figures of the comparison (harness/compare_fabric.py, docs/compare.md): 6.1.5's TCP
throughput ratio under the storm (a fall regresses) and nic-flap's recovery time (bounds from
measurement resolution, compared as bounds). The verdicts are written by the real verdict functions
(harness/checks/fabric.py), the NIC flap's from the recorded real run's probe transfers
(tests/report/data/real_run_results.json) shifted behind planted slow ones. Each test names the
planted defect it fails on."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from harness.checklists import Checklist, default_checklist
from harness.checks.fabric import flap_recovery_verdict, pfc_isolation_verdict
from harness.compare import compare_runs, load_run, render_text
from harness.errors import ConfigError
from harness.fabric.tcpprobe import TcpClassSample
from harness.report.html import render_html
from harness.report.junit import junit_tree
from harness.report.result import RunResult
from harness.stats import nearest_rank

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = {"name": "local", "kind": "bundled", "engine": "bundled", "model": "tiny", "workers": []}
REAL = json.loads((ROOT / "tests/report/data/real_run_results.json").read_text())
FLAP = next(v for v in REAL["verdicts"] if v["item"] == "nic-flap")   # recovered at once: [0, 0.452] s
BEFORE = FLAP["evidence"]["before_gbit_per_s"]
AFTER = [(a["start_s"], a["t_s"], a["gbit_per_s"]) for a in FLAP["evidence"]["after"]]


def run(tmp_path: Path, name: str, *verdicts: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"run_id": name, "verdicts": list(verdicts), "cluster": CLUSTER,
                                                     "options": {}}, default=str))
    return load_run(folder)


def figure(comp, name: str):
    return next(f for f in comp.figures if f.figure == name)


def _side(label: str, gbit: float, seed: int, flows: int = 32) -> TcpClassSample:
    """A window of the TCP class: 600 round trips up to 0.2 ms, ``flows`` bulk flows around ``gbit``
    (lognormal, sigma 0.03, seeded)."""
    rng = random.Random(seed)
    rtts = tuple(0.2 / 0.99 * (k + 0.5) / 600 for k in range(600))
    bps = tuple(gbit * 1e9 * rng.lognormvariate(0, 0.03) for _ in range(flows))
    return TcpClassSample(label, 0.1, 0.2, 0.2, 600, nearest_rank(bps, 50) if bps else 0.0, 0.0, 1.0, rtts, bps)


def pfc_verdict(storm_fraction: float, seed: int, flows: int = 32, storm_flows: int | None = None) -> dict:
    """6.1.5 as its suite records it: the calm and storm sides (``storm_flows``: the storm side's flows,
    else ``flows``), then the sample after the storm, here as slow as the storm side (a class still
    draining)."""
    during = _side("during", storm_fraction, seed + 1, flows if storm_flows is None else storm_flows)
    v = pfc_isolation_verdict(default_checklist(), _side("calm", 1.0, seed, flows), during, None, {"pause_ms": 50})
    v.evidence["samples"].append(_side("after", storm_fraction, seed + 2).to_dict())
    return json.loads(json.dumps(v.to_dict(), default=str))


def flap_verdict(slow_s: float, *, recovers: bool = True) -> dict:
    """nic-flap through the real verdict: probe transfers at a quarter of the speed before the flaps
    (each 1.07 s, the recorded 0.32 s ones at that speed) until ``slow_s``, then the recorded run's
    transfers after them (``recovers`` False: none; the bandwidth never came back)."""
    slow, t = [], AFTER[0][0]
    while t < slow_s:
        slow.append((t, t + 1.07, 0.25 * nearest_rank(BEFORE, 50)))
        t += 1.07
    after = slow + ([(s + t - AFTER[0][0], e + t - AFTER[0][0], g) for s, e, g in AFTER] if recovers else [])
    v = flap_recovery_verdict(default_checklist(), BEFORE, after, dict(FLAP["evidence"]["flaps"]))
    return json.loads(json.dumps(v.to_dict(), default=str))


def test_a_fall_of_the_tcp_throughput_under_the_storm_regresses(tmp_path):
    """Planted defects: the ratio inverted (calm over storm: a fall to 0.7 reads improved), the sample
    after the storm taken as the calm side (it is as slow as the storm side, so the fall reads 1.0),
    the figure judged as a rise (max_increase: the fall reads improved, the recovery regressed)."""
    base = run(tmp_path, "b", pfc_verdict(1.0, 1))
    f = figure(compare_runs(base, run(tmp_path, "fell", pfc_verdict(0.7, 11)), default_checklist()),
               "tcp_throughput_ratio")
    assert f.status == "regressed" and 0.65 < f.ratio < 0.75 and f.allowed == ">= 0.9x"
    assert f.interval.hi < 0.9
    f = figure(compare_runs(base, run(tmp_path, "same", pfc_verdict(1.0, 21)), default_checklist()),
               "tcp_throughput_ratio")
    assert f.status == "within tolerance" and 0.95 < f.ratio < 1.05
    low = run(tmp_path, "low", pfc_verdict(0.8, 31))
    f = figure(compare_runs(low, base, default_checklist()), "tcp_throughput_ratio")
    assert f.status == "improved" and f.interval.lo > 1


def test_a_throughput_ratio_near_the_limit_or_from_few_flows_is_undecided_naming_what_would_decide(tmp_path):
    """Planted defects: an undecided interval judged on its estimate (0.86 x, under the 0.9 x limit,
    read regressed though its interval reaches above the limit), the flows counted as another noun (the
    reason says "more round trips": 5 flows a side have no median bound at 1.25 % a side, 7 do), a run
    with no flow on the storm side (its verdict's ratio 0) crashing the comparison or blamed on the
    other run."""
    base = run(tmp_path, "b", pfc_verdict(1.0, 1))
    f = figure(compare_runs(base, run(tmp_path, "near", pfc_verdict(0.87, 41)), default_checklist()),
               "tcp_throughput_ratio")
    assert f.status == "inconclusive" and "more bulk flows" in f.reason
    few = run(tmp_path, "few", pfc_verdict(1.0, 51, flows=5))
    f = figure(compare_runs(base, few, default_checklist()), "tcp_throughput_ratio")
    assert f.status == "inconclusive" and f.interval.lo is None and f.interval.hi is None \
        and "more bulk flows in each run would decide" in f.reason
    none = run(tmp_path, "none", pfc_verdict(1.0, 61, storm_flows=0))
    for b, c, which in ((base, none, "candidate"), (none, base, "baseline")):
        f = figure(compare_runs(b, c, default_checklist()), "tcp_throughput_ratio")
        assert f.status == "inconclusive" and f"the {which} has no sample of tcp_throughput_ratio" in f.reason


def test_an_older_6_1_5_verdict_without_its_flows_names_the_field(tmp_path):
    """Planted defect: a verdict whose sides lack ``throughputs_bps`` read as no flows at all (no
    reason naming the field, or an error stopping the other figures)."""
    old = pfc_verdict(1.0, 1)
    for side in old["evidence"]["samples"]:
        side.pop("throughputs_bps")
    comp = compare_runs(run(tmp_path, "o", old), run(tmp_path, "c", pfc_verdict(1.0, 2)), default_checklist())
    f = figure(comp, "tcp_throughput_ratio")
    assert f.status == "inconclusive" and "the baseline's 6.1.5 verdict has no evidence.samples[].throughputs_bps" \
        in f.reason and "run 6.1.5 again" in f.reason
    assert figure(comp, "tcp_p99_latency_ratio").interval is not None   # the other figure still compared


def test_recovery_times_are_compared_as_bounds(tmp_path):
    """Planted defects: the bounds ignored (the verdicts' values, each run's upper bound, compared: a
    candidate known within 0.145 to 1.52 s against the recorded 0 to 0.452 s reads 1.07 s longer,
    regressed); the difference taken baseline minus candidate (a 3 s slower recovery reads improved);
    a rise judged as a fall."""
    base = run(tmp_path, "b", FLAP)   # the recorded verdict itself
    f = figure(compare_runs(base, run(tmp_path, "same", flap_verdict(0)), default_checklist()), "recovery_time_s")
    assert f.status == "within tolerance" and f.interval.lo == pytest.approx(-0.4525, abs=1e-3) \
        and f.interval.hi == pytest.approx(0.4525, abs=1e-3) and f.allowed == "<= +1 s"
    slower = run(tmp_path, "slow", flap_verdict(3.0))   # recovered between 2.29 and 3.66 s
    f = figure(compare_runs(base, slower, default_checklist()), "recovery_time_s")
    assert f.status == "regressed" and f.interval.lo == pytest.approx(2.285 - 0.4525, abs=0.01)
    f = figure(compare_runs(slower, base, default_checklist()), "recovery_time_s")
    assert f.status == "improved" and f.interval.hi < 0
    near = run(tmp_path, "near", flap_verdict(0.5))   # one slow transfer: recovered between 0.145 and 1.52 s
    f = figure(compare_runs(base, near, default_checklist()), "recovery_time_s")
    assert f.candidate - f.baseline > 1.0   # the points alone would call it regressed
    assert f.status == "inconclusive" and "shorter probe transfer" in f.reason and "more flaps would not" in f.reason


def test_a_run_not_back_has_no_upper_bound_and_several_recoveries_count_the_slowest(tmp_path):
    """Planted defects: a run whose bandwidth never came back dropped (no sample: the figure reads
    'did not measure', or its recovery taken as 0), the lower bound of a run not back ignored (30 s
    of slow transfers not regressed), only a run's first nic-flap verdict read (a slow second one
    hidden)."""
    base = run(tmp_path, "b", FLAP)
    stuck = run(tmp_path, "stuck", flap_verdict(30.0, recovers=False))
    f = figure(compare_runs(base, stuck, default_checklist()), "recovery_time_s")
    assert f.status == "regressed" and f.interval.hi is None and "candidate not back, later than" in f.reason
    short = run(tmp_path, "short", flap_verdict(0.5, recovers=False))
    f = figure(compare_runs(base, short, default_checklist()), "recovery_time_s")
    assert f.status == "inconclusive" and "not back by its last probe transfer" in f.reason
    both = run(tmp_path, "both", FLAP, flap_verdict(3.0))
    f = figure(compare_runs(base, both, default_checklist()), "recovery_time_s")
    assert f.status == "regressed" and "the slowest of each run's recoveries" in f.reason
    assert "2 NIC flap recoveries" in render_text(compare_runs(base, both, default_checklist()))


def test_an_older_nic_flap_verdict_without_bounds_names_the_field_and_other_flaps_are_refused(tmp_path):
    """Planted defects: a recovery without its interval taken as a point (or as 0 to its value), runs
    whose probe transfers differ in size (the recovery's resolution) compared without a word."""
    old = json.loads(json.dumps(FLAP))
    next(m for m in old["evidence"]["measurements"] if m["key"] == "recovery_time_s")["interval"] = None
    f = figure(compare_runs(run(tmp_path, "o", old), run(tmp_path, "c", FLAP), default_checklist()), "recovery_time_s")
    assert f.status == "inconclusive" and "evidence.measurements[recovery_time_s].interval" in f.reason
    bigger = json.loads(json.dumps(FLAP))
    bigger["evidence"]["flaps"]["probe_mib"] = 64
    with pytest.raises(ConfigError, match=r'nic-flap flaps: baseline .*"probe_mib": 32.*candidate .*"probe_mib": 64'):
        compare_runs(run(tmp_path, "b", FLAP), run(tmp_path, "big", bigger), default_checklist())


def test_the_new_figures_show_in_the_table_json_junit_and_html(tmp_path):
    """Planted defects: a recovery's change shown as a share (x 100, "pt") or as a ratio in the table or
    the report, its tolerance kind missing from the JSON, no JUnit case for either figure, the
    comparison's JSON no longer matching the results schema."""
    from tests.report.test_results_schema import SCHEMA, _check
    base = run(tmp_path, "b", FLAP, pfc_verdict(1.0, 1))
    cand = run(tmp_path, "c", flap_verdict(3.0), pfc_verdict(0.7, 11))
    comp = compare_runs(base, cand, default_checklist())
    text = render_text(comp)
    line = next(x for x in text.splitlines() if x.startswith("recovery_time_s"))
    assert "+3.2 s" in line and "[+1.8, +3.7] s" in line and "<= +1 s" in line and "regressed" in line
    assert any(x.startswith("tcp_throughput_ratio") and ">= 0.9x" in x for x in text.splitlines())
    data = json.loads(json.dumps(comp.to_dict()))
    rec = next(f for f in data["figures"] if f["figure"] == "recovery_time_s")
    assert rec["tolerance"] == {"max_rise_s": 1.0} and rec["change"] == "+3.2 s [+1.8, +3.7] s"
    assert _check(data, SCHEMA["properties"]["regression"]) == []
    result = RunResult(run_id="r", started=0.0, regression=data)
    cases = {(c.get("classname"), c.get("name")): c for c in junit_tree(result).getroot().iter("testcase")}
    assert cases[("regression.nic-flap", "recovery_time_s")].find("failure") is not None
    assert cases[("regression.6.1.5", "tcp_throughput_ratio")].find("failure") is not None
    html = render_html(result)
    assert "+3.2 s [+1.8, +3.7] s" in html and "&lt;= +1 s" in html and "+3.2e+02 pt" not in html


@pytest.mark.parametrize("old, new, field, kind", [
    ("recovery_time_s: {max_rise_s: 1.0}", "recovery_time_s: {max_increase: 0.1}",
     "regression.figures.nic-flap.recovery_time_s", "max_rise_s"),
    ("tcp_throughput_ratio: {max_decrease: 0.10}", "tcp_throughput_ratio: {max_increase: 0.10}",
     "regression.figures.6.1.5.tcp_throughput_ratio", "max_decrease"),
    ("recovery_time_s: {max_rise_s: 1.0}", "recovery_time_s: {max_rise_s: -1.0}",
     "regression.figures.nic-flap.recovery_time_s.max_rise_s", "greater than or equal"),
])
def test_the_new_tolerances_are_validated_naming_the_field(tmp_path, old, new, field, kind):
    """Planted defects: a ratio tolerance accepted on the recovery time (a bound at 0 has no ratio), a
    rise tolerance on the throughput ratio (a fall would never regress), a negative number of seconds."""
    text = (ROOT / "harness/checklists/section6.yaml").read_text()
    assert old in text
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace(old, new))
    with pytest.raises(ConfigError) as err:
        Checklist.load(wrong)
    assert field in str(err.value) and kind in str(err.value)
