"""6.1.4 on a cluster without router events: the inventory's workers killed and hung under one load
run (harness/probes/blackbox_faults.py does each fault, each victim back in the cluster's traffic
before the next), the load kept running after the last fault until a request sent after it was
served, then finished. :class:`BlackboxRescheduleUnderLoad` returns the request records and the
fault run for harness/checks/reschedule_blackbox.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from harness.errors import ProbeError
from harness.faults import FaultRunner
from harness.scenarios import blackbox_faults as blackbox
from harness.probes.load import LoadRunner
from harness.probes.records import RequestRecord
from harness.scenarios.fault_marks import first_success_sent_after
from harness.scenarios.reschedule import StartLoad, wait_serving
from harness.waiting import wait_until

log = logging.getLogger(__name__)

LOAD_MAX_S = 3600.0  # upper bound of the load run; it is finished after the last fault
# after the last fault's revert the load goes on until a request sent after that fault was served (what
# 6.1.4 measures has had its chance), at most this long: one client-view fault window
TAIL_S = 30.0


@dataclass
class BlackboxRescheduleRun:
    faults: blackbox.BlackboxRun     # the fault marks, restarts, rejoins and why the plan stopped early
    records: list[RequestRecord]     # every request of the load run
    load_run: LoadRunner


@dataclass
class BlackboxRescheduleUnderLoad:
    """The ``steps`` ((kind, role) pairs) on the inventory of ``cluster`` (the session's
    ClusterHandle: its workers, their restart and health hooks, its API for the rejoin watch)."""

    cluster: Any
    faults: FaultRunner
    start_load: StartLoad
    steps: Sequence[tuple[str, str]]
    seed: int
    observe_s: float          # how long each fault is held: the cluster must cope alone for this long
    rejoin_limit_s: float
    load_s: float = LOAD_MAX_S
    max_tokens: int = 32

    def run(self) -> BlackboxRescheduleRun:
        run = self.start_load(duration_s=self.load_s, max_tokens=self.max_tokens)
        try:
            wait_serving(run)
            done = blackbox.run_faults(self.cluster, self.faults, self.steps, seed=self.seed,
                                       observe_s=self.observe_s, rejoin_limit_s=self.rejoin_limit_s,
                                       before_each=lambda: None if run.running else _load_ended(run))
            _serve_after_last_fault(run, done.faults[-1].wall if done.faults else None)
        finally:
            records = run.finish() if run.running else run.wait()
        return BlackboxRescheduleRun(done, records, run)


def _serve_after_last_fault(run: LoadRunner, fault_wall: float | None) -> None:
    """Keep the load running until a request sent after the last fault was served (up to TAIL_S),
    so that "no request sent after the fault succeeded" is measured, not planned."""
    if fault_wall is None:
        return
    if not wait_until(lambda: not run.running or first_success_sent_after(run.records(), fault_wall) is not None,
                      TAIL_S, 1.0, what="a request sent after the last fault to be served", on_timeout="return"):
        log.warning("no request sent after the last fault was served within %.0f s", TAIL_S)


def _load_ended(run: LoadRunner) -> None:
    raise ProbeError(f"the load run ended before the faults were done (Locust log: {run.log_path})",
                     fix="raise --load-duration, or see the Locust log for why it stopped")
