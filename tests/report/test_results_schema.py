"""results.json is documented as a JSON Schema (harness/report/results.schema.json, shipped in the
package): a written file validates against it, and every top-level key it writes is documented."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.report import write_reports

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "harness" / "report" / "results.schema.json").read_text())
_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "null": type(None),
          "boolean": bool}


def _check(value, schema, where="$"):
    """The subset of JSON Schema the file uses: $ref, type, enum, const, required, properties, items."""
    if "$ref" in schema:
        schema = SCHEMA["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    problems = []
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, _TYPES[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        if not ok:
            return [f"{where}: {value!r} is not {types}"]
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        problems.append(f"{where}: {value!r} != {schema['const']!r}")
    if isinstance(value, dict):
        problems += [f"{where}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                problems += _check(value[key], sub, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += _check(item, schema["items"], f"{where}[{i}]")
    return problems


def test_written_results_validate_and_every_key_is_documented(tmp_path, sample_result):
    sample_result.cluster_samples = [{"t": sample_result.started + 1, "kv_usage": 0.4, "degradation_level": 1.0,
                                      "requests_in_engine": 3.0}]
    data = json.loads((write_reports(sample_result, tmp_path) / "results.json").read_text())
    assert _check(data, SCHEMA) == []
    assert set(data) == set(SCHEMA["properties"])  # a new field needs its line in the schema (and the doc)
    data["verdicts"][0]["status"] = "maybe"
    assert _check(data, SCHEMA) == ["$.verdicts[0].status: 'maybe' not in ['pass', 'fail', 'inconclusive', 'error']"]


def test_schema_is_documented_and_shipped():
    doc = (ROOT / "docs" / "results-schema.md").read_text()
    for key in SCHEMA["properties"]:
        assert f"`{key}`" in doc, f"docs/results-schema.md does not describe {key}"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"harness.report" = ["*.j2", "*.json"]' in pyproject


@pytest.mark.slow  # a pytest subprocess
def test_junit_xml_option_writes_the_conformance_junit_at_a_stable_path(tmp_path):
    (tmp_path / "test_one.py").write_text(
        "import pytest\nfrom harness.checks.verdict import Verdict\npytestmark = pytest.mark.conformance\n"
        "def test_one(conformance):\n"
        "    conformance.record(Verdict(item='6.1.1', title='KV bandwidth', status='inconclusive', reason='r'))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "test_one.py", "-p", "no:cacheprovider", "--live=off",
                           "--junit-xml=ci/conformance.xml", "--report-dir=out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:]
    suite = ET.parse(tmp_path / "ci" / "conformance.xml").getroot().find("testsuite")
    assert [c.get("classname") for c in suite.findall("testcase")] == ["checklist.6.1.1"]  # not pytest's own file
    assert (tmp_path / "out" / "latest" / "junit.xml").is_file()  # the run folder keeps its copy
