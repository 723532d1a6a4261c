"""FaultRunner: the nemesis that owns the undo stack. Every injected fault is reverted, last in
first out, on every way out of the run: normal exit, failure, exception, Ctrl-C and SIGTERM; faults
left by a SIGKILLed run are reverted from the ledger by :meth:`FaultRunner.recover` (called on
entry) or by ``python -m harness revert``. A failed revert never stops the others; it raises
:class:`RevertError` once all have been tried (the harness maps it to exit code 4).

    with FaultRunner(Ledger.for_cluster("local"), ExecutorPool()) as runner:
        runner.inject(ProcessHang.from_worker(worker))       # reverted when the block ends
        with runner.active(ProcessKill.from_worker(other)):  # reverted when this block ends
            ...
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence, TextIO, TypeVar

from harness.errors import FaultError, HarnessError, RevertError
from harness.faults.base import Action, Fault, FaultRecord, RecordStatus
from harness.hosts import AuditLog, Executor, ExecutorFactory, ExecutorPool, executor_from_spec
from harness.faults.ledger import Ledger, LedgerStatus
from harness.faults.recovery import REVERT_PHASES as _REVERT_PHASES
from harness.faults.recovery import LedgerRecovery
from harness.signals import SignalOwner

log = logging.getLogger(__name__)

REVERT_RETRY_PAUSES_S = (1.0, 3.0)   # a failed revert is tried again after these pauses
# a fan-out job: given inject, it builds its fault, injects it through inject and returns it
FanOutJob = Callable[[Callable[[Fault], Fault]], Fault]
_T = TypeVar("_T")
_R = TypeVar("_R")


def _checked_kind(fault: Fault, kind: str) -> Fault:
    if fault.kind != kind:
        raise FaultError(f"a {kind} fan-out was handed a {fault.kind} fault ({fault.target})",
                         fix="fan out one fault kind at a time")
    return fault


def _parallel(fn: Callable[[_T], _R], items: list[_T], max_parallel: int) -> tuple[list[_R], list[BaseException]]:
    """``fn`` over ``items`` on a bounded pool: (results of those that returned, what the others raised)."""
    if not items:
        return [], []
    results: list[_R] = []
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=min(max_parallel, len(items)), thread_name_prefix="fanout") as pool:
        for future in [pool.submit(fn, item) for item in items]:
            exc = future.exception()
            if exc is None:
                results.append(future.result())
            else:
                errors.append(exc)
    return results, errors


@dataclass
class _Active:
    fault: Fault
    entry_id: str | None      # None in a dry run: nothing was written
    executor: Executor | None


class FaultRunner(LedgerRecovery):
    """Signals: the run's :class:`~harness.signals.SignalOwner` (``signals``) makes every change
    critical (a signal waits until the ledger, the stack and the target agree, then unwinds the
    block, which reverts everything). Without one, the owner installed in the process is used; with
    none installed and ``handle_signals``, the runner installs its own for its ``with`` block."""

    def __init__(self, ledger: Ledger, executor_factory: ExecutorFactory | None = None, *,
                 dry_run: bool = False, recover_on_enter: bool = True, handle_signals: bool = True,
                 signals: SignalOwner | None = None, audit: AuditLog | None = None,
                 out: TextIO | None = None, context: dict[str, Any] | None = None) -> None:
        self.ledger = ledger
        self.context = context  # what the targets belong to (harness.faults.runs.RunRecord.context)
        self.dry_run = dry_run
        self.audit = audit if audit is not None else AuditLog(ledger.path.parent / "audit.jsonl")
        self.executor_factory = executor_factory or ExecutorPool(audit=self.audit, dry_run=dry_run)
        if isinstance(self.executor_factory, ExecutorPool) and self.executor_factory.audit is None:
            self.executor_factory.use_audit(self.audit)  # every command is audited, even if the caller forgot
        self.recover_on_enter = recover_on_enter
        self.handle_signals = handle_signals
        self.records: list[FaultRecord] = []
        self.listeners: list[Callable[[FaultRecord], None]] = []
        self._out = out
        self._stack: list[_Active] = []
        self._lock = threading.RLock()
        self._emit_lock = threading.Lock()
        self._signals = signals
        self._own_signals: SignalOwner | None = None  # installed by __enter__ when no owner was
        self._unowned = SignalOwner()                  # never installed: its blocks only count

    # -- public API -------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> Fault:
        """Record, inject and verify ``fault``; it stays active until revert/revert_all/exit.
        If injection or verification fails, the fault is reverted at once and FaultError raised."""
        with self._lock, self._critical():
            if any(a.fault is fault for a in self._stack):
                raise FaultError(f"{fault.kind} on {fault.target} is already active",
                                 fix="revert it first, or create a new fault object")
            if self.dry_run:
                self._print_plan(fault, lambda phase: phase not in _REVERT_PHASES)
                self._stack.append(_Active(fault, None, None))
                for action in (Action.INJECT, Action.VERIFY):
                    self._emit(FaultRecord.start(fault, action).finish(RecordStatus.DRY_RUN, "dry run"))
                return fault
            return self._inject_unlocked(fault)

    def _inject_unlocked(self, fault: Fault) -> Fault:
        """inject's work once the caller holds the lock and a critical section (inject_many's
        threads run it while their caller holds both for them)."""
        ex = self.executor_factory(fault.host)
        prepared = fault.prepare(ex)
        if prepared:
            log.info("%s %s: %s", fault.kind, fault.target, prepared)
        active = _Active(fault, self.ledger.add(fault.to_ledger(), ex.spec(), self.context), ex)
        self._stack.append(active)
        try:
            self._step(fault, Action.INJECT, fault.inject, ex)
            self.ledger.update(active.entry_id, LedgerStatus.ACTIVE)  # type: ignore[arg-type]
            self._step(fault, Action.VERIFY, fault.verify, ex)
        except BaseException as exc:
            # possibly half-injected: undo now instead of running the test against an unknown state
            error = self._revert_active(active)
            if error is not None:
                raise RevertError(f"{fault.kind} on {fault.target} failed ({exc}) and its revert failed "
                                  f"too: {error}", fix=self._revert_fix()) from exc
            if isinstance(exc, HarnessError) or not isinstance(exc, Exception):
                raise
            raise FaultError(f"{fault.kind} on {fault.target} failed: {exc} (reverted)") from exc
        return fault

    def inject_many(self, kind: str, jobs: Sequence[Fault | FanOutJob], *, max_parallel: int = 16) -> list[Fault]:
        """Inject faults of one ``kind`` in parallel, at most ``max_parallel`` at a time (see
        :mod:`harness.faults.fanout`): each has its own ledger entry and is verified as ``inject``
        does. All or none: when any fails, no job not yet started starts, the ones injected are
        reverted (in parallel) and FaultError names every target that failed. A job is a Fault or a
        callable that builds its fault (finding a pid on its host, say) and hands it to the
        ``inject`` it is given, so building runs in the pool too."""
        if max_parallel < 1:
            raise FaultError(f"max_parallel must be >= 1, got {max_parallel}", fix="pass e.g. max_parallel=16")
        with self._lock, self._critical():
            if self.dry_run:  # prints each plan; a dry run contacts no host, so nothing runs in parallel
                return [self.inject(_checked_kind(job if isinstance(job, Fault) else job(lambda f: f), kind))
                        for job in jobs]
            stop = threading.Event()

            def run(job: Fault | FanOutJob) -> Fault | None:
                if stop.is_set():
                    return None  # another target failed first: this one is never touched
                try:
                    if isinstance(job, Fault):
                        return self._inject_unlocked(_checked_kind(job, kind))
                    return job(lambda fault: self._inject_unlocked(_checked_kind(fault, kind)))
                except BaseException:
                    stop.set()
                    raise

            injected, errors = _parallel(run, list(jobs), max_parallel)
            done = [f for f in injected if f is not None]
            if not errors:
                return done
            failed = "; ".join(str(e) for e in errors)
            undo = self._revert_group(done, max_parallel)
            if undo:
                raise RevertError(f"{kind} fan-out: {len(errors)} target(s) failed ({failed}) and {len(undo)} of the "
                                  f"{len(done)} injected could not be reverted: " + "; ".join(undo),
                                  fix=self._revert_fix())
            raise FaultError(f"{kind} fan-out: {len(errors)} of {len(jobs)} target(s) failed: {failed}; the "
                             f"{len(done)} injected were reverted, {len(jobs) - len(done) - len(errors)} never "
                             "touched", fix="fix the failing target(s) (each is named above) and run it again")

    def revert_many(self, faults: Sequence[Fault], *, max_parallel: int = 16) -> None:
        """Revert these active faults in parallel (a fan-out's targets are distinct, so their order
        does not matter); RevertError once all have been tried."""
        with self._lock, self._critical():
            errors = self._revert_group(faults, max_parallel)
        if errors:
            raise RevertError(f"{len(errors)} of {len(faults)} revert(s) failed; the cluster may be dirty: "
                              + "; ".join(errors), fix=self._revert_fix())

    def _revert_group(self, faults: Sequence[Fault], max_parallel: int) -> list[str]:
        group = [a for a in list(self._stack) if any(a.fault is f for f in faults)]
        results, crashed = _parallel(self._revert_active, group, max(1, max_parallel))
        return [e for e in results if e is not None] + [str(e) for e in crashed]

    def revert(self, fault: Fault) -> None:
        """Revert one active fault now (idempotent: a fault no longer active is ignored)."""
        with self._lock, self._critical():
            active = next((a for a in self._stack if a.fault is fault), None)
            if active is None:
                return
            error = self._revert_active(active)
        if error is not None:
            raise RevertError(error, fix=self._revert_fix())

    def revert_all(self) -> None:
        """Revert every active fault, newest first; raise RevertError after trying them all."""
        errors = []
        with self._lock, self._critical():
            while self._stack:
                error = self._revert_active(self._stack[-1])
                if error is not None:
                    errors.append(error)
        if errors:
            raise RevertError(f"{len(errors)} revert(s) failed; the cluster may be dirty: " + "; ".join(errors),
                              fix=self._revert_fix())

    @contextlib.contextmanager
    def active(self, fault: Fault) -> Iterator[Fault]:
        """Inject for the duration of a ``with`` block, revert when it ends, however it ends."""
        self.inject(fault)
        try:
            yield fault
        finally:
            self.revert(fault)

    @property
    def active_faults(self) -> list[Fault]:
        return [a.fault for a in self._stack]

    def _say(self, line: str) -> None:
        print(line, file=self._out or sys.stdout, flush=True)

    # -- context manager and signals --------------------------------------------------------------

    def __enter__(self) -> FaultRunner:
        if self._signals is None and self.handle_signals and SignalOwner.current() is None:
            self._own_signals = SignalOwner().install()
        try:
            if self.recover_on_enter:
                self.recover()
        except BaseException:
            self._release_signals()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            self.revert_all()   # critical: a signal waits for the reverts, then unwinds the caller
        finally:
            self._release_signals()
            if isinstance(self.executor_factory, ExecutorPool):
                self.executor_factory.close()

    def _release_signals(self) -> None:
        if self._own_signals is not None:
            self._own_signals.restore()
            self._own_signals = None

    @property
    def signals(self) -> SignalOwner:
        """The owner whose critical blocks guard this runner's changes."""
        return self._signals or SignalOwner.current() or self._unowned

    def _critical(self) -> contextlib.AbstractContextManager[None]:
        """Ledger, stack and target must agree: a signal waits until the section ends."""
        return self.signals.critical()

    # -- internals --------------------------------------------------------------------------------

    def _revert_entry(self, fault: Fault, entry_id: str, ex: Executor) -> str | None:
        """Revert a fault a ledger entry holds (:meth:`recover`) as if it were on the stack."""
        return self._revert_active(_Active(fault, entry_id, ex))

    def _revert_active(self, active: _Active) -> str | None:
        """Revert and verify one fault; update the ledger; return an error message or None."""
        fault = active.fault
        with contextlib.suppress(ValueError):
            self._stack.remove(active)
        if self.dry_run or active.executor is None:
            self._print_plan(fault, lambda phase: phase in _REVERT_PHASES)
            for action in (Action.REVERT, Action.VERIFY_REVERTED):
                self._emit(FaultRecord.start(fault, action).finish(RecordStatus.DRY_RUN, "dry run"))
            return None
        try:
            self._revert_steps(fault, active.executor)
        except Exception as exc:  # any failure is reported; the next revert still runs
            # the step's own fix goes first in the run's one fix line (RevertError), not twice
            own = getattr(exc, "message", None) if isinstance(exc, HarnessError) else None
            message = f"{fault.kind} on {fault.target}: {own if own is not None else exc}"
            if own is not None and exc.fix:  # type: ignore[attr-defined]
                message += f" (first: {exc.fix})"  # type: ignore[attr-defined]
            log.error("revert failed: %s", message)
            if active.entry_id is not None:
                self.ledger.update(active.entry_id, LedgerStatus.REVERT_FAILED, error=str(exc))
            return message
        if active.entry_id is not None:
            self.ledger.update(active.entry_id, LedgerStatus.REVERTED)
        return None

    def _revert_steps(self, fault: Fault, ex: Executor) -> None:
        """Revert and verify, again after a pause when a step fails (a command that timed out on a
        host busy with a fan-out, a process slow to resume): a revert is idempotent (recovery
        replays it from the ledger), and one left undone is a dirty cluster. Every attempt is
        recorded; the last one's error is what the caller reports."""
        for attempt, pause in enumerate((*REVERT_RETRY_PAUSES_S, None), 1):
            try:
                self._step(fault, Action.REVERT, fault.revert, ex)
                self._step(fault, Action.VERIFY_REVERTED, fault.verify_reverted, ex)
                return
            except Exception as exc:
                if pause is None:
                    raise
                log.warning("revert of %s on %s failed (attempt %d of %d), again in %.0f s: %s", fault.kind,
                            fault.target, attempt, len(REVERT_RETRY_PAUSES_S) + 1, pause, exc)
                time.sleep(pause)

    def _step(self, fault: Fault, action: Action, fn: Callable[[Executor], str], ex: Executor) -> str:
        record = FaultRecord.start(fault, action)
        try:
            output = fn(ex) or ""
        except BaseException as exc:
            self._emit(record.finish(RecordStatus.FAILED, error=f"{type(exc).__name__}: {exc}"))
            raise
        self._emit(record.finish(RecordStatus.SUCCEEDED, output))
        log.info("%s %s %s: %s", fault.kind, action.value, fault.target, output)
        return output

    def _emit(self, record: FaultRecord) -> None:
        with self._emit_lock:  # inject_many's threads emit too; listeners need not be thread-safe
            self.records.append(record)
            for listener in self.listeners:
                listener(record)

    def _print_plan(self, fault: Fault, phases: Callable[[str], bool]) -> None:
        out = self._out or sys.stdout
        for line in fault.plan():
            if phases(line.split(":", 1)[0]):
                print(f"[dry-run] {fault.kind} {fault.target}: {line}", file=out, flush=True)
                self.audit.write(host=fault.host, argv=None, action=line, rc=None, duration=0.0, dry_run=True)

    def _revert_fix(self) -> str:
        return (f"fix the cause, then run `python -m harness revert --state-dir {self.ledger.path.parent}` "
                "(it retries every entry still in the ledger)")
