"""bench/bench_compare.py's own parts, without runs (the bench itself runs the 6.2 suite 3 times a
pair: docs/compare.md has its output)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

from harness.checklists import default_checklist
from harness.compare import load_run
from harness.compare_samples import Counts
from tests.test_compare import report_folder, run_records

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "bench" / "bench_compare.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)  # type: ignore[union-attr]


def test_power_rises_with_the_shift_and_the_candidate_cluster_differs_only_in_its_engine(tmp_path):
    """Planted defects: the shift applied to the baseline's side (power 0 at 2x); the candidate's
    cluster renamed (every comparison refused as another cluster) or the knob not set; the lost
    requests' counts resampled as if they were values (a real 6.2 run crashed the bench)."""
    runs = [load_run(report_folder(tmp_path / f"r{k}", run_records(1500, k))) for k in range(3)]
    for r in runs:   # a real 6.2 run also has its nothing-lost verdict: a share, not values to scale
        r.samples["lost"] = Counts({"suites/test_62_slo.py::t": (0, 1500)})
    table = bench.power(runs, default_checklist(), trials=20, seed=1)
    assert set(table) == {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"}
    assert table["ttft_p50_ms"][2.0] >= 0.9 and table["tpot_p50_ms"][2.0] >= 0.9, table
    assert table["ttft_p50_ms"][1.05] <= table["ttft_p50_ms"][2.0]
    shipped = yaml.safe_load(bench.cluster_file(tmp_path, None).read_text())
    knob = yaml.safe_load(bench.cluster_file(tmp_path, 2).read_text())
    assert knob["name"] == shipped["name"] == "local" and knob["bundled"]["engine"]["num_threads"] == 2
    assert {k: v for k, v in knob["bundled"].items() if k != "engine"} == \
        {k: v for k, v in shipped["bundled"].items() if k != "engine"}


def test_each_pair_is_recorded_and_the_tally_counts_only_pairs_of_the_same_settings(tmp_path, capsys):
    """Planted defects: pairs of other settings counted (the tally says 3 pairs, not 2); the baseline
    samples left out of the line (no power table from the ledger); an A/A regression not counted."""
    import json

    runs = [load_run(report_folder(tmp_path / f"r{k}", run_records(600, k))) for k in range(2)]
    slowed = load_run(report_folder(tmp_path / "slow", run_records(600, 5, ttft_ms=80.0)))
    checklist = default_checklist()
    aa, ab = bench.compare_runs(runs[0], runs[1], checklist), bench.compare_runs(runs[0], slowed, checklist)
    ledger = tmp_path / "pairs.jsonl"
    mine, other = {"users": 4, "duration": 8.0, "threads": 2}, {"users": 8, "duration": 8.0, "threads": 2}
    with ledger.open("a") as f:
        for k, settings in ((1, mine), (2, mine), (3, other)):
            f.write(json.dumps(bench.pair_line(k, settings, runs[0], runs[1], aa, ab, 0.0)) + "\n")
    lines = bench.read_ledger(ledger, mine, None)
    assert [x["pair"] for x in lines] == [1, 2]
    assert len(lines[0]["base_samples"]) == 2 and len(lines[0]["base_samples"][0]["ttft"]) > 500
    assert bench.read_ledger(ledger, mine, ["nope"]) == []
    bench.summarize(lines, checklist, trials=10)
    out = capsys.readouterr().out
    assert "over 2 pairs" in out and "smallest at 80 %" in out, out
    ttft_p50 = next(r for r in lines[0]["ab"] if r["figure"] == "ttft_p50_ms")
    assert ttft_p50["status"] == "regressed", ttft_p50   # the doubled TTFT, as the live bench would see it
    row = next(x for x in out.splitlines() if x.startswith("ttft_p50_ms "))
    assert row.split()[3] == "2", row   # A/B regressed in both recorded pairs
    assert bench.main(["--tally", "--quick", "--ledger", str(ledger), "--users", "8"]) == 0
    assert "1 pair(s) with {'users': 8" in capsys.readouterr().out
