"""`bundled.router` and `bundled.engine` are typed models made from the engine's RouterConfig and
EngineConfig; the cluster file's models import nothing above their layer (fault kinds and fabric
ranges live in harness/clusterfile itself)."""

import dataclasses
import json
import subprocess
import sys

import pytest

from harness.cluster import settings_spec
from harness.clusterfile import FabricSettings, load_cluster, parse_cluster
from harness.clusterfile.base import FAULT_KINDS
from harness.clusterfile.engine_settings import ENGINE_RESERVED, EngineSettings, RouterSettings
from harness.clusterfile.load import json_schema
from harness.engine.core.config import EngineConfig
from harness.engine.pd.router_config import RouterConfig
from harness.errors import ConfigError


def test_the_models_have_exactly_the_engines_fields():
    assert set(RouterSettings.model_fields) == {f.name for f in dataclasses.fields(RouterConfig)}
    assert set(EngineSettings.model_fields) == {f.name for f in dataclasses.fields(EngineConfig)} - set(ENGINE_RESERVED)
    router = json_schema()["$defs"]["RouterSettings"]["properties"]
    assert router["reschedule_enabled"]["type"] == "boolean" and "x-fix" in router["reschedule_enabled"]


def test_only_what_the_file_sets_reaches_the_engine_and_the_report():
    spec = load_cluster("local-sabotaged")
    assert spec.bundled.router.reschedule_delay_s > 3.0
    assert spec.bundled.router.model_dump(exclude_unset=True) == {"reschedule_delay_s": spec.bundled.router.reschedule_delay_s}
    assert spec.to_dict()["bundled"]["engine"] == {}  # not the engine's defaults: the preset chooses those
    spec = parse_cluster({"kind": "bundled", "bundled": {"engine": {"block_size": 32}, "router": None}}, source="x.yaml")
    assert spec.bundled.engine.block_size == 32 and spec.bundled.router.model_dump(exclude_unset=True) == {}
    assert json.loads(json.dumps(spec.to_dict()))["bundled"]["engine"] == {"block_size": 32}


def test_the_fault_kinds_are_the_ones_harness_faults_registers():
    import harness.faults  # noqa: F401  (importing registers the catalogue)
    from harness.faults.base import Fault

    shipped = {kind for kind, cls in Fault.registry.items() if cls.__module__.startswith("harness.")}
    assert set(FAULT_KINDS) == shipped  # other tests register kinds of their own (e.g. test_file)


def test_loading_a_cluster_file_imports_no_higher_layer():
    code = ("import json, sys; from harness.clusterfile.load import load_cluster; load_cluster('local-fabric'); "
            "print(json.dumps(sorted({m.split('.')[1] for m in sys.modules if m.startswith('harness.')})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout))
    assert not loaded & {"faults", "fabric", "probes", "checks", "report", "scenarios"}, loaded


@pytest.mark.parametrize("field, edge, beyond", [
    ("line_rate_bps", 1e6, 9.9e5), ("line_rate_bps", 100e9, 1.01e11), ("mtu", 1280, 1279), ("mtu", 65000, 65001),
    ("lossless_share", 0.05, 0.04), ("lossless_share", 0.95, 0.96),
])
def test_the_fabric_ranges_are_the_shaping_specs(field, edge, beyond):
    """The cluster file checks the fabric's ranges without importing harness.fabric: both agree."""
    from harness.fabric.shaping import ShapingSpec

    assert getattr(settings_spec(FabricSettings(**{field: edge})), field) == edge
    with pytest.raises(ConfigError, match=f"`fabric.{field}`"):
        parse_cluster({"kind": "bundled", "fabric": {field: beyond}}, source="x.yaml")
    with pytest.raises(ConfigError):
        ShapingSpec(**{field: beyond})
