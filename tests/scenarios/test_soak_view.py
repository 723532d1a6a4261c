"""The soak's view of an external cluster (harness/scenarios/soak_view.py ExternalView) on a real
``sleep`` child as the worker (its pid file) and a real HTTP server as its health URL and metrics page;
and the schedule's kinds on a cluster without the admin API or the fabric."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from harness.errors import FaultError
from harness.faults import ProcessHang, ProcessKill
from harness.hosts import LocalExecutor
from harness.scenarios.soak_schedule import KINDS, eligible_kinds, generate, left_out_because
from harness.scenarios.soak_view import CLIENT_VIEW, ExternalView
from tests.probes.test_external_leaks import server, worker  # noqa: F401 -- the fixture
from tests.probes.test_leak_sampler import sleeper  # noqa: F401 -- the fixture


@dataclass
class Cluster:
    """What ExternalView reads of the session's ClusterHandle."""

    workers: tuple[Any, ...]
    spec: Any = field(default_factory=lambda: SimpleNamespace(metric_profile="dynamo"))

    def auth_headers(self) -> dict[str, str]:
        return {}


def test_without_the_admin_api_only_the_process_kinds_are_scheduled_and_the_rest_say_why():
    kinds = eligible_kinds(None, fabric=False, admin=False)
    assert kinds == ("process_kill", "process_hang")
    assert "admin API" in (left_out_because("hbm_fill", fabric=False, admin=False) or "")
    assert "fabric" in (left_out_because("nic_flap", fabric=False, admin=False) or "")
    assert eligible_kinds(None, fabric=False) == ("process_kill", "process_hang", "hbm_fill", "ecc_poison")
    inv = [("dynamo-0", "aggregated"), ("dynamo-1", "aggregated")]
    s = generate(5, inv, 180, kinds, faults_per_min=2.5)
    assert s.faults and {f.kind for f in s.faults} <= set(kinds) and {f.role for f in s.faults} == {"aggregated"}
    for f in s.faults:   # two aggregated workers: one at a time, never both
        assert sum(o.offset_s <= f.offset_s < o.planned_until_s for o in s.faults) == 1
    assert all("aggregated" in KINDS[k].roles for k in kinds)


def test_the_external_view_claims_a_healthy_worker_and_builds_its_kill_and_hang_from_its_pid_file(
        sleeper, tmp_path, server):  # noqa: F811
    pid_file = tmp_path / "w0.pid"
    pid_file.write_text(str(sleeper.pid))
    w0 = worker("w0", pid_file, server)
    lone = worker("w1", pid_file, server).model_copy(update={"supervised": False})
    ex = LocalExecutor()
    view = ExternalView(Cluster((w0, lone)), lambda host: ex)
    try:
        assert view.judged_by == CLIENT_VIEW and view.mark() == 0 and view.new_events() == []
        spec = view.claim("w0")
        assert spec is w0
        sf = generate(0, [("w0", "aggregated"), ("w1", "aggregated")], 120, ("process_hang",)).faults[0]
        hang = view.make(sf.__class__(0, 30, "process_hang", "w0", "aggregated", 4, 50), spec)
        assert isinstance(hang, ProcessHang) and hang.pid == sleeper.pid
        kill = view.make(sf.__class__(1, 30, "process_kill", "w0", "aggregated", 4, 50), spec)
        assert isinstance(kill, ProcessKill) and kill.pid == sleeper.pid and kill.supervised
        assert kill.healthy_url == f"{server}/health" and kill.healthy is not None
        with pytest.raises(FaultError, match="no `restart:` and not `supervised: true`"):
            view.make(sf.__class__(2, 30, "process_kill", "w1", "aggregated", 4, 50), lone)
        assert view.idle_kv() == {"w0": 12, "w1": 12}     # steady over three reads
        [r0, r1] = view.leak_rows()
        assert r0.pid == sleeper.pid and r0.process is not None and r0.kv_blocks_used == 12
        assert view.kv_unmeasured() is None
    finally:
        view.close()
