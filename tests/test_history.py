"""`python -m harness history` (harness/history.py): every run of a reports folder, newest first, as
runs write them (reports/<run id>/results.json and a `latest` link). Each test names the planted
defect it fails on."""

from __future__ import annotations

import json
from pathlib import Path

from harness.cli import main
from harness.plugin_state import HarnessOptions


def _run(reports: Path, run_id: str, started: float, *, cluster: str = "local", label: str | None = None,
         verdicts: list[tuple[str, str]] = (), exit_code: int = 0, regression: dict | None = None) -> None:
    folder = reports / run_id
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({
        "run_id": run_id, "started": started, "exit_code": exit_code, "cluster": {"name": cluster},
        "options": {"label": label}, "environment": {"git_commit": f"c{run_id[-1]}"},
        "verdicts": [{"item": i, "status": s} for i, s in verdicts], **({"regression": regression} if regression else {})}))


def _reports(tmp_path: Path) -> Path:
    reports = tmp_path / "reports"
    # folder names out of time order: the start time decides, not the name
    _run(reports, "run-b", 1_800_000_000.0, verdicts=[("6.2.ttft", "pass"), ("nothing-lost", "pass"),
                                                      ("nothing-lost", "fail"), ("nothing-lost", "inconclusive")],
         exit_code=1)
    _run(reports, "run-a", 1_800_000_100.0, label="vllm 0.9 rc1", verdicts=[("6.2.ttft", "pass")],
         regression={"exit_code": 2})
    _run(reports, "run-c", 1_700_000_000.0, verdicts=[("6.1.4", "inconclusive")], exit_code=2)
    _run(reports, "run-d", 1_800_000_050.0, cluster="other")
    (reports / "latest").symlink_to("run-a")
    (reports / "run-e").mkdir()
    (reports / "run-e" / "results.json").write_text('{"run_id": "run-e", "verd')   # a run killed mid-write
    return reports


def test_history_lists_a_clusters_runs_newest_first_with_exit_codes_and_each_items_worst_status(tmp_path, capsys):
    """Planted defects: oldest first (or by folder name), the `latest` link listed as a second run,
    an item's last verdict shown instead of its worst (nothing-lost pass, fail, inconclusive reads
    inconclusive), the commit shown where the run has a label, the --baseline comparison's code
    left out, the cluster filter ignored (the other cluster's run listed)."""
    assert main(["history", "--cluster", "local", "--reports", str(_reports(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    runs = [next(w for w in line.split() if w.startswith("run-")) for line in lines[1:]]
    assert runs == ["run-a", "run-b", "run-c", "run-e"], lines
    a, b, c = lines[1], lines[2], lines[3]
    assert "vllm 0.9 rc1" in a and "ca" not in a.split() and "exit 2" in a
    assert " 1 " in b and "nothing-lost fail" in b and "6.2.ttft pass" in b and " cb " in b
    assert "6.1.4 inconclusive" in c and "2023-11-14 22:13:20" in c


def test_an_unreadable_results_json_is_listed_and_an_unknown_cluster_names_the_known_ones(tmp_path, capsys):
    """Planted defects: a results.json that cannot be parsed skipped silently (or crashing the
    listing), an unknown cluster printing an empty table with exit 0 instead of naming the clusters
    there (exit 3), --json not written."""
    reports = _reports(tmp_path)
    out = tmp_path / "h.json"
    assert main(["history", "--reports", str(reports), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "run-e" in text and "unreadable results.json" in text and "run-d" in text
    listed = json.loads(out.read_text())
    assert [e["run_id"] for e in listed][:2] == ["run-a", "run-d"] and listed[0]["label"] == "vllm 0.9 rc1"
    assert main(["history", "--cluster", "nosuch", "--reports", str(reports)]) == 3
    err = capsys.readouterr().err
    assert "no run of cluster 'nosuch'" in err and "use one of local, other" in err


def test_last_keeps_the_newest_runs_and_the_run_records_its_label(tmp_path, capsys):
    """Planted defects: --last keeping the oldest N; the pytest --label not recorded in the run's
    options (history could then only show the commit)."""
    assert main(["history", "--cluster", "local", "--reports", str(_reports(tmp_path)), "--last", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "run-a" in lines[1]
    options = HarnessOptions("local", tmp_path, False, 4, None, None, 3, 0, label="build 42").to_dict()
    assert options["label"] == "build 42"


def test_a_figure_column_shows_each_runs_measurement_and_interval_newest_first(tmp_path, capsys):
    """Planted defects: the column taking another measurement of the item (ttft_p50 for ttft_p99) or
    dropping the interval, a run that did not measure it shown with a number, an unknown figure
    printing an empty column (exit 0) instead of naming the measured ones (exit 3)."""
    reports = tmp_path / "reports"
    for i, (p99, started) in enumerate(((410.0, 1.0e9), (455.0, 3.0e9), (None, 2.0e9))):
        folder = reports / f"run-{i}"
        folder.mkdir(parents=True)
        verdicts = [] if p99 is None else [{"item": "6.2.ttft", "status": "pass", "evidence": {"measurements": [
            {"key": "ttft_p50_ms", "value": 100.0 + i, "interval": {"lo": 90.0, "hi": 110.0}},
            {"key": "ttft_p99_ms", "value": p99, "interval": {"lo": p99 - 30, "hi": p99 + 40}}]}}]
        (folder / "results.json").write_text(json.dumps({"run_id": folder.name, "started": started, "exit_code": 0,
                                                         "cluster": {"name": "local"}, "verdicts": verdicts}))
    assert main(["history", "--reports", str(reports), "--figure", "6.2.ttft.ttft_p99_ms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "6.2.ttft.ttft_p99_ms" in lines[0]
    assert "455 [425-495]" in lines[1] and "run-1" in lines[1]
    col = lines[0].index("6.2.ttft.ttft_p99_ms")
    assert "run-2" in lines[2] and lines[2][col:col + len("6.2.ttft.ttft_p99_ms")].strip() == "-"
    assert "410 [380-450]" in lines[3]
    assert main(["history", "--reports", str(reports), "--figure", "6.2.ttft.ttft_p98_ms"]) == 3
    assert "use one of 6.2.ttft.ttft_p50_ms, 6.2.ttft.ttft_p99_ms" in capsys.readouterr().err
