"""6.1.4 on a cluster without router events: the inventory's workers killed and hung under one load
run (harness/scenarios/blackbox_faults.py does each fault, each victim back in the cluster's traffic
before the next), the load kept running after the last fault until a request sent after it was
served, then finished. :class:`BlackboxRescheduleUnderLoad` returns the request records and the
fault run for harness/checks/reschedule_blackbox.py.

"A request sent after the fault was served" is measured by an **open-loop probe**
(:class:`NewRequestProbe`): from each fault on, its own small client sends one short request every
``PROBE_PERIOD_S`` through the cluster's API, each on its own thread, never waiting for an earlier
one nor for the load's users. The load's closed-loop users cannot measure it: when every one of them
is blocked on the hung worker none sends anything, and the first request sent after a hang was once
+5.4 s while a request sent 0.06 s after the stop got its first token at +0.09 s. The probe's
records join the load's (their ids start ``newreq-``), so they count for nothing-lost too.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from harness.errors import ProbeError
from harness.faults import FaultRunner
from harness.scenarios import blackbox_faults as blackbox
from harness.probes.loadgen.load import LoadRunner
from harness.probes.client.records import RequestRecord
from harness.probes.client.streaming import CompletionRequest
from harness.evidence.records import ClientFault
from harness.evidence.fault_marks import first_success_sent_after
from harness.scenarios.reschedule import StartLoad, wait_serving
from harness.waiting import wait_until

log = logging.getLogger(__name__)

LOAD_MAX_S = 3600.0  # upper bound of the load run; it is finished after the last fault
# after the last fault's revert the load goes on until a request sent after that fault was served (what
# 6.1.4 measures has had its chance), at most this long: one client-view fault window
TAIL_S = 30.0


PROBE_PERIOD_S = 0.15     # the open-loop probe's send interval from each fault on
PROBE_WINDOW_S = 30.0     # ...until a probe sent after the fault was served, at most this long (a fault window)
PROBE_MAX_IN_FLIGHT = 64  # more unanswered probes than this: the next wait for one to end (a hung cluster)


class NewRequestProbe:
    """The open-loop probe of new requests (module doc): :meth:`start` at each fault (it ends the
    previous fault's schedule), :meth:`close` at the end; :attr:`records` every probe sent."""

    def __init__(self, cluster: Any, *, period_s: float = PROBE_PERIOD_S, window_s: float = PROBE_WINDOW_S,
                 max_in_flight: int = PROBE_MAX_IN_FLIGHT) -> None:
        self.cluster, self.period_s, self.window_s = cluster, period_s, window_s
        self.records: list[RequestRecord] = []
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._stop: threading.Event | None = None
        self._threads: list[threading.Thread] = []

    def start(self, fault: ClientFault) -> None:
        self._end_schedule()
        stop, served = threading.Event(), threading.Event()
        self._stop = stop
        index = len(self._threads)
        t = threading.Thread(target=self._schedule, args=(fault, index, stop, served), name=f"newreq-{index}",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def sent(self) -> list[RequestRecord]:
        """The records of the probes that have ended so far."""
        with self._lock:
            return list(self.records)

    def close(self) -> list[RequestRecord]:
        """End the schedule and wait for the probes in flight (each ends by its own timeout)."""
        self._end_schedule()
        for t in self._threads:
            t.join()
        return self.sent()

    def _end_schedule(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _schedule(self, fault: ClientFault, index: int, stop: threading.Event, served: threading.Event) -> None:
        started, k, sends = time.monotonic(), 0, []
        until = started + self.window_s
        while not stop.is_set() and not served.is_set() and time.monotonic() < until:
            if self._slots.acquire(timeout=self.period_s):
                send = threading.Thread(target=self._send, args=(f"newreq-{index}-{k}", served), daemon=True)
                sends.append(send)
                send.start()
                k += 1
            stop.wait(max(0.0, started + k * self.period_s - time.monotonic()))
        for send in sends:
            send.join()

    def _send(self, request_id: str, served: threading.Event) -> None:
        try:
            with self.cluster.streaming_client(user="6.1.4-new-request-probe", timeout_s=self.window_s + 30,
                                               read_timeout_s=self.window_s + 30) as client:
                rec = client.send(CompletionRequest(prompt="A new request after the fault:", max_tokens=2),
                                  request_id=request_id)
            with self._lock:
                self.records.append(rec)
            if rec.ok and rec.first_token_ns is not None:
                served.set()
        finally:
            self._slots.release()


@dataclass
class BlackboxRescheduleRun:
    faults: blackbox.BlackboxRun     # the fault marks, restarts, rejoins and why the plan stopped early
    records: list[RequestRecord]     # every request: the load run's and the open-loop probe's
    load_run: LoadRunner
    probe_records: list[RequestRecord] = field(default_factory=list)   # the probe's alone (also in records)


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
        probe = NewRequestProbe(self.cluster)
        try:
            wait_serving(run)
            done = blackbox.run_faults(self.cluster, self.faults, self.steps, seed=self.seed,
                                       observe_s=self.observe_s, rejoin_limit_s=self.rejoin_limit_s,
                                       before_each=lambda: None if run.running else _load_ended(run),
                                       after_inject=probe.start)
            _serve_after_last_fault(run, done.faults[-1].wall if done.faults else None, probe)
        finally:
            try:
                records = run.finish() if run.running else run.wait()
            finally:
                probed = probe.close()
        return BlackboxRescheduleRun(done, records + probed, run, probed)


def _serve_after_last_fault(run: LoadRunner, fault_wall: float | None, probe: NewRequestProbe) -> None:
    """Keep the load running until a request sent after the last fault was served (up to TAIL_S),
    so that "no request sent after the fault succeeded" is measured, not planned."""
    if fault_wall is None:
        return

    def served() -> bool:
        return first_success_sent_after(run.records() + probe.sent(), fault_wall) is not None

    if not wait_until(lambda: not run.running or served(),
                      TAIL_S, 1.0, what="a request sent after the last fault to be served", on_timeout="return"):
        log.warning("no request sent after the last fault was served within %.0f s", TAIL_S)


def _load_ended(run: LoadRunner) -> None:
    raise ProbeError(f"the load run ended before the faults were done (Locust log: {run.log_path})",
                     fix="raise --load-duration, or see the Locust log for why it stopped")
