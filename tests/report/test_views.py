"""The report's derived views: suites named and placed in time, events once and counted per suite,
every checklist item counted, notes cut at a word."""

from harness.checks.verdict import Verdict
from harness.report.events import event_summary, unique_events
from harness.report.suites import BEFORE_SUITES, SuiteSpans, item_statuses, status_counts, suite_label
from harness.report.text import fit_words


def _verdict(item: str, status: str, test: str, start: float | None = None) -> Verdict:
    evidence = {"machine": {"windows": [{"start": start, "end": start + 5}]}} if start is not None else {}
    return Verdict(item=item, title=item, status=status, reason="r", test=test, evidence=evidence)


def test_suite_labels_and_spans_place_each_time_in_its_suite():
    assert suite_label("suites/test_nic_flap.py::test_nic_flap_loses_nothing") == "test_nic_flap.py"
    assert suite_label("suites/test_x.py::test_y[decode-0]") == "test_x.py[decode-0]"
    spans = SuiteSpans.of([_verdict("ecc", "pass", "suites/test_a.py::t", 100.0),
                           _verdict("nothing-lost", "pass", "suites/test_a.py::t", 98.0),
                           _verdict("nic-flap", "pass", "suites/test_b.py::t", 150.0)],
                          tests=[{"nodeid": "suites/test_c.py::t", "started": 200.0}])
    assert [spans.at(t) for t in (90.0, 98.0, 149.9, 150.0, 250.0)] == \
        [BEFORE_SUITES, "test_a.py", "test_a.py", "test_b.py", "test_c.py"]
    assert spans.span("test_b.py", 300.0) == (150.0, 200.0) and spans.span("test_c.py", 300.0) == (200.0, 300.0)


def test_events_once_and_counted_per_suite_with_bulk_rates():
    ecc = [{"t": 100.0 + i, "source": "engine", "kind": "fault_state", "detail": f"seq={i}, worker=decode-1"}
           for i in range(4)]
    transfers = [{"t": 150.0 + i / 10, "source": "engine", "kind": "kv_transfer", "detail": f"seq={10 + i}"}
                 for i in range(30)]
    # the second suite recorded the first's events again; a restarted router reuses seq 0 later
    timeline = ecc + transfers + ecc + [{"t": 160.0, "source": "engine", "kind": "fault_state", "detail": "seq=0"}]
    assert len(unique_events(timeline)) == 35
    spans = SuiteSpans({"test_a.py": 99.0, "test_b.py": 149.0})
    summary = event_summary(timeline, spans, run_end=169.0)
    rows = {k["kind"]: k for k in summary["kinds"]}
    assert summary["suites"] == ["test_a.py", "test_b.py"] and summary["total"] == 35
    assert rows["fault_state"]["per_suite"] == {"test_a.py": 4, "test_b.py": 1}
    assert rows["kv_transfer"]["bulk"] and rows["kv_transfer"]["events"] == []
    assert rows["kv_transfer"]["rates"] == {"test_b.py": 30 / 20.0}  # test_b ran from 149 to 169 s


def test_counts_cover_every_checklist_item():
    verdicts = [_verdict("ecc", "pass", "a"), _verdict("nothing-lost", "pass", "a"),
                _verdict("nothing-lost", "fail", "b"), _verdict("6.1.1", "inconclusive", "c"),
                _verdict("6.1.4", "error", "d"), _verdict("6.1.2", "inconclusive", "e"), _verdict("6.1.2", "pass", "f")]
    statuses = item_statuses(verdicts, ["6.1.1", "6.1.2", "6.1.3", "6.1.4", "ecc", "nothing-lost"])
    assert statuses == {"6.1.1": "inconclusive", "6.1.2": "pass", "6.1.3": "not run", "6.1.4": "error",
                        "ecc": "pass", "nothing-lost": "fail"}
    assert status_counts(statuses) == {"pass": 2, "fail": 1, "inconclusive": 1, "error": 1, "not run": 1}


def test_notes_are_cut_at_a_word_never_inside_an_id():
    note = "cmpl-730a10754c08447282fcc9ac2b7ba631: completed token-exact; cmpl-f48320cd117747e0bbb7f9fd8f456307: done"
    short = fit_words(note, 80)
    assert len(short) <= 80 and short.endswith(" …") and "cmpl-f4832" not in short
    assert fit_words("short", 80) == "short"
