"""Structured reasons (issue 33 item 11): a verdict's why is codes plus fields, rendered once."""

import ast
import json
from dataclasses import replace
from pathlib import Path

import pytest

from harness.checklists import Checklist, Threshold
from harness.checks import reasons
from harness.checks.extend import measure_until_decided
from harness.checks.machine import gate
from harness.checks.verdict import Measurement, Status, Verdict, inconclusive, judge
from harness.errors import ConfigError
from harness.report.terminal import short_reason, verdict_line
from harness.stats.intervals import Interval

ROOT = Path(__file__).resolve().parents[2]
STARVED = {"samples": 10, "psi_some_pct": 100.0, "steal_pct": 0.0, "timer_lag_p99_ms": 900.0}


def _ttft(value, lo, hi, n=600):
    t = Threshold(item="6.2.ttft", key="ttft_p99_ms", value=500.0, op="<", unit="ms", origin="test")
    return Measurement(t, value, "client TTFT p99", Interval(lo, hi, 0.95, "order statistics", n, noun="requests"))


@pytest.fixture
def ttft_item():
    return Checklist.load().item("6.2.ttft")


def test_every_code_renders_from_its_fields_and_refuses_a_missing_one():
    """Planted: a code whose rendering reads a field the cause does not name (KeyError at report
    time instead of a ConfigError where the verdict is made)."""
    samples = {
        "met": dict(key="k", what="p99", figure="1 s", threshold="<= 3 s", more_met=0),
        "missed": dict(key="k", what="p99", figure="4 s", threshold="<= 3 s", why="users wait"),
        "straddles": dict(key="k", what="p99", interval="2-4 s", threshold="<= 3 s", more_to_decide=40,
                          noun="faults", resolution_bound=False),
        "not_measured": dict(key="k", what="p99", threshold="<= 3 s"),
        "thin": dict(key="k", because="one fault", threshold="<= 3 s"),
        "undecided": dict(because="one window"),
        "capability": dict(missing=[[{"capability": "admin_api", "why_not": None, "provided_by": "endpoints.admin"}]]),
        "ended_cleanly": dict(total=3, verified=3, rejected=0, failed_clear=0),
        "faults_not_recovered": dict(failed=1, first="#2 kill d0", why="never back", summary="6 faults",
                                     item_why="users wait"),
        "faults_recovered": dict(summary="6 faults", reschedule_limit_s=3.0, rejoin_limit_s=20.0, not_injected=0),
        "windows_missed": dict(failed=1, windows=4, where="window 2", first_reason="p99 600 ms"),
        "windows_met": dict(windows=4, window_s=60.0, ttft_p99_ms=100, tpot_p99_ms=10, requests=900),
        **{code: dict(text=f"{code} words") for code in ("dry_run", "not_judged", "not_made", "skipped", "error",
                                                          "summary", "recorded")},
    }
    assert set(samples) == set(reasons.HEADS), "a head code without a rendering test"
    for code, fields in samples.items():
        text = reasons.render([reasons.cause(code, **fields)])
        assert text and "\n" not in text and "{" not in text, (code, text)
        refused = 0
        for name in fields:   # a rendered field left out is refused where the cause is made
            try:
                reasons.cause(code, **{k: v for k, v in fields.items() if k != name})
            except ConfigError as exc:
                refused += "lacks the field" in str(exc)
        assert refused >= 1, code
    with pytest.raises(ConfigError, match="unknown reason code"):
        reasons.cause("looks_fine", text="x")
    with pytest.raises(ConfigError, match="cannot follow the head"):
        reasons.check([reasons.cause("summary", text="a"), reasons.cause("summary", text="b")])


def test_judge_says_each_outcome_as_a_code_with_its_fields(ttft_item):
    """Planted: judge() wording a straddle (or a missing measurement) as another outcome: the
    extension loop and the terminal read the code."""
    passed = judge(ttft_item, [_ttft(300.0, 280.0, 320.0)])
    failed = judge(ttft_item, [_ttft(700.0, 650.0, 760.0)])
    straddling = judge(ttft_item, [_ttft(495.0, 450.0, 560.0)])
    missing = judge(ttft_item, [_ttft(None, None, None)])
    thin = judge(ttft_item, [_ttft(300.0, 280.0, 320.0)], inconclusive_because="only 3 requests")
    assert [v.cause["code"] for v in (passed, failed, straddling, missing, thin)] == \
        ["met", "missed", "straddles", "not_measured", "thin"]
    assert [v.status for v in (passed, failed, straddling)] == [Status.PASS, Status.FAIL, Status.INCONCLUSIVE]
    assert failed.cause["why"] == ttft_item.why and failed.cause["threshold"] == "< 500 ms"
    assert straddling.cause["noun"] == "requests" and straddling.cause["key"] == "ttft_p99_ms"
    for v in (passed, failed, straddling, missing, thin):
        assert v.reason == reasons.render(v.causes)


def test_the_reason_is_never_written_by_hand(ttft_item):
    """Planted: dropping Verdict.__setattr__'s guard (or replace() accepting any text): a suite's
    ``verdict.reason += ...`` would make the terminal, report and JSON disagree with the causes."""
    v = judge(ttft_item, [_ttft(300.0, 280.0, 320.0)])
    with pytest.raises(AttributeError, match="rendered from its causes"):
        v.reason += " and more"
    with pytest.raises(AttributeError):
        v.causes = ()
    with pytest.raises(ConfigError, match="not what its causes say"):
        replace(v, reason="all good")
    assert replace(v, evidence={"x": 1}).reason == v.reason   # other fields change freely
    with pytest.raises(ConfigError, match="status fail but its causes say pass"):
        replace(v, status=Status.FAIL)   # the status is the one its causes say: judge's, or the gate's
    v.add("note", text="3 workers")
    assert v.reason.endswith("; 3 workers") and v.layer("note") == {"code": "note", "text": "3 workers"}


def test_an_item_not_measured_says_which_kind_of_not(ttft_item):
    """Planted: inconclusive() accepting a judged outcome's code (a 'met' head on an inconclusive
    verdict: the scorecard and compare would read it as measured)."""
    checklist = Checklist.load()
    v = inconclusive(checklist, "6.2.ttft", "dry run:   no load was sent", code="dry_run")
    assert v.cause == {"code": "dry_run", "text": "dry run: no load was sent"} and v.status is Status.INCONCLUSIVE
    with pytest.raises(ConfigError, match="not one for an item not measured"):
        inconclusive(checklist, "6.2.ttft", "fine", code="met")


def test_no_harness_code_builds_a_verdict_from_prose():
    """Planted: a ``Verdict(..., reason=...)`` or a ``.reason =`` / ``.reason +=`` anywhere in
    harness/ (the one path is judge()/inconclusive()/causes, then Verdict.add)."""
    offenders = []
    for path in (ROOT / "harness").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Verdict" \
                    and any(k.arg == "reason" for k in node.keywords):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} Verdict(reason=...)")
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "reason" and getattr(t.value, "id", "") != "self":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .reason assigned")
    assert offenders == []


def test_the_extension_and_the_machine_gate_add_layers_over_the_head(ttft_item):
    """Planted: a layer that replaces the head (the report could no longer say what straddled once
    the machine gate had spoken), or an extension that forgets to say how many rounds it took."""
    current = [(495.0, 450.0, 560.0)]

    def judge_all():
        return [judge(ttft_item, [_ttft(*current[0])])]

    def more(wanted):   # one more round of requests, still straddling; then the budget is spent
        if current[0][1] == 470.0:
            return False
        current[0] = (497.0, 470.0, 530.0)
        return True

    (v,) = measure_until_decided(judge_all, more, budget="at most 1200 requests")
    assert v.cause["code"] == "straddles" and v.layer("extended")["rounds"] == 1
    gated = gate(v, [STARVED])
    assert [c["code"] for c in gated.causes] == ["straddles", "extended", "machine"]
    assert gated.layer("machine")["action"] == "noted"
    failed = gate(judge(ttft_item, [_ttft(700.0, 650.0, 760.0)]), [STARVED])
    assert failed.status is Status.INCONCLUSIVE and failed.cause["code"] == "missed"
    assert failed.layer("machine")["would"] == "would have failed"


def test_the_end_table_renders_the_short_form_from_the_causes(ttft_item):
    """Planted: the end table cutting the long reason (a capability's 600-1,500 characters, a
    starved window's figures) instead of rendering its short form."""
    failed = gate(judge(ttft_item, [_ttft(700.0, 650.0, 760.0)]), [STARVED])
    assert short_reason(failed) == "test machine CPU-starved (would have failed): client TTFT p99"
    why = "no `ssh:` and `fabric:` settings on two or more hosts (0 host(s) with both) " * 8
    cap = Verdict(item="6.1.1", title="t", status=Status.INCONCLUSIVE, causes=(reasons.cause(
        "capability", missing=[[{"capability": "emulated_fabric", "why_not": why, "provided_by": "hosts[].fabric"}]]),))
    assert len(cap.reason) > 600
    assert short_reason(cap) == "not judged on this cluster: needs emulated_fabric"
    line = verdict_line(cap).plain   # as recorded: one line with the fix, the why in the report
    assert line.endswith("6.1.1 not judged on this cluster: needs emulated_fabric; fix: hosts[].fabric") and len(line) < 120


def test_causes_round_trip_and_an_older_results_file_reads_back(ttft_item):
    """Planted: from_dict dropping the causes (the report re-rendered from a results.json would
    lose the code), or refusing a results.json written before causes existed."""
    v = gate(judge(ttft_item, [_ttft(700.0, 650.0, 760.0)]), [STARVED])
    again = Verdict.from_dict(json.loads(json.dumps(v.to_dict())))
    assert again == v and again.layer("machine")["action"] == "gated"
    old = {k: val for k, val in v.to_dict().items() if k != "causes"}
    read = Verdict.from_dict(old)
    assert read.reason == v.reason and read.cause == {"code": "summary", "text": v.reason}
