"""Faults fanned out: one fault kind on every target a selector picks, in parallel, each reverted on
its own (docs/faults.md, "Faults fanned out").

    plan = plan_fanout(cluster, "process_kill", Selector.parse("percent:25", roles=["aggregated"]), seed=0)
    print("\\n".join(plan.lines()))             # what --dry-run prints; nothing contacted
    with fanned_out(runner, cluster, plan) as fan:  # injected and verified on every target, or none
        ...                                        # held
    # every target reverted (in parallel) and its revert verified, however the block ended

Order of things, so a refusal never leaves anything behind: the selector is resolved on the
cluster file's inventory, the fault kind checked against ``safety.allowed_faults`` and the selection
against ``safety.blast_radius``, all before any host is contacted. Then each target's job runs on a
bounded pool (``max_parallel`` in all, ``max_per_host`` per host: sshd's default ``MaxSessions``
is 10 channels per connection): it finds the worker's process on its host (pid file, pgrep or
systemd, through that host's executor: audited), then the runner writes the target's own ledger
entry and injects and verifies it. When one target fails (its SSH refused, its process gone), no
job not yet started starts, the ones injected are reverted and the error names the failing
target and its host.

Why threads over the existing executors rather than asyncssh: every command must go through
``harness.hosts`` (the audit log, strict host keys, the executor spec the ledger stores for a later
``python -m harness revert``); a second SSH stack would duplicate all three. The pool is bounded,
and one paramiko connection per host carries all of that host's channels, so 125 hosts at
``max_parallel`` 32 is 32 threads and 125 connections, not a thread per host.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from harness.errors import ConfigError, FaultError, HarnessError, RevertError
from harness.faults.base import Fault
from harness.faults.blast_radius import check_blast_radius
from harness.faults.process import ProcessHang, ProcessKill
from harness.faults.runner import FaultRunner
from harness.faults.selectors import Candidate, Selection, Selector, candidates_from_inventory
from harness.hosts import Executor
from harness.probes.workers.inventory import InventoryWorker, locate_pid, resolve, wait_healthy

FANOUT_KINDS = ("process_kill", "process_hang")
MAX_PARALLEL = 16
MAX_PER_HOST = 8            # below sshd's default MaxSessions (10) on the one connection per host
RESTART_TIMEOUT_S = 120.0   # a killed worker's way back: a mocker process is back in about 1 s here

# (candidate, its host's executor) -> the fault for that target; commands it runs are audited
FaultBuilder = Callable[[Candidate, Executor], Fault]


@dataclass(frozen=True)
class FanOutPlan:
    """What a fan-out will do, resolved and checked before anything is touched."""

    cluster: str
    kind: str
    selection: Selection
    blast: tuple[str, ...]
    safety: str
    refused: str | None = None  # a dry run's plan that a real run would refuse: why

    @property
    def targets(self) -> tuple[Candidate, ...]:
        return self.selection.chosen

    def lines(self) -> list[str]:
        """The dry run: selector, targets, blast radius, safety, and per target how it is hit and back."""
        out = [f"fan-out {self.kind} on cluster {self.cluster}: {self.safety}", *self.selection.lines(), *self.blast]
        out += [f"  {self.kind} {c.name}: {how_line(self.kind, c.source)}" for c in self.targets
                if c.source is not None and not isinstance(c.source, dict)]
        return out


@dataclass
class FanOut:
    """A fan-out in progress: its faults (all injected and verified) and how long each phase took."""

    plan: FanOutPlan
    faults: list[Fault] = field(default_factory=list)
    inject_s: float = 0.0
    revert_s: float | None = None


def plan_fanout(cluster: Any, kind: str, selector: Selector, *, seed: int = 0,
                candidates: Sequence[Candidate] | None = None, active_faults: Sequence[Any] = (),
                dry_run: bool = False) -> FanOutPlan:
    """Resolve and check a fan-out (kind, safety, selector, blast radius); contacts nothing.
    ``candidates`` default to the cluster file's workers; ``active_faults`` (the runner's) count
    toward the blast radius. A dry run reports a refusal by safety instead of raising it."""
    if kind not in FANOUT_KINDS:
        raise ConfigError(f"fault kind {kind!r} cannot be fanned out over the inventory",
                          fix=f"use one of {', '.join(FANOUT_KINDS)}")
    spec = cluster.spec
    safety, refused = "allowed by safety", None
    try:
        spec.safety.check_allowed(kind, spec.name)
    except FaultError as exc:
        if not dry_run:
            raise
        safety, refused = f"REFUSED by safety ({exc.message})", str(exc)
    inventory = list(candidates) if candidates is not None else candidates_from_inventory(spec)
    selection = selector.select(inventory, seed)
    if kind == "process_kill":
        no_way_back = [c.name for c in selection.chosen if not isinstance(c.source, dict)
                       and not getattr(c.source, "restartable", True)]
        if no_way_back:
            raise ConfigError(f"process_kill would leave {', '.join(no_way_back)} down: no `restart:` and not "
                              "`supervised: true` in the cluster file",
                              fix="give each worker a way back, or fan out process_hang, or filter them out")
    try:
        blast = check_blast_radius(selection.chosen, inventory, spec.safety.blast_radius, cluster=spec.name,
                                   active_faults=active_faults)
    except FaultError as exc:
        if not dry_run:
            raise
        blast, refused = [f"blast radius: REFUSED: {exc}"], refused or str(exc)
    return FanOutPlan(spec.name, kind, selection, tuple(blast), safety, refused)


def fan_out(runner: FaultRunner, cluster: Any, plan: FanOutPlan, *, max_parallel: int = MAX_PARALLEL,
            max_per_host: int = MAX_PER_HOST, build: FaultBuilder | None = None) -> FanOut:
    """Inject ``plan``'s fault on all its targets in parallel (see the module doc); they stay until
    :func:`revert_fanout` (or the runner's exit) reverts them. ``build`` makes each target's fault
    (default: a process fault on the cluster file's worker, its pid found on its host now)."""
    del cluster  # the plan holds what was resolved from it; kept so the call reads like plan_fanout's
    if max_per_host < 1:
        raise ConfigError(f"max_per_host must be >= 1, got {max_per_host}", fix="pass e.g. max_per_host=8")
    if runner.dry_run or plan.refused:
        raise FaultError(f"this plan is not run: {plan.refused or 'a dry run prints it'}",
                         fix="make the plan without dry_run and fix what it refused")
    make = build or inventory_fault(plan.kind)
    gates: dict[str, threading.BoundedSemaphore] = {
        host: threading.BoundedSemaphore(max_per_host) for host in {c.host for c in plan.targets}}

    def job_for(c: Candidate) -> Callable[[Callable[[Fault], Fault]], Fault]:
        def job(inject: Callable[[Fault], Fault]) -> Fault:
            with gates[c.host]:
                try:
                    return inject(make(c, runner.executor_factory(c.host)))
                except HarnessError as exc:  # name the target and its host whatever step failed
                    cls = RevertError if isinstance(exc, RevertError) else FaultError
                    raise cls(f"{c.name} on host {c.host}: {exc.message}", fix=exc.fix) from exc
        return job

    t0 = time.monotonic()
    faults = runner.inject_many(plan.kind, [job_for(c) for c in plan.targets], max_parallel=max_parallel)
    return FanOut(plan, faults, inject_s=time.monotonic() - t0)


def revert_fanout(runner: FaultRunner, fan: FanOut, *, max_parallel: int = MAX_PARALLEL) -> None:
    """Revert every fault of ``fan`` in parallel and verify each revert (RevertError after all tried)."""
    t0 = time.monotonic()
    try:
        runner.revert_many(fan.faults, max_parallel=max_parallel)
    finally:
        fan.revert_s = time.monotonic() - t0


@contextlib.contextmanager
def fanned_out(runner: FaultRunner, cluster: Any, plan: FanOutPlan, *, max_parallel: int = MAX_PARALLEL,
               max_per_host: int = MAX_PER_HOST, build: FaultBuilder | None = None) -> Iterator[FanOut]:
    """:func:`fan_out` for the duration of a ``with`` block, reverted in parallel however it ends."""
    fan = fan_out(runner, cluster, plan, max_parallel=max_parallel, max_per_host=max_per_host, build=build)
    try:
        yield fan
    finally:
        revert_fanout(runner, fan, max_parallel=max_parallel)


def inventory_fault(kind: str, *, restart_timeout_s: float = RESTART_TIMEOUT_S) -> FaultBuilder:
    """The default builder: the cluster file's worker with its process found on its host now (an
    admin API worker dict already has its pid). A kill comes back through the worker's restart
    command or its supervisor, and is back when a new process answers its health URL."""
    def build(c: Candidate, ex: Executor) -> Fault:
        if isinstance(c.source, dict):
            worker = c.source
            return (ProcessHang.from_worker(worker) if kind == "process_hang"
                    else ProcessKill.from_worker(worker, healthy_timeout_s=restart_timeout_s))
        target = resolve([c.source], lambda _host: ex, which="process" if kind == "process_kill" else "hang_process")[0]
        if kind == "process_hang":
            return ProcessHang.from_worker(target.as_target())
        return ProcessKill.from_worker(target.as_target(), restart_cmd=target.restart_cmd, supervised=target.supervised,
                                       healthy_url=target.health_url, healthy=NewProcess(c.source, target, ex).answers,
                                       healthy_timeout_s=restart_timeout_s)
    return build


@dataclass
class NewProcess:
    """ProcessKill's healthy hook for an inventory worker: it runs as a new process (not the killed
    pid) and its health URL answers 200."""

    spec: Any
    old: InventoryWorker
    ex: Any

    def answers(self, worker_id: str) -> bool:
        del worker_id  # the hook knows its worker
        try:
            pid = locate_pid(self.spec, self.ex)
        except FaultError:
            return False  # between the old process's exit and the new one's start
        return pid != self.old.pid and wait_healthy(self.old.health_url, 1.0) is not None


def locator(w: Any, which: str = "process") -> str:
    """How a worker's process is found on its host, as a command line."""
    p = (w.hang_process if which == "hang_process" else None) or w.process
    if p is None:
        return "no process: entry"
    return (f"pgrep -f {p.pgrep!r}" if p.pgrep else f"cat {p.pid_file}" if p.pid_file
            else f"systemctl show -p MainPID --value {p.systemd_unit}")


def how_line(kind: str, w: Any) -> str:
    """One dry-run line: how the worker's process is found, hit and brought back."""
    if kind == "process_hang":
        return f"on {w.host}: pid from `{locator(w, 'hang_process')}`; kill -s STOP <pid>; revert: kill -s CONT <pid>"
    back = f"run `{w.restart.command}`" if w.restart else "supervised (its service manager restarts it)"
    return (f"on {w.host}: pid from `{locator(w)}`; kill -s KILL <pid>; revert: {back}, then wait until a new "
            f"process answers {w.health or str(w.api).rstrip('/') + '/health'}")


__all__ = ["FANOUT_KINDS", "FanOut", "FanOutPlan", "FaultBuilder", "MAX_PARALLEL", "MAX_PER_HOST", "NewProcess",
           "fan_out", "fanned_out", "how_line", "inventory_fault", "locator", "plan_fanout", "revert_fanout"]
