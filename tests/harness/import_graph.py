"""A package's import graph read from the source with ``ast`` (nothing is imported): the modules of a
folder, the edges between them, the cycles among them, and each file's line count. The rules on
harness/ that use it are in tests/harness/test_import_graph.py; the reader itself is tested on small
fake packages in tests/harness/test_import_graph_reader.py.

For the module-level graph (``import_graph``): an edge per module-level ``import X`` / ``from X import
Y`` (to ``X.Y`` when Y is a submodule), including those under ``try``, ``with`` and ``if`` at module
level and in class bodies. Imports inside functions do not count there (``all_imports`` and
``file_graph`` count them). Imports under ``if TYPE_CHECKING:`` do count for harness/: they never run,
but a module that names another's types while that one imports it back is the two-way dependency the
rule is about (the router <-> resilience <-> migration back-pointers were such a pair, hidden from
Python's import machinery and not from the reader). An import of ``a.b.c`` is an edge to ``a.b.c``
only: its parent packages run first, but a package ``__init__`` that re-exports its own submodules is
the usual layout, not a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

MAX_LINES = 400  # the house cap of a source file


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
            graph[name].update(t for t in _targets(node, name, path, modules) if t in modules and t != name)
    return graph


def _targets(node: ast.AST, name: str, path: Path, modules: Mapping[str, Path]) -> list[str]:
    """The modules an import statement of module ``name`` names (``from X import Y`` -> ``X.Y`` when Y is
    a submodule, else ``X``); [] for any other statement."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        prefix = _base_of_relative(name, path.name == "__init__.py", node.level)
        base = f"{prefix}.{base}" if base else prefix
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


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



def covers(prefix: str, module: str) -> bool:
    """Whether ``module`` is ``prefix`` or one of its submodules."""
    return module == prefix or module.startswith(prefix + ".")


def all_imports(root: Path, package: str) -> list[tuple[str, int, str]]:
    """(module, line, imported module of ``package``) for every import anywhere in each module:
    module level, ``if TYPE_CHECKING:`` and function bodies alike."""
    modules = module_names(root, package)
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            found += [(name, node.lineno, t) for t in dict.fromkeys(_targets(node, name, path, modules))
                      if t != name and covers(package, t)]
    return sorted(found)


def file_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports anywhere: module level, ``if TYPE_CHECKING:``
    and inside functions (an import inside a function that closes a circle is still a circle)."""
    graph: dict[str, set[str]] = {name: set() for name in module_names(root, package)}
    for src, _, dst in all_imports(root, package):
        if dst in graph:
            graph[src].add(dst)
    return graph


def fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` made of ``files`` (path in the package -> source); returns ``tmp_path``."""
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path
