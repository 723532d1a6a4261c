"""The 6.1.4 scenario's plan and victim choice (harness/scenarios/reschedule.py) and the fault mark's
source (harness/scenarios/fault_marks.py): a real FaultRunner in dry run, a real ledger file, the
admin API's worker rows parsed as the admin client parses them."""

from __future__ import annotations

import io
from pathlib import Path

from harness.faults import Action, FaultRunner, Ledger, ProcessHang, ProcessKill
from harness.engine.admin.models import EngineEvent, AdminWorker
from harness.evidence.fault_marks import affected_request_id
from harness.scenarios.fault_marks import injection
from harness.scenarios.reschedule import RescheduleUnderLoad, fault_plan, lone_roles, make_fault


def worker(wid: str, role: str, pid: int, health: str = "healthy") -> AdminWorker:
    return AdminWorker.parse({"id": wid, "role": role, "health": health, "pid": pid}, "GET /admin/workers")


WORKERS = [worker("prefill-0", "prefill", 101), worker("prefill-1", "prefill", 102),
           worker("decode-0", "decode", 201), worker("decode-1", "decode", 202)]


class Router:
    """The router's view the scenario reads (the ``timeline`` fixture's two calls)."""

    def __init__(self, workers: list[AdminWorker]) -> None:
        self._workers = workers

    def workers(self) -> list[AdminWorker]:
        return list(self._workers)

    def events(self, since: int = 0, type: str | None = None) -> list[EngineEvent]:  # noqa: A002
        return []


def runner(tmp_path: Path) -> FaultRunner:
    return FaultRunner(Ledger.for_cluster("local", tmp_path / "state"), dry_run=True, handle_signals=False,
                       out=io.StringIO())


def test_the_plan_kills_each_role_then_hangs_each_only_roles_with_a_survivor() -> None:
    assert fault_plan(2) == [("process_kill", "prefill"), ("process_kill", "decode")] * 2 + \
        [("process_hang", "decode"), ("process_hang", "prefill")] * 2
    assert fault_plan(1, ["decode"]) == [("process_kill", "decode"), ("process_hang", "decode")]
    assert lone_roles(WORKERS) == {}
    assert lone_roles(WORKERS[1:]) == {"prefill": "only one prefill worker (prefill-1): nothing can take over"}
    assert lone_roles(WORKERS[:2]) == {"decode": "no decode worker"}


def test_a_kill_without_a_topology_has_no_restart_hook_and_a_hang_is_a_sigstop() -> None:
    kill = make_fault("process_kill", WORKERS[2], None)
    assert isinstance(kill, ProcessKill) and (kill.worker_id, kill.pid, kill.role) == ("decode-0", 201, "decode")
    assert isinstance(make_fault("process_hang", WORKERS[0], None), ProcessHang)


def test_a_rehearsal_plans_every_fault_on_a_seeded_worker_and_injects_none(tmp_path: Path) -> None:
    faults = runner(tmp_path)
    plan = fault_plan(1)
    scenario = RescheduleUnderLoad(faults, Router(WORKERS), lambda **_: None, None, plan, seed=7,  # type: ignore
                                   rejoin_limit_s=60.0)
    with faults:
        scenario.rehearse()
    injects = [r for r in faults.records if r.action is Action.INJECT]
    assert [r.kind for r in injects] == [kind for kind, _ in plan]
    assert {r.status.value for r in faults.records} == {"dry_run"}
    assert faults.active_faults == []
    again = runner(tmp_path / "again")
    with again:
        RescheduleUnderLoad(again, Router(WORKERS), lambda **_: None, None, plan, seed=7,  # type: ignore
                            rejoin_limit_s=60.0).rehearse()
    assert [r.target for r in again.records] == [r.target for r in faults.records]  # the seed decides


def test_the_mark_comes_from_the_runners_inject_record(tmp_path: Path) -> None:
    faults = runner(tmp_path)
    with faults:
        first = faults.inject(make_fault("process_hang", WORKERS[0], None))
        second = faults.inject(make_fault("process_hang", WORKERS[2], None))
        marks = injection(faults, first), injection(faults, second)
        faults.revert_all()
    assert [(m.fault_id, m.action) for m in marks] == [(first.fault_id, Action.INJECT),
                                                       (second.fault_id, Action.INJECT)]
    assert marks[0].started_wall <= marks[1].started_wall


def test_affected_attempts_name_their_request() -> None:
    assert affected_request_id("req-1#2") == "req-1"
    assert affected_request_id("req-without-attempt") == "req-without-attempt"
