"""The comparison's figures beyond 6.2 and 6.1.4 (harness/compare_samples.py, docs/compare.md): 6.1.2
migration deltas, 6.1.1 line-rate fraction, 6.1.5 p99 round-trip ratio, lost requests; 6.1.3 not
comparable. Results as harness/checks writes their evidence (field names of a real results.json:
tests/report/data/real_run_results.json and the bundled main job's). Each test names the planted
defect it fails on."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from harness.checklists import Checklist, default_checklist
from harness.compare import compare_runs, load_run, render_text
from harness.errors import ConfigError
from harness.report.html import render_html
from harness.report.result import RunResult
from harness.stats.twosample import difference_interval

CLUSTER = {"name": "local", "kind": "bundled", "engine": "bundled", "model": "tiny", "workers": []}


def _m(key: str, value: float | None) -> dict:
    return {"key": key, "value": value}


def _lognormal(n: int, median: float, sigma: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(median * rng.lognormvariate(0, sigma), 4) for _ in range(n)]


def migration_verdict(idle: list[float], loaded: list[float], failed: int = 0) -> dict:
    per = [{"phase": p, "excess_ms": x} for p, xs in (("idle", idle), ("loaded", loaded)) for x in xs]
    return {"item": "6.1.2", "status": "pass", "test": "suites/test_item2_hot_migration.py::test_hot_migration_ttft_delta",
            "evidence": {"measurements": [_m("ttft_delta_idle_ms", 1.0), _m("ttft_delta_loaded_ms", 1.0)],
                         "per_migration": per, "failed_migrations": failed}}


def line_rate_verdict(gbit: list[float], line: float = 1.0) -> dict:
    curve = [{"size_bytes": 1 << 20, "gbit_per_s": [line * 2] * len(gbit)},   # a small size the verdict ignores
             {"size_bytes": 128 << 20, "gbit_per_s": gbit}]
    return {"item": "6.1.1", "status": "pass", "test": "suites/test_item1_kv_bandwidth.py::t",
            "evidence": {"measurements": [_m("line_rate_fraction", 0.9)], "kv_curve": curve,
                         "line_rate": {"gbit_per_s": line}}}


def pfc_verdict(during: list[float] | None, calm: list[float], floor: float | None = None) -> dict:
    ev = {"measurements": [_m("tcp_p99_latency_ratio", 1.0)], "rtt_noise_floor_ms": floor}
    if during is not None:
        ev["rtts_ms"] = {"during": during, "calm": calm}
    return {"item": "6.1.5", "status": "pass", "test": "suites/test_item5_pfc_isolation.py::t", "evidence": ev}


def lost_verdict(test: str, lost: int, requests: int) -> dict:
    return {"item": "nothing-lost", "status": "pass", "test": test,
            "evidence": {"measurements": [_m("requests_without_final_state", lost)], "requests": requests}}


def run(tmp_path: Path, name: str, *verdicts: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"run_id": name, "verdicts": list(verdicts), "cluster": CLUSTER,
                                                     "options": {}}))
    return load_run(folder)


def by_figure(comp) -> dict:
    return {f.figure: f for f in comp.figures}


def test_migration_deltas_are_compared_per_phase_and_failed_migrations_leave_them_undecided(tmp_path):
    """Planted defects: the phase ignored (idle and loaded pooled: the idle figure, unchanged, reads
    regressed with the loaded one), failed migrations dropped (a median of the rest would hide them)."""
    base = run(tmp_path, "b", migration_verdict(_lognormal(64, 2.0, 0.2, 1), _lognormal(64, 20.0, 0.2, 2)))
    cand = run(tmp_path, "c", migration_verdict(_lognormal(64, 2.0, 0.2, 3), _lognormal(64, 50.0, 0.2, 4)))
    f = by_figure(compare_runs(base, cand, default_checklist()))
    assert f["ttft_delta_loaded_ms"].status == "regressed" and 2 < f["ttft_delta_loaded_ms"].ratio < 3
    assert f["ttft_delta_idle_ms"].status in ("within tolerance", "improved")
    failed = run(tmp_path, "f", migration_verdict(_lognormal(64, 2.0, 0.2, 3), _lognormal(64, 20.0, 0.2, 4), failed=2))
    f = by_figure(compare_runs(base, failed, default_checklist()))
    assert f["ttft_delta_idle_ms"].status == "inconclusive" and "migrations that failed (candidate 2 of" in \
        f["ttft_delta_idle_ms"].reason


def test_a_fall_of_the_line_rate_fraction_regresses_and_a_rise_does_not(tmp_path):
    """Planted defects: max_decrease judged like max_increase (a 15 % fall reads within tolerance and a
    rise regressed), the curve's first size taken instead of the largest (the one the verdict judges)."""
    base = run(tmp_path, "b", line_rate_verdict(_lognormal(9, 0.95, 0.005, 1)))
    fell = run(tmp_path, "c", line_rate_verdict(_lognormal(9, 0.80, 0.005, 2)))
    rose = run(tmp_path, "d", line_rate_verdict(_lognormal(9, 0.99, 0.005, 3)))
    f = by_figure(compare_runs(base, fell, default_checklist()))["line_rate_fraction"]
    assert f.status == "regressed" and 0.8 < f.ratio < 0.87 and f.allowed == ">= 0.95x"
    assert by_figure(compare_runs(base, rose, default_checklist()))["line_rate_fraction"].status == "improved"


def test_the_p99_round_trip_ratio_is_recomputed_from_raw_round_trips_and_old_evidence_names_the_field(tmp_path):
    """Planted defects: the floor ignored (the baseline's calm p99, 0.2 ms, under its floor of 0.6 ms
    makes its ratio 3 instead of 1, so a candidate twice as slow, with no floor, reads improved), an
    old 6.1.5 verdict without round trips not naming ``evidence.rtts_ms``."""
    calm = _lognormal(4000, 0.1, 0.3, 1)   # p99 about 0.2 ms
    base = run(tmp_path, "b", pfc_verdict(_lognormal(4000, 0.3, 0.3, 2), calm, floor=0.6))
    cand = run(tmp_path, "c", pfc_verdict(_lognormal(4000, 0.2, 0.3, 3), calm, floor=None))
    f = by_figure(compare_runs(base, cand, default_checklist()))["tcp_p99_latency_ratio"]
    assert f.status == "regressed" and 1.7 < f.ratio < 2.3
    old = run(tmp_path, "o", pfc_verdict(None, calm))
    f = by_figure(compare_runs(old, cand, default_checklist()))["tcp_p99_latency_ratio"]
    assert f.status == "inconclusive" and "the baseline's 6.1.5 verdict has no evidence.rtts_ms" in f.reason


def test_lost_requests_compare_the_shares_of_the_tests_both_runs_ran(tmp_path):
    """Planted defects: every test pooled (the candidate's extra suite, 200 of 400 lost, reads as a
    regression of the shared ones), a ratio of shares (0 of 3000 against 0: no verdict ever), the
    difference taken baseline minus candidate (a rise of 3 points reads improved)."""
    shared = "suites/test_62_slo.py::t"
    base = run(tmp_path, "b", lost_verdict(shared, 0, 3000))
    same = run(tmp_path, "s", lost_verdict(shared, 3, 3000), lost_verdict("suites/extra.py::t", 200, 400))
    worse = run(tmp_path, "w", lost_verdict(shared, 90, 3000))
    f = by_figure(compare_runs(base, same, default_checklist()))["requests_without_final_state"]
    assert f.status == "within tolerance" and f.ratio is None and f.difference == pytest.approx(0.001)
    f = by_figure(compare_runs(base, worse, default_checklist()))["requests_without_final_state"]
    assert f.status == "regressed" and f.allowed == "<= +1 pt" and "+3 pt" in f.reason


def test_the_difference_of_two_shares_matches_newcombe_and_holds_at_zero_events():
    """Planted defect: the two Wilson bounds of the second share swapped (Newcombe's worked example,
    56/70 - 48/80: 0.0524 to 0.3339 at 95 %, comes out wrong)."""
    iv = difference_interval(56, 70, 48, 80, alpha_lo=0.025, alpha_hi=0.025)
    assert iv.lo == pytest.approx(0.0524, abs=5e-4) and iv.hi == pytest.approx(0.3339, abs=5e-4)
    zero = difference_interval(0, 300, 0, 300, alpha_lo=0.01, alpha_hi=0.01)
    assert -0.02 < zero.lo < 0 < zero.hi < 0.02


def test_6_1_3_is_not_comparable_and_tolerances_of_the_wrong_kind_are_errors_naming_the_field(tmp_path):
    """Planted defects: a 6.1.3 verdict silently ignored (no reason given), a `max_increase` accepted
    on the line-rate fraction (a fall would then never regress), 6.1.3 accepted in `regression:`."""
    trig = {"item": "6.1.3", "status": "pass", "test": "t", "evidence": {"measurements": [_m("trigger_utilization", 0.87)]}}
    base = run(tmp_path, "b", lost_verdict("t", 0, 100), trig)
    comp = compare_runs(base, run(tmp_path, "c", lost_verdict("t", 0, 100), trig), default_checklist())
    assert "6.1.3" in comp.not_comparable and "once" in comp.not_comparable["6.1.3"]
    assert "6.1.3 not comparable" in render_text(comp)
    text = Path(default_checklist().path).read_text() if Path(default_checklist().path).is_file() else \
        (Path(__file__).resolve().parents[1] / "checklists" / "section6.yaml").read_text()
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(text.replace("line_rate_fraction: {max_decrease: 0.05}", "line_rate_fraction: {max_increase: 0.05}"))
    with pytest.raises(ConfigError, match=r"regression\.figures\.6\.1\.1\.line_rate_fraction.*max_decrease"):
        Checklist.load(wrong)
    trigger = tmp_path / "trigger.yaml"
    trigger.write_text(text.replace('    "6.1.5":\n      tcp_p99',
                                    '    "6.1.3":\n      trigger_utilization: {max_increase: 0.1}\n    "6.1.5":\n      tcp_p99'))
    with pytest.raises(ConfigError, match=r"regression\.figures\.6\.1\.3.*not comparable"):
        Checklist.load(trigger)


def test_the_html_report_shows_the_new_figures_with_their_allowed_change(tmp_path):
    """Planted defect: the report's "Allowed" column computed as 1 + tolerance for every figure (the
    line-rate fraction shown as <= 1.05x, lost requests as a ratio)."""
    base = run(tmp_path, "b", lost_verdict("t", 0, 3000), line_rate_verdict(_lognormal(9, 0.95, 0.005, 1)))
    cand = run(tmp_path, "c", lost_verdict("t", 90, 3000), line_rate_verdict(_lognormal(9, 0.80, 0.005, 2)))
    result = RunResult(run_id="r", started=0.0, regression=compare_runs(base, cand, default_checklist()).to_dict())
    html = render_html(result)
    assert "&gt;= 0.95x" in html and "&lt;= +1 pt" in html and "+3 pt" in html


def test_the_6_1_5_verdict_keeps_every_round_trip_for_the_comparison(tmp_path):
    """Planted defect: the 6.1.5 evidence without its raw round trips (`rtts_ms`): a comparison of two
    fresh runs could then only say the field is missing."""
    from harness.checks.fabric import pfc_isolation_verdict
    from tests.fabric.test_verdicts import _sample
    v = pfc_isolation_verdict(default_checklist(), _sample("calm", 0.5, 1.0), _sample("during", 0.6, 1.0), None, {})
    rtts = v.evidence["rtts_ms"]
    assert len(rtts["calm"]) == 600 and len(rtts["during"]) == 600 and max(rtts["during"]) == pytest.approx(0.6, rel=0.02)
    base = run(tmp_path, "b", {"item": "6.1.5", "status": "pass", "test": "t", "evidence": json.loads(json.dumps(
        {**v.evidence, "measurements": [_m("tcp_p99_latency_ratio", 1.2)]}, default=str))})
    f = by_figure(compare_runs(base, base, default_checklist()))["tcp_p99_latency_ratio"]
    assert f.ratio == pytest.approx(1.0) and "no evidence" not in f.reason


def test_runs_whose_6_1_1_presets_differ_are_refused_only_when_both_measured_it(tmp_path):
    """Planted defects: 6.1.1's preset not compared (transfers of another size read as a bandwidth
    change), or compared when one run did not measure 6.1.1 (a lost-requests pair refused for it)."""
    def verdict(preset: str) -> dict:
        v = line_rate_verdict(_lognormal(9, 0.95, 0.005, 1))
        v["evidence"]["preset"] = preset
        return v
    tiny, small = run(tmp_path, "t", verdict("tiny")), run(tmp_path, "s", verdict("small"))
    with pytest.raises(ConfigError, match=r'6\.1\.1 preset: baseline "tiny", candidate "small"'):
        compare_runs(tiny, small, default_checklist())
    only = run(tmp_path, "o", lost_verdict("t", 0, 100))
    with_lost = run(tmp_path, "w", verdict("small"), lost_verdict("t", 0, 100))
    assert compare_runs(only, with_lost, default_checklist()).differences == []


def _cluster_file(tmp_path: Path, regression: str) -> Path:
    path = tmp_path / "slowfabric.yaml"
    path.write_text("name: slowfabric\nkind: bundled\nbundled: {prefill: 1, decode: 1, preset: tiny}\n" + regression)
    return path


def test_a_cluster_file_overrides_tolerances_for_compare_and_for_its_own_runs(tmp_path):
    """Planted defects: `harness compare --cluster` ignoring the file (an 8 % fall stays regressed at
    the checklist's 5 %), the cluster's checklist (what a run with --baseline judges by) not applying
    its `regression:`, an override replacing every other figure's tolerance instead of its own."""
    from harness.clusterfile.load import load_cluster
    cluster = _cluster_file(tmp_path, "regression:\n  figures:\n    \"6.1.1\": {line_rate_fraction: {max_decrease: 0.20}}\n")
    checklist = load_cluster(cluster).checklist()
    assert checklist.regression.tolerances["6.1.1"] == {"line_rate_fraction": 0.20}
    assert checklist.regression.tolerances["6.2.ttft"] == default_checklist().regression.tolerances["6.2.ttft"]
    assert checklist.regression.alpha == 0.05 and checklist.regression.overridden_by == str(cluster)
    base = run(tmp_path, "b", line_rate_verdict(_lognormal(9, 0.95, 0.003, 1)))
    cand = run(tmp_path, "c", line_rate_verdict(_lognormal(9, 0.874, 0.003, 2)))
    assert by_figure(compare_runs(base, cand, default_checklist()))["line_rate_fraction"].status == "regressed"
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "harness", "compare", str(base.results_path), str(cand.results_path),
                          "--cluster", str(cluster)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stdout + out.stderr
    assert ">= 0.8x" in out.stdout and f"overridden by {cluster}" in out.stdout


@pytest.mark.parametrize("regression, field", [
    ("regression:\n  alpha: 0.7\n", "regression.alpha"),
    ("regression:\n  figures:\n    \"6.1.1\": {line_rate_fraction: {max_increase: 0.1}}\n",
     "regression.figures.6.1.1.line_rate_fraction"),
    ("regression:\n  figures:\n    \"6.2.ttft\": {ttft_p98_ms: {max_increase: 0.1}}\n", "regression.figures.6.2.ttft.ttft_p98_ms"),
    ("regression:\n  figures:\n    \"6.1.3\": {trigger_utilization: {max_increase: 0.1}}\n", "regression.figures.6.1.3"),
    ("regression:\n  figurs: {}\n", "regression.figurs"),
])
def test_a_cluster_files_regression_overrides_are_validated_naming_the_field(tmp_path, regression, field):
    """Planted defect: the cluster's figures not checked as the checklist's are (a `max_increase` on the
    line-rate fraction, an unknown figure or 6.1.3 accepted and only failing, or silently ignored, later)."""
    from harness.clusterfile.load import load_cluster
    with pytest.raises(ConfigError, match=f"slowfabric.yaml: field `{field.replace('.', '[.]')}`"):
        load_cluster(_cluster_file(tmp_path, regression))


def test_the_html_report_shows_a_long_list_of_numbers_as_one_line(tmp_path):
    """Planted defect: the evidence's raw round trips dumped one per line into report.html (6.1.5's
    thousands of round trips a side would make the report tens of thousands of lines longer)."""
    from harness.checks.fabric import pfc_isolation_verdict
    from tests.fabric.test_verdicts import _sample
    v = pfc_isolation_verdict(default_checklist(), _sample("calm", 0.5, 1.0), _sample("during", 0.6, 1.0), None, {})
    v.test = "suites/test_item5_pfc_isolation.py::test_pfc_storm_does_not_spread_to_tcp"
    html = render_html(RunResult(run_id="r", started=0.0, verdicts=[v]))
    assert "600 numbers, from" in html and html.count("0.4995") <= 2


def test_a_comparison_of_every_kind_of_figure_validates_against_the_results_schema(tmp_path):
    """Planted defects: the schema's `tolerance` typed as a number (it is {kind: value}), `difference`
    missing from the schema's types (a share's difference could not be null), a status outside the enum."""
    from tests.report.test_results_schema import SCHEMA, _check
    base = run(tmp_path, "b", lost_verdict("t", 0, 3000), line_rate_verdict(_lognormal(9, 0.95, 0.005, 1)),
               migration_verdict(_lognormal(16, 2.0, 0.2, 1), _lognormal(16, 20.0, 0.2, 2)))
    cand = run(tmp_path, "c", lost_verdict("t", 90, 3000), line_rate_verdict(_lognormal(9, 0.80, 0.005, 2)),
               migration_verdict(_lognormal(16, 2.0, 0.2, 3), _lognormal(16, 20.0, 0.2, 4)))
    regression = json.loads(json.dumps(compare_runs(base, cand, default_checklist()).to_dict()))
    assert {f["figure"] for f in regression["figures"]} >= {"line_rate_fraction", "requests_without_final_state",
                                                             "ttft_delta_idle_ms"}
    assert _check(regression, SCHEMA["properties"]["regression"]) == []
