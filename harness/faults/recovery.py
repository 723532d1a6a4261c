"""Recovery from the ledger: what runs that died (SIGKILL, power loss) left is reverted, newest
first, by :meth:`LedgerRecovery.recover`, which :class:`~harness.faults.runner.FaultRunner` calls on
entry, before a cluster is brought up (harness/faults/session.py) and for ``python -m harness
revert``. Then the files the dead run's fault helpers left on their hosts (``/tmp/pdh-faults/<fault
id>.*``: a flap loop's log, a stale pid file) are removed, and what the dead runs left running is
ended (harness/faults/runs.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, TextIO

from harness.errors import HarnessError, RevertError
from harness.faults.base import Action, Fault, FaultRecord, RecordStatus
from harness.faults.ledger import Ledger, LedgerStatus
from harness.hosts import AuditLog, Executor, executor_from_spec

log = logging.getLogger(__name__)

REVERT_PHASES = ("revert", "verify_reverted")  # the plan lines of a revert (the rest inject)


class LedgerRecovery:
    """:class:`~harness.faults.runner.FaultRunner`'s recovery from the ledger (mixed into it: it
    uses the runner's ledger, audit log, lock, critical sections and revert steps)."""

    ledger: Ledger
    audit: AuditLog
    dry_run: bool
    records: list[FaultRecord]
    _out: TextIO | None
    _lock: threading.RLock
    _critical: Callable[[], Any]
    _say: Callable[[str], None]
    _emit: Callable[[FaultRecord], None]
    _print_plan: Callable[[Fault, Callable[[str], bool]], None]
    _revert_fix: Callable[[], str]
    _revert_entry: Callable[[Fault, str, Executor], "str | None"]

    def recover(self, *, include_live_owners: bool = False, clean_runs: bool = True) -> list[FaultRecord]:
        """Revert, newest first, what the ledger still holds from runs that died (SIGKILL, power
        loss). Entries of a harness that still runs are left to it unless include_live_owners.
        Then end what dead runs left running (stopped workers holding ports, routers, Locust) and
        their namespaces (harness.faults.runs). An entry whose bundled cluster is gone with its run
        is closed ``target_gone`` (checked, recorded in the audit log); a revert that cannot be
        done stays ``revert_failed`` and raises RevertError once everything was tried."""
        from harness.faults import runs

        start = len(self.records)
        errors: list[tuple[dict[str, Any], str]] = []
        with self._lock, self._critical():
            for entry in self.ledger.outstanding(include_live_owners=include_live_owners):
                error = self._recover_entry(entry, runs.target_gone(entry.get("context")))
                if error is not None:
                    errors.append((entry, error))
            if clean_runs:
                problems = runs.clean_dead_runs(self.ledger.path.parent, dry_run=self.dry_run, say=self._say)
                # a revert that failed because its run's cluster was dying: gone now, checked again
                errors = [(e, msg) for e, msg in errors
                          if not (e.get("context") and not self.dry_run
                                  and self._recover_entry(e, runs.target_gone(e.get("context")), retry=True) is None)]
                errors += [({}, p) for p in problems]
        if errors:
            raise RevertError(f"{len(errors)} ledger revert(s) failed; the cluster may be dirty: "
                              + "; ".join(msg for _, msg in errors), fix=self._revert_fix())
        return self.records[start:]

    def _recover_entry(self, entry: dict[str, Any], gone: str | None, retry: bool = False) -> str | None:
        if not retry:
            log.warning("%s fault %s (%s) left %s by pid %s", "would revert" if self.dry_run else "reverting",
                        entry["id"], entry["fault"].get("kind"), entry["status"], entry.get("owner_pid"))
        if retry and gone is None:
            return "still failing"
        try:
            fault = Fault.from_ledger(entry["fault"])
            ex = executor_from_spec(entry["executor"], audit=self.audit, dry_run=self.dry_run, out=self._out)
        except HarnessError as exc:
            if not self.dry_run:
                self.ledger.update(entry["id"], LedgerStatus.REVERT_FAILED, error=str(exc))
            return f"ledger entry {entry['id']}: {exc}"
        try:
            if gone is not None:
                error = self._close_gone(fault, entry, gone)
                if error is None and not self.dry_run:
                    self._remove_helper_files(fault, ex)
                return error
            if self.dry_run:
                self._print_plan(fault, lambda phase: phase in REVERT_PHASES)
                return None
            error = self._revert_entry(fault, entry["id"], ex)
            if error is None:
                self._remove_helper_files(fault, ex)
            return error
        finally:
            ex.close()

    def _close_gone(self, fault: Fault, entry: dict[str, Any], why: str) -> str | None:
        """The fault's cluster is gone (checked): nothing is left to revert; close the entry."""
        record = FaultRecord.start(fault, Action.REVERT)
        if self.dry_run:
            self._say(f"[dry-run] {fault.kind} {fault.target}: would close as target_gone: {why}")
            self._emit(record.finish(RecordStatus.DRY_RUN, f"target gone: {why}"))
            return None
        self.audit.write(host=fault.host, argv=None, action=f"close {entry['id']} as target_gone", rc=0,
                         duration=0.0, dry_run=False, error=None, fault_id=fault.fault_id, kind=fault.kind,
                         status=LedgerStatus.TARGET_GONE.value, reason=why)
        self.ledger.update(entry["id"], LedgerStatus.TARGET_GONE, error=why)
        self._emit(record.finish(RecordStatus.SUCCEEDED, f"target gone: {why}"))
        log.warning("%s %s: closed as target_gone: %s", fault.kind, fault.target, why)
        return None

    def _remove_helper_files(self, fault: Fault, ex: Executor) -> None:
        """A dead run's entry is closed: remove what its fault helper left on the host (only this
        fault's files; a helper whose pid still lives keeps them), and say so in the audit log."""
        from harness.faults.host_loop import remove_leftovers

        try:
            said = remove_leftovers(ex, fault.fault_id)
        except HarnessError as exc:
            said = f"could not remove its helper files: {exc}"
        if said:
            log.warning("%s %s: %s", fault.kind, fault.target, said)
            self.audit.write(host=fault.host, argv=None, action=said, rc=0, duration=0.0, dry_run=False,
                             error=None, fault_id=fault.fault_id, kind=fault.kind)
