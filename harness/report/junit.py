"""``junit.xml``: one test case per checklist verdict, so CI dashboards show conformance items.

pass -> passed, fail -> <failure>, inconclusive -> <skipped> (nothing proven either way),
error -> <error>. Harness errors and failed reverts are extra <error> cases of their own.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from harness.checks.verdict import Status
from harness.report.result import RunResult


def junit_tree(result: RunResult) -> ET.ElementTree:
    suite = ET.Element("testsuite", name=f"conformance[{result.cluster.get('name', '?')}]",
                       timestamp=_iso(result.started))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for v, name in zip(result.verdicts, case_names(result.verdicts)):
        case = ET.SubElement(suite, "testcase", classname=f"checklist.{v.item}", name=name)
        if v.test:
            case.set("file", v.test.split("::")[0])
        counts["tests"] += 1
        detail = json.dumps({"measured": v.measured, "interval": v.interval, "threshold": v.threshold, "op": v.op,
                             "unit": v.unit, "evidence": v.evidence}, indent=1, default=str)
        if v.status is Status.FAIL:
            counts["failures"] += 1
            ET.SubElement(case, "failure", message=v.reason, type="NotConformant").text = detail
        elif v.status is Status.ERROR:
            counts["errors"] += 1
            ET.SubElement(case, "error", message=v.reason, type="CheckError").text = detail
        elif v.status is Status.INCONCLUSIVE:
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=v.reason)
        else:
            ET.SubElement(case, "system-out").text = f"{v.reason}\n{detail}"
    for f in (result.regression or {}).get("figures") or ():   # --baseline: one case per compared figure
        case = ET.SubElement(suite, "testcase", classname=f"regression.{f['item']}", name=f["figure"])
        counts["tests"] += 1
        if f["status"] == "regressed":
            counts["failures"] += 1
            ET.SubElement(case, "failure", message=f["reason"], type="Regressed").text = json.dumps(f, default=str)
        elif f["status"] == "inconclusive":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=f["reason"])
        else:
            ET.SubElement(case, "system-out").text = f["reason"]
    for kind, messages in (("HarnessError", result.harness_errors), ("RevertError", result.revert_failures)):
        for i, message in enumerate(messages):
            case = ET.SubElement(suite, "testcase", classname="harness", name=f"{kind} {i + 1}")
            ET.SubElement(case, "error", message=message.splitlines()[0] if message else kind, type=kind).text = message
            counts["tests"] += 1
            counts["errors"] += 1
    for key, value in counts.items():
        suite.set(key, str(value))
    if result.finished is not None:
        suite.set("time", f"{result.finished - result.started:.3f}")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.ElementTree(root)


def case_names(verdicts: Any) -> list[str]:
    """One name per verdict, unique within its item: the item's title, and for an item recorded by
    several tests (nothing-lost: one per suite) the recording suite's file (then its test, then a
    count) after it, so CI viewers do not merge them."""
    by_item: dict[str, list[Any]] = {}
    for v in verdicts:
        by_item.setdefault(v.item, []).append(v)
    names = []
    seen: set[tuple[str, str]] = set()
    for v in verdicts:
        name = v.title
        if len(by_item[v.item]) > 1 and v.test:
            file, _, func = v.test.partition("::")
            name = f"{v.title} [{Path(file).name}]"
            if (v.item, name) in seen and func:
                name = f"{v.title} [{Path(file).name}::{func}]"
        base, k = name, 2
        while (v.item, name) in seen:
            name, k = f"{base} #{k}", k + 1
        seen.add((v.item, name))
        names.append(name)
    return names


def write_junit(result: RunResult, path: str | os.PathLike) -> None:
    junit_tree(result).write(path, encoding="utf-8", xml_declaration=True)


def _iso(t: float) -> str:
    import datetime
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).isoformat(timespec="seconds")


def take_over_junit_xml(config: Any) -> None:
    """In a conformance run, pytest's ``--junit-xml PATH`` gets the conformance JUnit (one case per
    checklist verdict, see :func:`write_junit_option_path`) instead of pytest's per-test file."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover -- pytest moved it; pytest's own file is written then
        return
    xml = config.stash.get(xml_key, None)
    if xml is not None:
        config.pluginmanager.unregister(xml)
        del config.stash[xml_key]


def write_junit_option_path(result: RunResult, config: Any) -> Path | None:
    """Write the JUnit file to ``--junit-xml PATH`` (a stable path for CI uploaders), if given."""
    option = config.getoption("xmlpath", None)
    if not option:
        return None
    path = Path(os.path.expanduser(os.path.expandvars(option)))
    path = path if path.is_absolute() else Path(config.invocation_params.dir) / path
    path.parent.mkdir(parents=True, exist_ok=True)
    write_junit(result, path)
    return path
