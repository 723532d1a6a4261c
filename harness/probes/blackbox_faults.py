"""Item 6.1.4 on a cluster the harness knows only from outside (no admin API): kill and hang the
workers of the cluster file's inventory under load, and keep what the client-view measurement
(harness/checks/reschedule_blackbox.py) needs: each fault's time, victim and role.

Per fault, on a worker picked (seeded) among the inventory's workers of the planned role, its
process found afresh on its host (harness/probes/inventory.py: pids change at every restart):

* **kill** (SIGKILL, ProcessKill): the fault is held for ``observe_s`` (the checklist's 3 s plus a
  margin) so the cluster must reschedule by itself, then reverted: the worker's restart command
  is run, or a supervised worker's service manager brings it back; either way the harness waits
  until the worker's process is a new one and its health URL answers 200 (a dying API server
  may still answer for a few seconds). Only restartable workers are killed.
* **hang** (SIGSTOP, ProcessHang): held for ``hang_s`` (default 8 s: longer than the 3 s budget,
  so a cluster that does not detect the hang shows it as a stall clients see), then SIGCONT.

Every fault goes through the fault runner (ledger before injection, revert on every exit path).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from harness.checks.reschedule_blackbox import ClientFault
from harness.errors import FaultError
from harness.faults import ProcessHang, ProcessKill
from harness.probes.inventory import InventoryWorker, locate_pid, resolve, wait_healthy
from harness.waiting import WaitTimeoutError, wait_until

log = logging.getLogger(__name__)

HANG_S = 8.0
RESTART_TIMEOUT_S = 600.0   # a vLLM instance restarts in 50-100 s on a 2-core machine; over 240 s seen under load


@dataclass
class BlackboxRun:
    faults: list[ClientFault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # what was planned but not done, and why
    restart_s: list[float] = field(default_factory=list)


def plan(workers: Sequence[Any], kills_per_role: int) -> list[tuple[str, str]]:
    """(kind, role) per fault: ``kills_per_role`` kills of each role that has a restartable worker,
    then one hang of each role."""
    roles = list(dict.fromkeys(str(w.role) for w in workers))
    restartable = {str(w.role) for w in workers if w.restartable}
    kills = [("process_kill", r) for _ in range(kills_per_role) for r in roles if r in restartable]
    return kills + [("process_hang", r) for r in roles]


def describe_plan(workers: Sequence[Any], steps: Sequence[tuple[str, str]], hang_s: float, observe_s: float) -> list[str]:
    """The dry run's lines: what would be signalled, found how, held how long, brought back how."""
    lines = []
    for kind, role in steps:
        names = [w for w in workers if str(w.role) == role]
        how = "; ".join(f"{w.name} on {w.host}: {_locator(w)}" for w in names)
        if kind == "process_kill":
            back = "; ".join(f"{w.name}: " + (f"run `{w.restart.command}`" if w.restart else "supervised")
                             for w in names if w.restartable)
            lines.append(f"kill -s KILL <pid> of one {role} worker ({how}); hold {observe_s:.0f} s; back: {back}")
        else:
            how = "; ".join(f"{w.name} on {w.host}: {_locator(w, 'hang_process')}" for w in names)
            lines.append(f"kill -s STOP <pid> of one {role} worker ({how}); hold {hang_s:.0f} s; kill -s CONT <pid>")
    return lines


def _locator(w: Any, which: str = "process") -> str:
    p = (w.hang_process if which == "hang_process" else None) or w.process
    if p is None:
        return "no process: entry"
    return (f"pgrep -f {p.pgrep!r}" if p.pgrep else f"cat {p.pid_file}" if p.pid_file
            else f"systemctl show -p MainPID --value {p.systemd_unit}")


def run_faults(cluster: Any, faults: Any, steps: Sequence[tuple[str, str]], *, seed: int, hang_s: float = HANG_S,
               observe_s: float = 5.0, before_each: Callable[[], None] | None = None) -> BlackboxRun:
    """Inject, hold and revert each planned fault in turn (see the module doc)."""
    out = BlackboxRun()
    executor_for = faults.executor_factory
    for i, (kind, role) in enumerate(steps):
        if before_each is not None:
            before_each()
        specs = [w for w in cluster.workers if str(w.role) == role
                 and (kind == "process_hang" or w.restartable)]
        spec = random.Random(seed + i).choice(specs)
        target: InventoryWorker = resolve([spec], executor_for,
                                          which="process" if kind == "process_kill" else "hang_process")[0]
        fault_role = role if role in ("prefill", "decode") else None
        if kind == "process_kill":
            fault = ProcessKill.from_worker(target.as_target(), restart_cmd=target.restart_cmd,
                                            supervised=target.supervised, healthy_url=target.health_url,
                                            healthy_timeout_s=RESTART_TIMEOUT_S)
            hold = observe_s
        else:
            fault = ProcessHang.from_worker(target.as_target())
            hold = hang_s
        faults.inject(fault)
        injected = next(r for r in faults.records if r.fault_id == fault.fault_id and r.action.value == "inject")
        out.faults.append(ClientFault(injected.started_wall, (target.id,), fault_role,
                                      f"{'kill' if kind == 'process_kill' else 'hang'} {target.id}"))
        time.sleep(hold)  # the cluster must cope by itself for this long: the measurement window
        t_revert = time.monotonic()
        faults.revert(fault)
        if kind == "process_kill":
            _wait_new_process(spec, target, executor_for(target.host), RESTART_TIMEOUT_S)
            out.restart_s.append(round(time.monotonic() - t_revert, 2))
        elif wait_healthy(target.health_url, RESTART_TIMEOUT_S) is None:
            raise FaultError(f"{target.id} does not answer {target.health_url} after its hang was reverted",
                             fix="check the worker's log")
    return out


def _wait_new_process(spec: Any, old: InventoryWorker, ex: Any, timeout_s: float) -> None:
    """Until the worker runs as a new process (not the killed pid) and its health URL answers 200."""
    def new_pid() -> int | None:
        try:
            return locate_pid(spec, ex)
        except FaultError:
            return None  # between the old process's exit and the new one's start

    def back(pid: int | None) -> bool:
        return pid is not None and pid != old.pid and wait_healthy(old.health_url, 1.0) is not None

    try:  # polled every second: a restart takes seconds to minutes
        wait_until(new_pid, timeout_s, 1.0, what=f"{old.id} to come back", accept=back)
    except WaitTimeoutError as exc:
        pid = exc.last_value
        raise FaultError(f"{old.id} did not come back within {timeout_s:.0f} s after it was killed "
                         f"(process {'found: ' + str(pid) if pid else 'not found'})",
                         fix="check its restart command or service manager and its log") from exc


__all__ = ["BlackboxRun", "HANG_S", "describe_plan", "plan", "run_faults"]
