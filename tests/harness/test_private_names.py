"""No private name crosses a module boundary (issue 25): a leading underscore means "this module's
own", so another module that imports it, or reads ``obj._attr`` of an object it did not define,
depends on what was free to change. Read from the source with ``ast``; the few allowed crossings are
listed with why (stdlib names that are documented, and pytest's JUnit plugin key: pytest gives no
public way to stand its own ``--junit-xml`` file down for the conformance one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ALLOWED = {
    ("os", "_exit"): "documented: exit a forked or failed child without running cleanups",
    ("resource_tracker", "_resource_tracker"): "CPython's tracker singleton: stopped and reaped (PID 1 reaps no orphans)",
    ("util", "_exit_function"): "multiprocessing's exit hook, run before the tracker stops",
    ("_pytest.junitxml", "xml_key"): "pytest's own JUnit writer, unregistered in a conformance run",
}


def _defined_here(tree: ast.AST) -> set[str]:
    """Names a module defines or assigns anywhere (its own classes' attributes included)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:   # set_defaults(_module=...) and the like
            names.add(node.arg)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def crossings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = _defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (_private(alias.name) or any(_private(p) for p in node.module.split("."))) \
                        and (node.module, alias.name) not in ALLOWED:
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            base = node.value
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            owner = base.id if isinstance(base, ast.Name) else ast.unparse(base)
            if (owner, node.attr) not in ALLOWED:
                found.append(f"{node.lineno}: reads {owner}.{node.attr}")
    return found


def test_no_module_of_the_harness_reads_another_modules_private_names():
    bad = {str(p.relative_to(ROOT)): c for p in sorted((ROOT / "harness").rglob("*.py")) if (c := crossings(p))}
    assert not bad, ("private names used across modules (fix: make the name public with a docstring, or add an "
                     "accessor to its owner):\n" + "\n".join(f"{f}:{line}" for f, cs in bad.items() for line in cs))


def test_the_check_sees_a_crossing(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from harness.fabric.cli import _slots\nimport os\n\n"
                      "def f(topology):\n    os._exit(0)\n    return topology._procs, _slots()\n")
    assert crossings(sample) == ["1: from harness.fabric.cli import _slots", "6: reads topology._procs"]
