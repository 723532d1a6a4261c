"""bench/error_runs.py, issue 33's live acceptance: the rules it judges the ledger by, and what it reads
from a run's reports. No cluster here (the runs themselves are the benchmark)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("error_runs", ROOT / "bench" / "error_runs.py")
error_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(error_runs)


def _aa(exit_code: int = 0, **statuses: str) -> dict:
    return {"mode": "aa", "cluster": "local", "commit": "abc", "exit": exit_code,
            "statuses": {"6.2.ttft": "pass", "ecc": "pass", **statuses}}


def test_aa_holds_only_with_enough_runs_no_fail_no_usage_or_revert_exit_and_few_inconclusives():
    """Planted defects: an exit 3 (usage) or 4 (revert failed) accepted, a fail accepted, the
    inconclusive allowance off by one (3 of 20 accepted), fewer runs than wanted called met."""
    ok, _ = error_runs.judge_aa([_aa() for _ in range(20)])
    assert ok
    assert not error_runs.judge_aa([_aa() for _ in range(19)])[0]          # not yet the acceptance
    for bad in (_aa(3), _aa(4), _aa(1), _aa(0, ecc="fail"), _aa(0, ecc="error")):
        assert not error_runs.judge_aa([_aa() for _ in range(19)] + [bad])[0], bad
    two = [_aa(2, ecc="inconclusive")] * 2 + [_aa()] * 18
    three = [_aa(2, ecc="inconclusive")] * 3 + [_aa()] * 17
    assert error_runs.judge_aa(two)[0] and not error_runs.judge_aa(three)[0]


def test_planted_holds_only_when_every_run_of_every_defect_fails_its_own_item():
    """Planted defects: a pass or an inconclusive of the planted item counted as caught, another item's
    fail counted for it, a defect with no runs called met."""
    def run(cluster: str, **statuses: str) -> dict:
        return {"mode": "planted", "cluster": cluster, "commit": "abc", "exit": 1, "statuses": statuses}

    every = [run(c, **{item: "fail"}) for c, (item, _) in error_runs.PLANTED.items() for _ in range(10)]
    assert error_runs.judge_planted(every)[0]
    for spoil in ("pass", "inconclusive"):
        runs = every[:-1] + [run("local-leaky-process@11m", **{"soak.leaks": spoil})]
        ok, lines = error_runs.judge_planted(runs)
        assert not ok and any(spoil in line for line in lines if "@11m" in line), lines
    other = every[1:] + [run("local-fabric-sabotaged", **{"6.1.5": "pass", "nothing-lost": "fail"})]
    assert not error_runs.judge_planted(other)[0]
    assert not error_runs.judge_planted([r for r in every if r["cluster"] != "local-no-ecc"])[0]


def test_a_runs_statuses_are_each_items_worst_and_machine_gated_items_are_named(tmp_path):
    """Read from the results.json files a run wrote (one per suite process). Planted defects: the last
    file's status winning over a worse earlier one, the machine gate's evidence not read."""
    for k, verdicts in enumerate([
            [{"item": "nothing-lost", "status": "fail"}, {"item": "6.2.ttft", "status": "pass"}],
            [{"item": "nothing-lost", "status": "pass"},
             {"item": "6.1.2", "status": "inconclusive", "evidence": {"machine": {"gated": {"status": "fail"}}}}]]):
        (tmp_path / f"r{k}").mkdir()
        (tmp_path / f"r{k}" / "results.json").write_text(json.dumps({"verdicts": verdicts}))
    statuses, gated = error_runs.statuses_of(tmp_path)
    assert statuses == {"nothing-lost": "fail", "6.2.ttft": "pass", "6.1.2": "inconclusive"}
    assert gated == ["6.1.2"]


def test_the_reasons_of_every_verdict_that_did_not_pass_are_kept_by_item(tmp_path):
    """What the ledger keeps of a run whose report is gone. Planted defects: passes recorded too, a
    later file's reasons replacing an earlier one's, a reason kept uncut."""
    for k, verdicts in enumerate([
            [{"item": "nic-flap", "status": "inconclusive", "reason": "straddles " + "x" * 500},
             {"item": "6.2.ttft", "status": "pass", "reason": "met"}],
            [{"item": "nic-flap", "status": "fail", "reason": "never back"}]]):
        (tmp_path / f"r{k}").mkdir()
        (tmp_path / f"r{k}" / "results.json").write_text(json.dumps({"verdicts": verdicts}))
    reasons = error_runs.reasons_of(tmp_path)
    assert list(reasons) == ["nic-flap"]
    assert reasons["nic-flap"][0].startswith("inconclusive: straddles") and len(reasons["nic-flap"][0]) == 14 + 300
    assert reasons["nic-flap"][1] == "fail: never back"


def test_the_ledger_keeps_every_line_and_tally_counts_the_chosen_commits(tmp_path, capsys):
    """Planted defects: record() overwriting the ledger instead of appending, --commits ignored."""
    ledger = tmp_path / "runs.jsonl"
    for c in ("old", "new", "new"):
        error_runs.record(dict(_aa(), commit=c), ledger)
    assert [r["commit"] for r in error_runs.read(ledger)] == ["old", "new", "new"]
    error_runs.tally(ledger, ["new"], aa_want=2, planted_want=0)
    out = capsys.readouterr().out
    assert "2 run(s) counted" in out and "A/A met" in out and "'old'" not in out
