import xml.etree.ElementTree as ET

from harness.report import write_reports
from harness.report.jsonout import read_json


def test_writes_all_three_files_and_latest_link(tmp_path, sample_result):
    run_dir = write_reports(sample_result, tmp_path)
    assert run_dir == tmp_path / sample_result.run_id
    assert {p.name for p in run_dir.iterdir()} == {"report.html", "results.json", "junit.xml"}
    latest = tmp_path / "latest"
    assert latest.is_symlink() and latest.resolve() == run_dir.resolve()
    sample_result.run_id = "20270115T090000Z-2"
    second = write_reports(sample_result, tmp_path)
    assert latest.resolve() == second.resolve()  # repointed, not duplicated
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["20270115T080000Z-1", "20270115T090000Z-2",
                                                                  "latest"])


def test_json_round_trips(tmp_path, sample_result):
    run_dir = write_reports(sample_result, tmp_path)
    again = read_json(run_dir / "results.json")
    assert again.verdicts == sample_result.verdicts
    assert again.exit_code == 1 and again.exit_meaning == "not conformant"
    assert again.latency == sample_result.latency


def test_junit_has_one_case_per_verdict_with_matching_outcome(tmp_path, sample_result):
    sample_result.harness_errors.append("exception outside a verdict: boom")
    run_dir = write_reports(sample_result, tmp_path)
    suite = ET.parse(run_dir / "junit.xml").getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("4", "1", "1", "1")
    cases = {c.get("classname"): c for c in suite.findall("testcase")}
    assert cases["checklist.6.1.4"].find("failure").get("message").startswith("p100 rescheduling time was 3.6 s")
    assert cases["checklist.6.1.1"].find("skipped") is not None
    assert len(cases["checklist.nothing-lost"]) == 1 and cases["checklist.nothing-lost"].find("system-out") is not None
    assert "boom" in cases["harness"].find("error").text


def test_html_is_self_contained_and_escapes(tmp_path, sample_result):
    sample_result.timeline.append({"t": sample_result.started + 30, "source": "router", "kind": "x",
                                   "detail": "<script>alert(1)</script>"})
    html = (write_reports(sample_result, tmp_path) / "report.html").read_text()
    assert "<script" not in html and "&lt;script&gt;" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # nothing to fetch
    assert html.count('class="fault-window"') == 2  # one shaded window in each of two charts
    assert 'class="sample bad"' in html and 'class="sample ok"' in html
    # the headline figure and each measurement show their interval beside them
    assert '3.6 s <span class="interval">[3.55-3.6, bounds]</span>' in html
    assert "3.6 s [3.55-3.6, bounds]</td>" in html


def test_the_terminal_summary_shows_the_interval_beside_the_figure(sample_result):
    from rich.console import Console

    from harness.report.terminal import print_summary
    console = Console(record=True, width=300)
    print_summary(console, sample_result, None)
    assert "3.6 s [3.55-3.6, bounds]" in console.export_text()


def test_a_128_worker_inventory_is_summed_up_and_folded(tmp_path, sample_result):
    """Dynamo's 'many' cluster: the report states the counts per role and folds the full cluster file."""
    sample_result.cluster = {"name": "dynamo-many", "kind": "external", "engine": "dynamo",
                             "workers": [{"name": f"mocker-{i:03d}", "role": "aggregated"} for i in range(128)]
                             + [{"name": "p", "role": "prefill"}]}
    html = (write_reports(sample_result, tmp_path) / "report.html").read_text()
    assert "129 workers in the inventory (128 aggregated, 1 prefill)" in html
    assert '<details id="cluster-details">' in html   # folded: not open
    small = sample_result
    small.cluster = {"name": "local", "kind": "bundled", "workers": [{"name": "d0", "role": "decode"}]}
    assert '<details id="cluster-details" open>' in (write_reports(small, tmp_path / "b") / "report.html").read_text()


def test_junit_case_names_are_unique_when_one_item_is_recorded_by_several_suites(tmp_path, sample_result):
    """Issue 37: the main job records nothing-lost once per suite; with one name and class CI viewers
    merged them. Each case of an item recorded more than once is named with its suite's file (its
    test too when one file records it twice). Planted defect: the title alone as the name (the old
    junit): three cases named alike."""
    from dataclasses import replace

    lost = next(v for v in sample_result.verdicts if v.item == "nothing-lost")
    sample_result.verdicts += [replace(lost, test="suites/test_62_slo.py::test_ttft"),
                               replace(lost, test="suites/test_item4_reschedule.py::test_a"),
                               replace(lost, test="suites/test_item4_reschedule.py::test_b")]
    suite = ET.parse(write_reports(sample_result, tmp_path) / "junit.xml").getroot().find("testsuite")
    pairs = [(c.get("classname"), c.get("name")) for c in suite.findall("testcase")]
    assert len(pairs) == len(set(pairs)), pairs
    names = {n for c, n in pairs if c == "checklist.nothing-lost"}
    assert "Nothing is lost [test_62_slo.py]" in names and "Nothing is lost [test_item4_reschedule.py]" in names
    assert "Nothing is lost [test_item4_reschedule.py::test_b]" in names
    assert ("checklist.6.1.4", sample_result.verdicts[0].title) in pairs   # an item recorded once keeps its title


def test_the_end_table_has_one_line_per_verdict_without_the_figure_again():
    """Issue 37: the end table's reason column wrapped each row over 2-4 lines and repeated the figure
    of its own column. On a recorded main job beside a CPU burner (15 verdicts, long starved
    reasons), at 160 and 100 columns: one line per verdict, the 6.1.4 row's reason names what was
    measured and not its figure, and every line fits the width. Planted defect: the old table
    (reason column folded, the whole reason): rows over several lines."""
    from pathlib import Path

    from rich.console import Console

    from harness.report.terminal import print_summary

    result = read_json(Path(__file__).parent / "data" / "burner_main_job_results.json")
    for width in (160, 100):
        console = Console(record=True, width=width)
        print_summary(console, result, None)
        lines = console.export_text().splitlines()
        body = lines[lines.index(next(line for line in lines if line.startswith("┡"))) + 1:]
        body = body[:body.index(next(line for line in body if line.startswith("└")))]
        assert len(body) == len(result.verdicts), "\n".join(body)
        assert all(len(line) <= width and line.endswith("│") for line in body), "\n".join(body)   # whole rows
        row = next(line for line in body if line.startswith("│ 6.1.4"))
        assert "p100 resch" in row and row.count("0.8884") == 1, row   # the figure once: its own column
