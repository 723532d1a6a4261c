"""`python -m harness schema --checklist` prints the checklist's JSON Schema; `schema --check
--checklist=PATH` validates a checklist file and the cluster files' overrides against it. Real
subprocess calls, as a user runs them."""

import json
import subprocess
import sys

import jsonschema
import yaml

from harness.checklists import DEFAULT_CHECKLIST

ONE_ITEM = """\
version: 1
items:
  "6.1.4":
    title: Rescheduling within 3 s
    source: the article's words
    why: users wait
    thresholds:
      reschedule_p100_s: {value: 3.0, op: "<=", unit: s}
"""


def harness(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "schema", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_the_printed_schema_accepts_the_shipped_checklist_and_rejects_a_bad_op():
    proc = harness("--checklist")
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema["title"] == "PD conformance harness checklist"
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    shipped = yaml.safe_load(DEFAULT_CHECKLIST.read_text())
    assert list(validator.iter_errors(shipped)) == []
    shipped["items"]["6.1.4"]["thresholds"]["reschedule_p100_s"]["op"] = "=<"
    assert [list(e.absolute_path) for e in validator.iter_errors(shipped)] == [
        ["items", "6.1.4", "thresholds", "reschedule_p100_s", "op"]]
    # the fix a validation error names is in the schema, as in the cluster file's
    entry = schema["$defs"]["ThresholdEntry"]["properties"]["op"]
    assert entry["x-fix"] == "use one of <, <=, >, >=, =="
    assert json.loads(harness().stdout)["title"] != schema["title"]  # without --checklist: the cluster file's


def test_check_validates_a_checklist_file_naming_field_and_fix(tmp_path):
    bad = tmp_path / "checklist.yaml"
    bad.write_text(ONE_ITEM.replace('op: "<="', 'op: "=<"'))
    proc = harness("--check", f"--checklist={bad}")
    assert proc.returncode == 3
    assert f"{bad}: field `items.6.1.4.thresholds.reschedule_p100_s.op`" in proc.stderr
    assert "fix: use one of <, <=, >, >=, ==" in proc.stderr
    shipped = harness("--check", "--checklist")
    assert shipped.returncode == 0, shipped.stderr
    assert "checklists/section6.yaml: ok (checklist, 13 items" in shipped.stdout


def test_check_judges_cluster_overrides_against_the_given_checklist(tmp_path):
    checklist = tmp_path / "checklist.yaml"
    checklist.write_text(ONE_ITEM)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("kind: external\nendpoints: {api: 'http://127.0.0.1:9/v1'}\n"
                       "thresholds: {'6.1.4': {reschedule_p100_s: 5}}\n")
    proc = harness("--check", str(cluster), f"--checklist={checklist}")
    assert proc.returncode == 0, proc.stderr
    assert f"{checklist}: ok (checklist, 1 items, 1 thresholds)" in proc.stdout
    assert f"{cluster}: ok (external" in proc.stdout
    # an item the shipped checklist has and this one lacks: the override is an error against it
    cluster.write_text("kind: external\nendpoints: {api: 'http://127.0.0.1:9/v1'}\n"
                       "thresholds: {'6.2.ttft': {ttft_p50_ms: 150}}\n")
    assert harness("--check", str(cluster)).returncode == 0
    proc = harness("--check", str(cluster), f"--checklist={checklist}")
    assert proc.returncode == 3
    assert f"{cluster}: field `thresholds.6.2.ttft`: unknown checklist item" in proc.stderr
    assert "1 of 1 cluster file(s) bad" in proc.stderr
