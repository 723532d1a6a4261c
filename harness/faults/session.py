"""Before a cluster starts: :func:`recover_before_bringup` reverts what its ledger holds, ends what
dead runs left running (a SIGSTOPped worker keeps its ports) and removes their namespaces. (A run's
signal handling lives in :mod:`harness.signals`.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


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

    from harness.hosts import state_dir as state_folder

    if dry_run and not (state_folder(state_dir) / f"faults-{cluster_name}.json").exists():
        return   # nothing recorded to revert; a dry run writes nothing (a ledger would make its folder and lock)
    runner = FaultRunner(Ledger.for_cluster(cluster_name, state_dir), recover_on_enter=False, handle_signals=False,
                         out=_Say(), dry_run=dry_run)
    for rec in runner.recover():
        say(f"recovered {rec.kind} {rec.target}: {rec.action.value} {rec.status.value}"
            f"{': ' + rec.output if rec.output else ''}")


__all__ = ["recover_before_bringup"]
