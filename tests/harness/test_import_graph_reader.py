"""The import-graph reader (tests/harness/import_graph.py) on small fake packages: cycles through
submodule and relative imports, ``TYPE_CHECKING`` imports, circles closed inside a function, line
counts. The rules it serves on harness/ are in tests/harness/test_import_graph.py."""

from __future__ import annotations

from tests.harness.import_graph import fake_package, file_graph, find_cycles, import_graph, long_files


def test_detector_finds_a_cycle_through_submodule_and_relative_imports(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",                 # b is a submodule: an edge to pkg.b
        "b.py": "try:\n    from .sub.c import thing\nexcept ImportError:\n    pass\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\n",
        "d.py": "import pkg.a\n",                     # into the cycle, not part of it
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_detector_passes_a_package_without_cycles(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "from pkg.a import x\n",      # re-exporting a submodule is not a cycle
        "a.py": "from pkg.b import y\nx = y\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\ny = 1\n"
                 "def later():\n    from pkg import a\n    return a\n"),
    })
    graph = import_graph(root, "pkg", type_checking=False)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert find_cycles(graph) == []


def test_detector_counts_type_checking_imports_unless_told_not_to(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "",
        "router.py": "from pkg.migration import Manager\n",
        "migration.py": ("from __future__ import annotations\nimport typing\nif typing.TYPE_CHECKING:\n"
                         "    from pkg.router import Router\nelse:\n    import json\nclass Manager:\n"
                         "    router: Router\n"),
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.migration", "pkg.router", "pkg.migration"]]
    assert find_cycles(import_graph(root, "pkg", type_checking=False)) == []


def test_detector_counts_lines_per_file(tmp_path):
    root = fake_package(tmp_path, {"__init__.py": "", "short.py": "x = 1\n" * 3, "long.py": "x = 1\n" * 5})
    assert long_files(root, "pkg", limit=4) == {"pkg/long.py": 5}

def test_file_graph_finds_a_circle_closed_inside_a_function(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "",
        "source.py": "def pick():\n    from pkg.promql import Prom\n    return Prom\n",  # the closing edge
        "promql.py": "from pkg.source import Base\nclass Prom(Base): ...\n",
    })
    assert find_cycles(import_graph(root, "pkg")) == []  # invisible to the module-level rule
    assert find_cycles(file_graph(root, "pkg")) == [["pkg.promql", "pkg.source", "pkg.promql"]]
