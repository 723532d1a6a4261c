"""The list of slow files CI runs two at a time (tests/conftest.py PARALLEL) against the files
themselves: each entry names a file that exists and holds slow tests (a renamed file would silently
drop back to the serial phase, and a quick file listed there would run twice in CI), and the files kept
serial for what they share stay off it. Planted defects it catches: an entry for a file that was
renamed (``engine/test_clients.py``), an entry for a quick file (``engine/test_router.py``), and
reliability/test_kill_points.py added to the list (checked: each fails)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import HERE, PARALLEL

MUST_STAY_SERIAL = ["reliability/test_kill_points.py", "reliability/test_killed_run_leftovers.py",
                    "probes/test_promql_server.py", "probes/test_distributed_load.py", "fabric/test_builder.py"]


def slow_marked(path: Path) -> bool:
    """Whether the file marks anything slow: a module ``pytestmark`` or a decorator naming ``slow``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "slow" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "mark":
            return True
    return False


def test_every_listed_file_exists_and_holds_slow_tests():
    missing = [f for f in PARALLEL if not (HERE / f).is_file()]
    assert missing == [], f"listed in tests/conftest.py PARALLEL but not found: {missing}"
    quick = [f for f in PARALLEL if not slow_marked(HERE / f)]
    assert quick == [], f"listed as parallel slow files but marking nothing slow: {quick}"


def test_the_files_that_share_machine_state_stay_serial():
    assert [f for f in MUST_STAY_SERIAL if f in PARALLEL] == []
    assert not [f for f in PARALLEL if f.startswith("realengine/")], "the engine pool is one shared process"
    assert all(why.strip() for why in PARALLEL.values()), "each entry says why it is safe"
