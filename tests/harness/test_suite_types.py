"""The suites are typed with the harness's real classes (issue 25): no parameter or return
annotation in harness/suites/ is ``Any`` or holds it (``dict[str, Any]``). Read with ``ast``: no
suite module is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SUITES = Path(__file__).resolve().parents[2] / "harness" / "suites"


def _mentions_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    return any((isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
               for n in ast.walk(node))


def any_annotations(source: str, filename: str = "<suite>") -> list[str]:
    """``file:line name`` of every parameter or return annotation in ``source`` that mentions Any."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
        found += [f"{filename}:{a.lineno} {node.name}({a.arg})" for a in params if _mentions_any(a.annotation)]
        if _mentions_any(node.returns):
            found.append(f"{filename}:{node.lineno} {node.name} -> ...")
    return found


def test_the_check_finds_any_in_parameters_and_returns() -> None:
    source = ("from typing import Any\nimport typing\n"
              "def f(a: Any, b: int, *c: 'dict[str, Any]', d: typing.Any = 1) -> list[Any]: ...\n"
              "def g(a: int) -> int: ...\n")
    assert any_annotations(source, "x.py") == ["x.py:3 f(a)", "x.py:3 f(d)", "x.py:3 f(c)", "x.py:3 f -> ..."]


@pytest.mark.parametrize("path", sorted(SUITES.glob("*.py")), ids=lambda p: p.name)
def test_no_suite_annotation_is_any(path: Path) -> None:
    found = any_annotations(path.read_text(encoding="utf-8"), str(path.relative_to(SUITES.parents[1])))
    assert not found, ("annotate with the harness's classes (ClusterHandle, FaultRunner, Load, Timeline, "
                       "Conformance, LoadRunner, ...), not Any: " + "; ".join(found))
