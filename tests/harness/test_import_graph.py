"""The package's shape: no import cycle among harness modules, no source file over 450 lines.

The import graph is read from the source with ``ast`` (nothing is imported): an edge per module-level
``import X`` / ``from X import Y`` (to ``X.Y`` when Y is a submodule), including those under ``try``,
``with`` and ``if`` at module level and in class bodies. Imports inside functions do not count.
Imports under ``if TYPE_CHECKING:`` do count for harness/: they never run, but a module that names
another's types while that one imports it back is the two-way dependency the rule is about (the
router <-> resilience <-> migration back-pointers were such a pair, hidden from Python's import
machinery and not from the reader). An import of ``a.b.c`` is an edge to ``a.b.c`` only: its parent
packages run first, but a package ``__init__`` that re-exports its own submodules is the usual
layout, not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 450


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``) by dotted name."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt], type_checking: bool):
    """Statements outside function bodies; ``if TYPE_CHECKING:`` blocks only when ``type_checking``."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        if isinstance(node, ast.If):
            skip = _is_type_checking(node.test) and not type_checking
            yield from _module_level(node.orelse if skip else node.body + node.orelse, type_checking)
        elif isinstance(node, ast.Try):
            yield from _module_level(node.body + node.orelse + node.finalbody +
                                     [s for h in node.handlers for s in h.body], type_checking)
        elif isinstance(node, (ast.With, ast.ClassDef, ast.For, ast.While)):
            yield from _module_level(node.body + getattr(node, "orelse", []), type_checking)


def _base_of_relative(module: str, is_package: bool, level: int) -> str:
    parts = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join(parts[: len(parts) - (level - 1)])


def import_graph(root: Path, package: str, *, type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports outside functions (and under ``if TYPE_CHECKING:``
    when ``type_checking``)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _module_level(tree.body, type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    prefix = _base_of_relative(name, path.name == "__init__.py", node.level)
                    base = f"{prefix}.{base}" if base else prefix
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_cycle_in(graph, group) for group in groups)


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path back to the group's first module, through the group only (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")  # a strongly connected group has one


def long_files(root: Path, package: str, limit: int = MAX_LINES) -> dict[str, int]:
    counts = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines())
              for p in module_names(root, package).values()}
    return {path: n for path, n in sorted(counts.items()) if n > limit}


# -- the detector on small fake packages ------------------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_detector_finds_a_cycle_through_submodule_and_relative_imports(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",                 # b is a submodule: an edge to pkg.b
        "b.py": "try:\n    from .sub.c import thing\nexcept ImportError:\n    pass\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\n",
        "d.py": "import pkg.a\n",                     # into the cycle, not part of it
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_detector_passes_a_package_without_cycles(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from pkg.a import x\n",      # re-exporting a submodule is not a cycle
        "a.py": "from pkg.b import y\nx = y\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\ny = 1\n"
                 "def later():\n    from pkg import a\n    return a\n"),
    })
    graph = import_graph(root, "pkg", type_checking=False)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycles(graph) == []


def test_detector_counts_type_checking_imports_unless_told_not_to(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "router.py": "from pkg.migration import Manager\n",
        "migration.py": ("from __future__ import annotations\nimport typing\nif typing.TYPE_CHECKING:\n"
                         "    from pkg.router import Router\nelse:\n    import json\nclass Manager:\n"
                         "    router: Router\n"),
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.migration", "pkg.router", "pkg.migration"]]
    assert find_cycles(import_graph(root, "pkg", type_checking=False)) == []


def test_detector_counts_lines_per_file(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "short.py": "x = 1\n" * 3, "long.py": "x = 1\n" * 5})
    assert long_files(root, "pkg", limit=4) == {"pkg/long.py": 5}


# -- the harness itself ---------------------------------------------------------------------------


def test_harness_has_no_import_cycle():
    cycles = find_cycles(import_graph(ROOT, "harness"))
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in harness/ (fix: move what both sides need into a module "
                    "neither imports, or pass it in):\n" + "\n".join(" -> ".join(c) for c in cycles))


def test_no_harness_file_is_over_the_line_limit():
    over = long_files(ROOT, "harness")
    if over:
        pytest.fail(f"files over {MAX_LINES} lines (fix: split each by what its parts are):\n" +
                    "\n".join(f"{path}: {n}" for path, n in over.items()))


def test_fabric_reaches_hosts_without_the_fault_package():
    """Faults use the fabric (links, traffic classes); the fabric runs its commands through
    harness.hosts, never through harness.faults, so the two packages do not depend on each other."""
    found = []
    for name, path in module_names(ROOT, "harness").items():
        if not (name.startswith("harness.fabric") or name == "harness.hosts"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # function-level imports too
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.faults"):
                found.append(f"{name}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                found += [f"{name}: import {a.name}" for a in node.names if a.name.startswith("harness.faults")]
    assert found == []
