"""Item 6.1.4 on a cluster the harness knows only from outside (no admin API): kill and hang the
workers of the cluster file's inventory under load, and keep what the client-view measurement
(harness/checks/reschedule_blackbox.py) needs: each fault's time, victim and role, and how each
victim came back.

Only roles with two or more workers are faulted: with one, nothing can take over its work, so its
faults would measure an outage by design (``without_survivor`` names them; 6.1.4 says so). Per
fault, on a worker picked (seeded) among the inventory's workers of the planned role, its process
found afresh on its host (harness/probes/workers/inventory.py: pids change at every restart):

* **kill** (SIGKILL, ProcessKill): the fault is held for ``observe_s`` (the checklist's 3 s plus a
  margin) so the cluster must reschedule by itself, then reverted: the worker's restart command
  is run, or a supervised worker's service manager brings it back; either way the revert waits
  until the worker runs as a new process (not the killed pid: a dying API server may still answer
  for a few seconds) whose health URL answers 200.
* **hang** (SIGSTOP, ProcessHang): held for ``hang_s`` (default 8 s: longer than the 3 s budget,
  so a cluster that does not detect the hang shows it as a stall clients see), then SIGCONT.

After either, the worker is **back** when it serves a request sent after the revert and the cluster
sends it traffic again, not when it is healthy, and never by a counter that work queued during the
fault can move (harness/probes/workers/rejoin.py: a kill's worker is a new process, a hang's resumed one):
the revert waits up to the checklist's ``rejoin_limit_s``
(the judged limit), then, when it is still out, up to ``REJOIN_WATCH_MAX_S`` after it was healthy
to learn when it came back. The next fault is injected only once it is back: a worker still out
then stops the plan, and ``BlackboxRun.stopped`` says why (faulting the rest would fault a cluster
that is not whole). Every fault goes through the fault runner (ledger before injection, revert on
every exit path).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from harness.errors import FaultError
from harness.faults import ProcessHang, ProcessKill
from harness.faults.fanout import NewProcess, locator
from harness.probes.workers.inventory import InventoryWorker, resolve, wait_healthy
from harness.probes.workers.rejoin import Rejoin, RejoinWatch
from harness.evidence.records import ClientFault

log = logging.getLogger(__name__)

HANG_S = 8.0
RESTART_TIMEOUT_S = 600.0   # a vLLM instance restarts in 50-100 s on a 2-core machine; over 240 s seen under load
# past the judged limit, how long after it was healthy a worker is still watched, to say when the cluster took
# it back (vllm-router: 100+ s measured here) before the plan stops
REJOIN_WATCH_MAX_S = 150.0  # past the 60 s limit, long enough to see vllm-router take a worker back (98-109 s measured)


@dataclass
class BlackboxRun:
    faults: list[ClientFault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # what was planned but not done, and why
    restart_s: list[float] = field(default_factory=list)
    rejoins: list[tuple[str, Rejoin]] = field(default_factory=list)  # (fault label, how its victim came back)
    stopped: str | None = None                          # why the plan ended before its last fault


def without_survivor(workers: Sequence[Any]) -> dict[str, str]:
    """Role -> why its faults are not judged: a role with one worker has nothing to take over."""
    names: dict[str, list[str]] = {}
    for w in workers:
        names.setdefault(str(w.role), []).append(str(w.name))
    return {role: f"only one {role} worker ({ws[0]}): nothing can take over" for role, ws in names.items()
            if len(ws) < 2}


def plan(workers: Sequence[Any], faults_per_role: int) -> list[tuple[str, str]]:
    """(kind, role) per fault: ``faults_per_role`` kills of each role that has a restartable worker,
    then ``faults_per_role`` hangs of each role; roles without a survivor (``without_survivor``) get none."""
    lone = without_survivor(workers)
    roles = [r for r in dict.fromkeys(str(w.role) for w in workers) if r not in lone]
    restartable = {str(w.role) for w in workers if w.restartable}
    kills = [("process_kill", r) for _ in range(faults_per_role) for r in roles if r in restartable]
    return kills + [("process_hang", r) for _ in range(faults_per_role) for r in roles]


def describe_plan(workers: Sequence[Any], steps: Sequence[tuple[str, str]], hang_s: float, observe_s: float) -> list[str]:
    """The dry run's lines: what would be signalled, found how, held how long, brought back how."""
    lines = []
    for kind, role in steps:
        names = [w for w in workers if str(w.role) == role]
        how = "; ".join(f"{w.name} on {w.host}: {locator(w)}" for w in names)
        if kind == "process_kill":
            back = "; ".join(f"{w.name}: " + (f"run `{w.restart.command}`" if w.restart else "supervised")
                             for w in names if w.restartable)
            lines.append(f"kill -s KILL <pid> of one {role} worker ({how}); hold {observe_s:.0f} s; back: {back}")
        else:
            how = "; ".join(f"{w.name} on {w.host}: {locator(w, 'hang_process')}" for w in names)
            lines.append(f"kill -s STOP <pid> of one {role} worker ({how}); hold {hang_s:.0f} s; kill -s CONT <pid>")
    return lines


def victims(workers: Sequence[Any], steps: Sequence[tuple[str, str]], seed: int) -> list[Any]:
    """The worker each step faults: per (kind, role), a seeded round through every candidate before
    any is faulted again (N kills on N workers, not a random pick that hit one worker twice in 8)."""
    rng, turns, out = random.Random(seed), {}, []
    for kind, role in steps:
        if not turns.get((kind, role)):
            specs = [w for w in workers if str(w.role) == role and (kind == "process_hang" or w.restartable)]
            turns[(kind, role)] = rng.sample(specs, len(specs))
        out.append(turns[(kind, role)].pop(0))
    return out


def run_faults(cluster: Any, faults: Any, steps: Sequence[tuple[str, str]], *, seed: int, hang_s: float = HANG_S,
               observe_s: float = 5.0, before_each: Callable[[], None] | None = None,
               rejoin_limit_s: float | None = None, nudge_traffic: bool = False,
               after_inject: Callable[[ClientFault], None] | None = None) -> BlackboxRun:
    """Inject, hold and revert each planned fault in turn, each victim back before the next fault
    (see the module doc); ``rejoin_limit_s`` defaults to the checklist's 6.1.4 ``rejoin_limit_s``;
    ``nudge_traffic``: no load runs, so the rejoin watch sends its own small requests through the API
    (a worker is back when traffic runs through it: without traffic that cannot be seen);
    ``after_inject``: called with each fault as soon as it is injected and verified (an open-loop probe
    of new requests starts there)."""
    limit = (cluster.thresholds.threshold("6.1.4", "rejoin_limit_s").value
             if rejoin_limit_s is None else rejoin_limit_s)
    out = BlackboxRun()
    executor_for = faults.executor_factory
    for i, ((kind, role), spec) in enumerate(zip(steps, victims(cluster.workers, steps, seed))):
        if before_each is not None:
            before_each()
        target: InventoryWorker = resolve([spec], executor_for,
                                          which="process" if kind == "process_kill" else "hang_process")[0]
        watch = RejoinWatch.for_worker(cluster, spec, limit, restarted=kind == "process_kill",
                                       nudge=_small_request(cluster) if nudge_traffic else None)
        if kind == "process_kill":
            restarted = NewProcess(spec, target, executor_for(target.host))
            fault = ProcessKill.from_worker(target.as_target(), restart_cmd=target.restart_cmd,
                                            supervised=target.supervised, healthy_url=target.health_url,
                                            healthy=restarted.answers, rejoined=watch.hook,
                                            healthy_timeout_s=RESTART_TIMEOUT_S)
            hold = observe_s
        else:
            fault = ProcessHang.from_worker(target.as_target())
            hold = hang_s
        faults.inject(fault)
        injected = next(r for r in faults.records if r.fault_id == fault.fault_id and r.action.value == "inject")
        label = f"{'kill' if kind == 'process_kill' else 'hang'} {target.id}"
        out.faults.append(ClientFault(injected.started_wall, (target.id,), role, label, inject_s=injected.duration_s))
        if after_inject is not None:
            after_inject(out.faults[-1])
        time.sleep(hold)  # the cluster must cope by itself for this long: the measurement window
        t_revert = time.monotonic()
        faults.revert(fault)  # a kill's revert: restarted, healthy as a new process, then watched (its hook)
        if kind == "process_kill":
            out.restart_s.append(round((watch.healthy_mono or time.monotonic()) - t_revert, 2))
        elif wait_healthy(target.health_url, RESTART_TIMEOUT_S) is None:
            raise FaultError(f"{target.id} does not answer {target.health_url} after its hang was reverted",
                             fix="check the worker's log")
        try:
            rejoin = watch.wait(limit) if watch.result is None else watch.result
            if rejoin.observable and not rejoin.back:  # a finding already; how long past it, outside the revert
                rejoin = watch.wait(max(REJOIN_WATCH_MAX_S, limit) - rejoin.watched_s)
        finally:
            watch.close()   # its probe of the worker, if one still waits
        out.rejoins.append((label, rejoin))
        if rejoin.observable and not rejoin.back and i + 1 < len(steps):
            rest = ", ".join(f"{'kill' if k == 'process_kill' else 'hang'} {r}" for k, r in steps[i + 1:])
            out.stopped = (f"stopped after {label}: {rejoin.sentence()}; not injected: {rest} (they would fault a "
                           "cluster that is not whole)")
            log.warning("%s", out.stopped)
            break
    return out


def _small_request(cluster: Any) -> Callable[[], None]:
    """One short completion through the cluster's API per call (its outcome is not judged: it only
    gives the router something to send through the restarted worker)."""
    from harness.errors import HarnessError
    from harness.probes.client.streaming import CompletionRequest

    def send() -> None:
        try:
            with cluster.streaming_client(read_timeout_s=10.0) as client:
                client.send(CompletionRequest(prompt="Are you back?", max_tokens=2))
        except HarnessError as exc:
            log.info("rejoin probe request: %s", exc)
    return send


__all__ = ["BlackboxRun", "HANG_S", "REJOIN_WATCH_MAX_S", "describe_plan", "plan", "run_faults", "victims",
           "without_survivor"]
