"""What a conformance run (the pytest plugin) needs to survive its own exit paths:

- :class:`RunSignals`: SIGTERM anywhere in the run unwinds like Ctrl-C (every fixture tears down
  what it built: Locust, the cluster, its namespaces; the report is written; exit 3, or 4 if a
  revert failed) instead of dying with 143. Only the first signal interrupts: a second Ctrl-C
  while the run unwinds is noted, never raised into pytest's own handling of the first (which would
  kill the run with -2, without its report). Once the run is finishing (teardown, report), every
  signal is only noted.
- :func:`recover_before_bringup`: before a cluster starts, revert what its ledger holds, end what
  dead runs left running (a SIGSTOPped worker keeps its ports) and remove their namespaces.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Callable

from harness.faults.runner import FaultRunner, Terminated

log = logging.getLogger(__name__)


class RunSignals:
    def __init__(self) -> None:
        self.interrupted: int | None = None   # the signal that interrupted the run
        self.finishing = False
        self._previous: dict[int, Any] = {}

    @staticmethod
    def _main_thread() -> bool:
        return threading.current_thread() is threading.main_thread()

    def _set(self, handler: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(sig, handler)
            self._previous.setdefault(sig, previous)

    def install(self) -> None:
        """From collection on: the first SIGINT or SIGTERM interrupts the run, later ones are noted.
        ``interrupted`` also records an interrupt a fault runner raised, so the run's exit code says
        it was interrupted even when the KeyboardInterrupt itself got lost (Python ignores one raised
        inside a finalizer)."""
        FaultRunner.interrupt_listeners.append(self._runner_interrupted)
        if self._main_thread():
            self._set(self._on_signal)

    def _runner_interrupted(self, signum: int) -> None:
        if self.interrupted is None:
            self.interrupted = signum

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.interrupted is not None or self.finishing:
            log.warning("signal %s: the run already unwinds (signal %s); it tears down and reports first",
                        signum, self.interrupted)
            return
        self.interrupted = signum
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)

    def finish(self) -> None:
        """The run only tears down and writes its report from here on: signals are noted only."""
        self.finishing = True
        if self._main_thread():
            self._set(self._on_signal)

    def restore(self) -> None:
        """At the end of the run. A finished run ignores further signals: pytest returns its exit
        code right after, and a Ctrl-C in that last instant must not turn a reported exit 0 into
        -2 (Python resets Python-level handlers to the default while it shuts down; SIG_IGN stays)."""
        if self._runner_interrupted in FaultRunner.interrupt_listeners:
            FaultRunner.interrupt_listeners.remove(self._runner_interrupted)
        if self.finishing:
            if self._main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)
            return
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def recover_before_bringup(cluster_name: str, state_dir: str | Path | None = None,
                           say: Callable[[str], Any] = print, dry_run: bool = False) -> None:
    """Revert what the cluster's ledger still holds from dead runs, end their leftover processes
    and remove their namespaces, before anything starts. A revert that cannot be done raises
    RevertError (exit 4): the run does not start on a dirty cluster. ``dry_run``: only say what
    would be reverted (a dry run touches no host)."""
    from harness.faults.ledger import Ledger
    from harness.faults.runner import FaultRunner

    class _Say:
        def write(self, text: str) -> int:
            for line in text.splitlines():
                if line.strip():
                    say(line)
            return len(text)

        def flush(self) -> None:
            pass

    runner = FaultRunner(Ledger.for_cluster(cluster_name, state_dir), recover_on_enter=False,
                         handle_signals=False, out=_Say(), dry_run=dry_run)
    for rec in runner.recover():
        say(f"recovered {rec.kind} {rec.target}: {rec.action.value} {rec.status.value}"
            f"{': ' + rec.output if rec.output else ''}")


__all__ = ["RunSignals", "recover_before_bringup"]
