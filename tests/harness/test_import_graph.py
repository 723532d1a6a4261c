"""The package's shape: layers with one direction, no import cycle among harness modules (none at
module level, and none between two files even through imports inside functions), no source file
over 400 lines (the house cap).

Layers (docs/architecture.md, "The harness around the engine"): every module of harness/ has a layer
in ``LAYERS`` and may import only modules of its own layer or lower ones. Every import counts for
that rule: module level, under ``if TYPE_CHECKING:``, and inside functions (a function-level import
is still a dependency, only a later one). The same edges make the package-level graph (a harness
sub-package, an engine sub-package or a top-level module per node), which must have no cycle.
Edges still wrong in files another change owns are listed once, in ``KNOWN_EXCEPTIONS``, with the
owner; the entry goes when that change is merged.

The graph itself is read from the source with ``ast`` by tests/harness/import_graph.py (its doc says
which imports make which edges); the reader's own tests are in tests/harness/test_import_graph_reader.py.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.harness.import_graph import (MAX_LINES, all_imports, covers, fake_package, file_graph, find_cycles,
                                        import_graph, long_files, module_names)

ROOT = Path(__file__).resolve().parents[2]


# -- layers -------------------------------------------------------------------------------------------

#: bottom to top; a module may import its own layer or a lower one. Names are module prefixes
#: (``harness.engine`` covers ``harness.engine.pd.router``; the longest prefix decides), except the
#: package itself (``harness``: its ``__init__``), which covers only itself.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("harness", "harness.errors", "harness.ids", "harness.waiting", "harness.signals", "harness.stats",
                "harness.states", "harness.checklists", "harness.urls", "harness.hosts")),
    ("engine", ("harness.engine",)),
    ("clusterfile", ("harness.clusterfile",)),
    ("probes", ("harness.probes",)),
    ("fabric", ("harness.fabric",)),
    ("faults", ("harness.faults",)),
    ("evidence", ("harness.evidence",)),
    ("scenarios", ("harness.scenarios",)),
    ("checks", ("harness.checks",)),
    ("report", ("harness.report", "harness.compare", "harness.compare_samples", "harness.compare_fabric",
                "harness.history")),
    ("wiring", ("harness.fixtures", "harness.conformance", "harness.plugin", "harness.plugin_state", "harness.cli",
                "harness.cli_hosts", "harness.cli_run", "harness.cli_fault", "harness.cli_compare", "harness.dry_run", "harness.baseline", "harness.plugin_options", "harness.cluster",
                "harness.suites", "harness.__main__")),
]

#: (importing module or package, imported module or package) -> who removes the edge: the one
#: allow-list, for edges in files another change of issue 25 owns (a prefix covers its submodules).
#: The lead deletes an entry once that change is merged; the test then keeps the edge out.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def excepted(src: str, dst: str, allowed: Mapping[tuple[str, str], str]) -> bool:
    return any(covers(a, src) and covers(b, dst) for a, b in allowed)


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> tuple[int, str] | None:
    """(index, name) of the layer whose longest prefix covers ``module``; None when none does."""
    best: tuple[int, int, str] | None = None
    for index, (name, prefixes) in enumerate(layers):
        for prefix in prefixes:
            matches = covers(prefix, module) if "." in prefix else module == prefix
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index, name)
    return None if best is None else (best[1], best[2])


def upward_imports(root: Path, package: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS,
                   allowed: Mapping[tuple[str, str], str] | None = None) -> list[str]:
    """One line per import of a higher layer (or of/from a module with no layer), naming the fix."""
    names = [name for name, _ in layers]
    problems = [f"{m} has no layer (fix: add it to LAYERS in tests/harness/test_import_graph.py)"
                for m in module_names(root, package) if layer_of(m, layers) is None]
    for src, line, dst in all_imports(root, package):
        mine, theirs = layer_of(src, layers), layer_of(dst, layers)
        if mine is None or theirs is None or theirs[0] <= mine[0] or excepted(src, dst, allowed or {}):
            continue
        problems.append(f"{src}:{line} imports {dst} ({mine[1]} may import only: {', '.join(names[: mine[0] + 1])})")
    return problems


def package_of(module: str) -> str:
    """The node of the package-level graph: a sub-package of harness (engine's sub-packages each
    count alone), or a top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["engine"] and len(parts) > 2 else parts[:2])


def package_graph(root: Path, package: str, allowed: Mapping[tuple[str, str], str] | None = None) -> dict[str, set[str]]:
    """Package -> the packages it imports (every import counted; ``allowed`` edges left out)."""
    graph: dict[str, set[str]] = {package_of(m): set() for m in module_names(root, package)}
    for src, _, dst in all_imports(root, package):
        a, b = package_of(src), package_of(dst)
        if a != b and not excepted(src, dst, allowed or {}):
            graph[a].add(b)
    return graph


# -- the layers on small fake packages ----------------------------------------------------------------


def test_layers_flag_an_upward_import_inside_a_function_with_its_line(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "import json\ndef later():\n    from pkg.high import b\n    return b\n",
        "high/__init__.py": "",
        "high/b.py": "from pkg.low import a\n",              # downward: fine
        "loose.py": "",
    })
    layers = [("base", ("pkg", "pkg.low")), ("top", ("pkg.high",))]          # "pkg" covers only pkg/__init__
    assert upward_imports(root, "pkg", layers) == [
        "pkg.loose has no layer (fix: add it to LAYERS in tests/harness/test_import_graph.py)",
        "pkg.low.a:3 imports pkg.high.b (base may import only: base)"]
    assert upward_imports(root, "pkg", layers + [("rest", ("pkg.loose",))],
                          allowed={("pkg.low", "pkg.high"): "someone"}) == []


def test_layers_count_type_checking_imports_and_take_the_longest_prefix(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a.y import T\n",
        "a/y.py": "",
    })
    layers = [("low", ("pkg", "pkg.a")), ("high", ("pkg.a.y",))]
    assert layer_of("pkg.a.y.z", layers) == (1, "high") and layer_of("pkg.a.x", layers) == (0, "low")
    assert layer_of("pkg.ab", layers) is None
    assert upward_imports(root, "pkg", layers) == ["pkg.a.x:3 imports pkg.a.y (low may import only: low)"]


def test_package_graph_counts_function_imports_and_leaves_out_allowed_edges(tmp_path):
    root = fake_package(tmp_path, {
        "__init__.py": "",
        "p/__init__.py": "from pkg.q import r\n",
        "q/__init__.py": "",
        "q/r.py": "def later():\n    import pkg.p\n",
        "top.py": "",
    })
    graph = package_graph(root, "pkg")
    assert graph == {"pkg": set(), "pkg.p": {"pkg.q"}, "pkg.q": {"pkg.p"}, "pkg.top": set()}
    assert find_cycles(graph) == [["pkg.p", "pkg.q", "pkg.p"]]
    assert find_cycles(package_graph(root, "pkg", allowed={("pkg.q.r", "pkg.p"): "someone"})) == []


# -- the harness itself ---------------------------------------------------------------------------


def test_harness_has_no_import_cycle():
    cycles = find_cycles(import_graph(ROOT, "harness"))
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in harness/ (fix: move what both sides need into a module "
                    "neither imports, or pass it in):\n" + "\n".join(" -> ".join(c) for c in cycles))


def test_no_two_harness_files_import_each_other_even_inside_functions():
    """metrics_source <-> promql and request_shape <-> streaming were such circles, closed by an
    import inside a function; the shared types moved down (probes/metrics/metrics_base.py, probes/client/shapes.py),
    as RunResult did (report/result.py). Planted defect: the old pair put back (promql importing its
    types from metrics_source, metrics_source importing promql inside metrics_source()) fails this
    while the module-level rule passes it (checked)."""
    cycles = find_cycles(file_graph(ROOT, "harness"))
    if cycles:
        pytest.fail(f"{len(cycles)} circle(s) between harness files, imports inside functions counted (fix: move "
                    "what both need into a lower module):\n" + "\n".join(" -> ".join(c) for c in cycles))


def test_harness_imports_only_its_own_layer_or_lower_ones():
    """The layers of docs/architecture.md, every import counted (functions and TYPE_CHECKING too)."""
    problems = upward_imports(ROOT, "harness", allowed=KNOWN_EXCEPTIONS)
    if problems:
        pytest.fail(f"{len(problems)} import(s) against the layers (fix: move what the lower module needs down, "
                    "or the caller up; the layers are in docs/architecture.md):\n" + "\n".join(problems))


def test_harness_packages_do_not_import_each_other_both_ways():
    cycles = find_cycles(package_graph(ROOT, "harness", allowed=KNOWN_EXCEPTIONS))
    if cycles:
        pytest.fail(f"{len(cycles)} package-level import cycle(s), imports inside functions counted (fix: "
                    "one side imports the other only):\n" + "\n".join(" -> ".join(c) for c in cycles))


def test_every_known_exception_is_still_needed():
    """An entry of KNOWN_EXCEPTIONS that matches no import any more is deleted, so the list only shrinks."""
    edges = [(src, dst) for src, _, dst in all_imports(ROOT, "harness")]
    stale = [f"{a} -> {b} ({owner})" for (a, b), owner in KNOWN_EXCEPTIONS.items()
             if not any(excepted(src, dst, {(a, b): owner}) for src, dst in edges)]
    assert stale == [], f"remove from KNOWN_EXCEPTIONS (the edge is gone): {stale}"


def test_no_harness_file_is_over_the_line_limit():
    over = long_files(ROOT, "harness")
    if over:
        pytest.fail(f"files over {MAX_LINES} lines (fix: split each by what its parts are):\n" +
                    "\n".join(f"{path}: {n}" for path, n in over.items()))


#: the folders beside harness/ held to the same cap (suites/ is harness/suites/ through a link: above)
CAPPED_FOLDERS = ("bench", "clusters", "tests")


def files_over_the_cap(root: Path, folders: tuple[str, ...] = CAPPED_FOLDERS) -> dict[str, int]:
    """Every .py file of ``folders`` (under ``root``) over MAX_LINES lines, with its line count."""
    return {path: n for folder in folders for path, n in long_files(root, folder).items()}


def test_no_file_of_bench_clusters_or_tests_is_over_the_line_limit():
    """The house cap beyond harness/ (issue 34): every .py file of bench/, clusters/ and tests/ is at
    most 400 lines (bench/bench_scale.py was 762, this file 484, tests/harness/test_plugin.py 420).
    Planted defect: a 401-line file in bench/ fails this, named with its count (checked)."""
    over = files_over_the_cap(ROOT)
    if over:
        pytest.fail(f"files over {MAX_LINES} lines in {', '.join(f + '/' for f in CAPPED_FOLDERS)} (fix: split each by "
                    "what its parts are; a test file: move a group of its tests to a new file beside it):\n" +
                    "\n".join(f"{path}: {n}" for path, n in over.items()))


def test_the_cap_beyond_harness_finds_a_long_file_in_each_folder(tmp_path):
    """Planted defects in a copy: a 401-line file in bench/, one in clusters/ and one two folders
    down in tests/ are each found with its count; a file of exactly 400 lines is not."""
    for rel, n in (("bench/planted.py", 401), ("bench/at_the_cap.py", 400), ("clusters/dynamo/planted.py", 401),
                   ("tests/harness/deep/test_planted.py", 401)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n" * n)
    assert files_over_the_cap(tmp_path) == {"bench/planted.py": 401, "clusters/dynamo/planted.py": 401,
                                            "tests/harness/deep/test_planted.py": 401}


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


def checks_importing_scenarios(root: Path) -> list[str]:
    """Every import of harness.scenarios from harness.checks (module level, TYPE_CHECKING, functions)."""
    return [f"{src}:{line} imports {dst}" for src, line, dst in all_imports(root, "harness")
            if covers("harness.checks", src) and covers("harness.scenarios", dst)]


def test_checks_judge_evidence_and_import_no_scenario(tmp_path):
    """The verdict layer does not depend on the drivers (issue 34): what a scenario hands a check
    (fault marks, client faults, kill windows, migration attempts, DCGM injections, soak outcomes)
    lives in harness/evidence/, below both, and harness/checks/ imports nothing of harness/scenarios/
    (the linear LAYERS would allow it: checks sit above scenarios). Planted defect: one such import,
    inside a function as checks/migration.py had it, in a copy of the package: found with its line."""
    assert checks_importing_scenarios(ROOT) == []
    pkg = tmp_path / "harness"
    for sub in ("checks", "scenarios"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "scenarios" / "migration.py").write_text("class MigrationAttempt: ...\n")
    (pkg / "checks" / "migration.py").write_text("def assess():\n    from harness.scenarios.migration import MigrationAttempt\n")
    assert checks_importing_scenarios(tmp_path) == ["harness.checks.migration:2 imports harness.scenarios.migration"]


#: the rooms of harness/probes/, bottom to top: a room imports only lower rooms (docs/architecture.md)
PROBE_ROOMS = ["machine_health", "metrics", "client", "workers", "loadgen"]


def probe_room_problems(root: Path) -> list[str]:
    """One line per import of a probes room by a room at its level or below, or of a module of
    harness/probes/ that lies in no room."""
    problems = []
    for src, line, dst in all_imports(root, "harness"):
        if not (src.startswith("harness.probes.") and dst.startswith("harness.probes.")):
            continue
        a, b = src.split(".")[2], dst.split(".")[2]
        for room in (a, b):
            if room not in PROBE_ROOMS:
                problems.append(f"harness.probes.{room} is in no room (fix: move it into one of {PROBE_ROOMS})")
        if a != b and a in PROBE_ROOMS and b in PROBE_ROOMS and PROBE_ROOMS.index(b) > PROBE_ROOMS.index(a):
            problems.append(f"{src}:{line} imports {dst} (probes/{a} may import only: "
                            f"{', '.join(PROBE_ROOMS[: PROBE_ROOMS.index(a)])})")
    return sorted(set(problems))


def test_the_rooms_of_probes_import_only_lower_rooms():
    """harness/probes/ was one room of 31 files (issue 34); now five, each importing only those below
    it: machine_health, metrics, client, then workers and loadgen. Planted defects (checked): the
    client's records importing the load runner (client -> loadgen), a module left at probes/ top level."""
    problems = probe_room_problems(ROOT)
    assert problems == [], "\n".join(problems)
    assert sorted(p.name for p in (ROOT / "harness" / "probes").iterdir()
                  if p.suffix == ".py" and p.name != "__init__.py") == [], "a probes module outside the rooms"
