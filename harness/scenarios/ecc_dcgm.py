"""Item ecc on a real cluster: a double-bit ECC error injected into one worker's GPU monitoring
through DCGM (harness/faults/dcgm.py) under load, the worker watched until it drains (its health URL
leaves 200, or its running-requests gauge stays at 0 while the load keeps arriving), then the
healthy value restored and its return watched (evidence only).

:class:`DcgmDrainUnderLoad` returns the :class:`Injection` (every poll, when and how the worker
drained) and the load's records for harness/checks/ecc_dcgm.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from harness.clusterfile.models import Worker
from harness.errors import FaultError
from harness.evidence.ecc_dcgm import QUIET_S, Injection  # noqa: F401
from harness.faults import DcgmInject, FaultRunner
from harness.probes.workers.inventory import is_healthy
from harness.probes.loadgen.load import LoadRunner
from harness.probes.metrics.prometheus import parse_metrics
from harness.probes.client.records import RequestRecord
from harness.scenarios.fault_marks import injection
from harness.scenarios.reschedule import StartLoad
from harness.waiting import wait_until

POLL_S = 0.5
COME_BACK_S = 60.0     # after the revert, how long the worker's return is watched (evidence only)
FIRST_REQUEST_S = 120.0  # the load must complete a request before the injection


@dataclass
class DcgmDrainRun:
    records: list[RequestRecord]
    load_run: LoadRunner
    injection: Injection | None = None   # None: the injection could not be made (``not_made`` says why)
    not_made: str | None = None


@dataclass
class DcgmDrainUnderLoad:
    """One injection into ``worker``'s first GPU (its host's ``dcgmi``), held ``budget_s`` + 10 s;
    ``running_family``: the engine profile's running-requests gauge (None: the gauge is not read)."""

    worker: Worker
    dcgmi: str
    budget_s: float
    faults: FaultRunner
    start_load: StartLoad
    running_family: str | None
    auth_headers: dict[str, str]
    load_s: float | None = None   # default: the budget, the come-back watch and a minute

    def __post_init__(self) -> None:
        w = self.worker
        self.fault = DcgmInject(host=w.host, gpu=w.gpus[0], field_name="ecc_dbe_volatile", value=1,
                                hold_s=self.budget_s + 10, dcgmi=self.dcgmi, worker=w.name)

    @property
    def plan(self) -> list[str]:
        return [f"under load: {line}" for line in self.fault.plan()]

    @property
    def drain_visible(self) -> bool:
        """A drain can be seen: a health URL, or metrics with a running-requests gauge."""
        return bool(self.worker.health or (self.worker.metrics and self.running_family))

    def rehearse(self) -> None:
        """A dry run: the fault runner prints the injection's plan; nothing is sent."""
        self.faults.inject(self.fault)
        self.faults.revert_all()

    def run(self) -> DcgmDrainRun:
        run = self.start_load(duration_s=self.load_s or self.budget_s + COME_BACK_S + 60, max_tokens=128)
        wait_until(lambda: run.records_path.exists() and run.records_path.stat().st_size > 0, FIRST_REQUEST_S,
                   0.1, what="the load to complete a request")
        ran_before = bool(self._running()) if self.running_family and self.worker.metrics else True
        try:
            self.faults.inject(self.fault)
        except FaultError as exc:  # e.g. the host has no DCGM after all: say so, never crash the run
            return DcgmDrainRun(run.finish(), run, not_made=str(exc))
        w, fault = self.worker, self.fault
        rec = injection(self.faults, fault)
        t0 = time.monotonic()  # inject and verify returned: the host's first dcgmi injection succeeded
        inj = Injection(w.name, w.host, w.gpus[0], fault.field_name, fault.value, rec.started_wall,
                        effect_window_s=round(max(0.0, t0 - rec.started_mono), 3))
        # poll until drained, or once past the budget (then "not drained within it" is certain)
        while inj.drained_after_s is None and run.running:
            t = time.monotonic() - t0
            health, running = self._health(), self._running()
            inj.observe(t, health, running, ran_before, answered=time.monotonic() - t0)
            if t > self.budget_s:
                break
            time.sleep(POLL_S)
        self.faults.revert(fault)
        if w.health:
            health_url = w.health
            t1 = time.monotonic()
            if wait_until(lambda: is_healthy(health_url), COME_BACK_S, POLL_S, what=f"{w.name} healthy again",
                          on_timeout="return"):
                inj.back_after_s = round(time.monotonic() - t1, 2)
        return DcgmDrainRun(run.finish(), run, inj)

    def _running(self) -> float | None:
        """The worker's running-requests gauge; None when it is not read or the scrape failed."""
        if not (self.worker.metrics and self.running_family):
            return None
        try:
            resp = httpx.get(self.worker.metrics, timeout=5, headers=self.auth_headers)
            return sum(x.value for x in parse_metrics(resp.text) if x.name == self.running_family)
        except (httpx.HTTPError, ValueError):
            return None

    def _health(self) -> int | None:
        if not self.worker.health:
            return None
        try:
            return httpx.get(self.worker.health, timeout=5).status_code
        except httpx.HTTPError:
            return 0  # not answering at all: out of service too
