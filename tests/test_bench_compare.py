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
