"""The Locust side of a load run: an LLM user, the open-loop arrival dispatcher and the
controller that ends the run. Import this only inside the Locust process (importing
locust monkey-patches the standard library with gevent).

Locust's own statistics get TTFT as the response time so its console summary means
something, but the truth is the JSONL record of every request (Locust rounds response
times and, with ``stream=True``, would time only to the response headers).
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import gevent
import gevent.event
from locust import User, constant, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import MasterRunner, Runner, WorkerRunner

from harness.errors import ProbeError
from harness.probes.client.records import NOT_SENT, RecordWriter, RequestRecord, process_anchor
from harness.probes.client.request_shape import request_shape
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from harness.probes.loadgen.workload import LoadProfile, arrival_offsets, make_requests, worker_records_path
from harness.waiting import wait_until

log = logging.getLogger(__name__)


class LoadController:
    """Shared state of one Locust process: when the run starts and stops, which arrival
    or prompt comes next, how many requests are in flight, and where records go.

    Single process (``processes == 1``): this process ends the run itself. Multi-process
    (Locust's ``--processes``: a master and N forked workers): worker k sends arrivals
    k, k+N, k+2N, ... of the one schedule and writes its own JSONL file; the master ends
    the run. The locustfile is imported before the fork, so the record file is opened
    lazily, in the process that writes it."""

    def __init__(self, profile: LoadProfile, output_path: str) -> None:
        self.profile = profile
        self.output_path = output_path
        self.requests = make_requests(profile)  # (prompt, max_tokens)
        self.offsets_s = (arrival_offsets(profile.mode, profile.rate, profile.duration_s, profile.seed)
                          if profile.open_loop else [])[:profile.requests]
        self.writer: RecordWriter | None = None
        self.started = gevent.event.Event()
        self.t0_ns = 0
        self.sending = True
        self.in_flight = 0
        self.environment: Environment | None = None
        self.ready_users = 0
        self._starting = False
        self._taken = 0  # arrivals (open loop) or requests (closed loop) this process handed out
        self.finish_requested = False  # LoadRunner.finish(): send nothing more, let in-flight requests end
        self.finish_requested_ns = 0   # when (perf_counter): arrivals due after it were never offered
        self._user_ids = itertools.count()

    def attach(self, environment: Environment) -> None:
        self.environment = environment

    @property
    def worker_index(self) -> int:
        """This process's index among Locust workers (known once it connected to the master; 0 alone)."""
        runner = self.environment.runner if self.environment else None
        return runner.worker_index if isinstance(runner, WorkerRunner) else 0

    def user_ready(self) -> None:
        self.ready_users += 1

    def start(self) -> None:
        """All users are spawned: once their clients are ready, start the clock (so setting
        them up does not make the first arrivals late), and end the run after duration_s."""
        if self._starting:
            return
        self._starting = True
        assert self.environment is not None and self.environment.runner is not None
        gevent.spawn(self._start_when_ready, self.environment.runner)

    def _start_when_ready(self, runner: Runner) -> None:
        local_users = len(runner.user_greenlets)  # 0 on a master: its users live in the workers
        wait_until(lambda: self.ready_users >= local_users, 60.0, 0.01, what="the users' clients",
                   on_timeout="return", sleep=gevent.sleep)
        self.t0_ns = time.perf_counter_ns()
        self.started.set()
        log.info("load started: %s, %d users here, %d scheduled arrivals", self.profile.mode,
                 local_users, len(self.offsets_s))
        if isinstance(runner, MasterRunner):
            gevent.spawn(self._finish_distributed, runner)
        elif isinstance(runner, WorkerRunner):
            if not self.profile.open_loop:  # open loop: the schedule ends by itself
                gevent.spawn_later(self.profile.duration_s, self._stop_sending)
        else:
            gevent.spawn(self._finish_local, runner)

    def _stop_sending(self) -> None:
        self.sending = False

    def request_finish(self, *_args: object) -> None:
        """Signal handler (SIGUSR1, sent by ``LoadRunner.finish``): the run ends now as if its
        duration were over, except that arrivals not yet taken are dropped, not sent late: no
        new request starts, the ones in flight finish. Only sets a flag (safe in a handler)."""
        self.finish_requested = True
        self.finish_requested_ns = self.finish_requested_ns or time.perf_counter_ns()

    def _sleep_run(self, runner: Runner) -> None:
        """Sleep out ``duration_s``, or until a finish is requested, or (``requests`` given) until
        every request was sent and none is in flight."""
        end = time.monotonic() + self.profile.duration_s
        while not self.finish_requested and time.monotonic() < end and not self._all_requests_done(runner):
            gevent.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def _all_requests_done(self, runner: Runner) -> bool:
        if self.profile.requests is None:
            return False
        if isinstance(runner, MasterRunner):  # the users live in the workers: done when all stopped
            return runner.user_count == 0
        return self.in_flight == 0 and self._exhausted()

    def _exhausted(self) -> bool:
        """Every request this process may send (``requests`` in all) was taken."""
        if self.profile.open_loop:
            return self.arrivals_left() == 0
        return self.profile.requests is not None and self._arrival(self._taken) >= self.profile.requests

    def _finish_local(self, runner: Runner) -> None:
        self._sleep_run(runner)
        if not self.profile.open_loop or self.finish_requested:
            self.sending = False
        # Open loop: arrivals that are due but not yet sent (every user was busy) are still
        # sent, late, so overload shows as latency rather than as missing requests. Then let
        # in-flight requests finish and quit; Locust kills whatever is still running: those
        # requests are recorded as cancelled, arrivals never sent as cancelled/NotSent.
        wait_until(lambda: not (self.in_flight or (self.sending and self.arrivals_left())),
                   self.profile.stop_timeout_s, 0.05, what="the requests in flight and the due arrivals",
                   on_timeout="return", sleep=gevent.sleep)
        self.sending = False
        log.info("load finished, %d requests in flight, %d arrivals not sent", self.in_flight, self.arrivals_left())
        runner.quit()

    def _finish_distributed(self, runner: Runner) -> None:
        self._sleep_run(runner)
        if self.profile.open_loop and not self.finish_requested:
            # workers start their clocks a little after this one and send late arrivals too:
            # wait until their users are done with the schedule (user counts arrive with the
            # workers' periodic reports)
            wait_until(lambda: not runner.user_count, self.profile.stop_timeout_s + 10.0, 0.2,
                       what="the workers' users to finish the schedule", on_timeout="return", sleep=gevent.sleep)
        # stop() waits until every worker's users stopped (each finishes its in-flight request
        # within --stop-timeout); only then quit, which gives workers just 3 s to exit
        runner.stop()
        runner.quit()

    def _arrival(self, k: int) -> int:
        """Index in the schedule of this process's k-th arrival."""
        return self.worker_index + k * self.profile.processes

    def arrivals_left(self) -> int:
        """Open loop: arrivals of this process not yet taken by a user."""
        if not self.profile.open_loop:
            return 0
        return len(range(self._arrival(self._taken), len(self.offsets_s), self.profile.processes))

    def next_send(self) -> tuple[str, int, int] | None:
        """(request id, prompt index, scheduled perf_counter ns) of the next request, or None
        when the run is over. Closed loop: now. Open loop: this process's next arrival.
        The caller owns it from now on: it must send it, or record it as not sent."""
        if not self.sending or self.finish_requested:
            return None
        k = self._taken
        if not self.profile.open_loop:
            if self._exhausted():
                return None
            self._taken += 1
            rid = f"load-{k}" if self.profile.processes == 1 else f"load-w{self.worker_index}-{k}"
            return rid, self._arrival(k), time.perf_counter_ns()
        i = self._arrival(k)
        if i >= len(self.offsets_s):
            return None
        self._taken += 1
        return f"load-{i}", i, self.t0_ns + int(self.offsets_s[i] * 1e9)

    def record_not_sent(self, request_id: str, prompt_index: int, scheduled_ns: int) -> None:
        """An arrival the run ended before sending: it is part of the offered load, so it gets
        a record (cancelled, NotSent), dated at the moment it was given up."""
        anchor = process_anchor()
        now = time.perf_counter_ns()
        self.write(RequestRecord(
            request_id=request_id, scheduled_ns=scheduled_ns, sent_ns=now, end_ns=now, status="cancelled",
            error_class=NOT_SENT, error_message="the run ended before the generator could send it",
            prompt=self.prompt(prompt_index), max_tokens=self.max_tokens(prompt_index),
            anchor_wall_ns=anchor.wall_ns, anchor_mono_ns=anchor.mono_ns, anchor_perf_ns=anchor.perf_ns))

    def prompt(self, index: int) -> str:
        return self.requests[index % len(self.requests)][0]

    def max_tokens(self, index: int) -> int:
        return self.requests[index % len(self.requests)][1]

    def new_user_name(self) -> str:
        prefix = "user" if self.profile.processes == 1 else f"w{self.worker_index}-user"
        return f"{prefix}-{next(self._user_ids)}"

    def write(self, record: RequestRecord) -> None:
        if self.writer is None:
            path = (self.output_path if self.profile.processes == 1
                    else worker_records_path(self.output_path, self.worker_index))
            self.writer = RecordWriter(path)
        self.writer.write(record)

    def close(self) -> None:
        """The process quits: arrivals that were due but nobody took are recorded as not sent."""
        on_master = self.environment is not None and isinstance(self.environment.runner, MasterRunner)
        if self.started.is_set() and not on_master:  # a master sends nothing: its workers account
            self.sending = False
            # finished early: the schedule ended then (a distributed worker quits seconds after the finish)
            now = self.finish_requested_ns or time.perf_counter_ns()
            while self.arrivals_left():  # only arrivals already due: a run stopped early offered no more
                i = self._arrival(self._taken)
                scheduled_ns = self.t0_ns + int(self.offsets_s[i] * 1e9)
                if scheduled_ns > now:
                    break
                self._taken += 1
                self.record_not_sent(f"load-{i}", i, scheduled_ns)
        if self.writer is not None:
            self.writer.close()


class LLMUser(User):
    """Streams completions from an OpenAI-compatible server and records each one.

    Subclasses (see locustfile.py) set ``controller``. In open loop each user takes the next
    arrival, sleeps until its scheduled time and sends; if every user is busy, the send is
    late and the record shows it (scheduled_ns < sent_ns)."""

    abstract = True
    wait_time = constant(0)
    controller: LoadController

    def on_start(self) -> None:
        prof = self.controller.profile
        self.client = StreamingClient(self.host, model=prof.model, timeout_s=prof.timeout_s,
                                      user=self.controller.new_user_name(), on_record=self._on_record,
                                      api_key=os.environ.get("HARNESS_LOAD_API_KEY") or None,
                                      request_shape=request_shape(prof.engine))
        try:
            self.client.resolve_model()  # now, not in the first request's latency
        except ProbeError as exc:  # the server may be down (a fault): each request will record it
            log.warning("%s", exc)
        self.controller.user_ready()

    def on_stop(self) -> None:
        self.client.close()

    @task
    def complete(self) -> None:
        ctl = self.controller
        ctl.started.wait()
        nxt = ctl.next_send()
        if nxt is None:
            raise StopUser()
        request_id, prompt_index, scheduled_ns = nxt
        prof = ctl.profile
        request = CompletionRequest(prompt=ctl.prompt(prompt_index), max_tokens=ctl.max_tokens(prompt_index),
                                    ignore_eos=prof.ignore_eos, chat=prof.chat)
        ctl.in_flight += 1  # from taking the arrival: the run must not end between take and send
        try:
            delay_s = (scheduled_ns - time.perf_counter_ns()) / 1e9
            if delay_s > 0:  # killed while sleeping here: not due yet, so never offered
                gevent.sleep(delay_s)
            self.client.send(request, request_id=request_id, scheduled_ns=scheduled_ns)
        finally:
            ctl.in_flight -= 1

    def _on_record(self, record: RequestRecord) -> None:
        self.controller.write(record)
        # open loop: from the scheduled send, so Locust's table does not hide queueing either
        start = record.scheduled_or_sent_ns if self.controller.profile.open_loop else record.sent_ns
        ttft_ms = ((record.first_token_ns or record.end_ns or start) - start) / 1e6
        self.environment.events.request.fire(
            request_type="POST", name="/v1/chat/completions" if self.controller.profile.chat else "/v1/completions",
            response_time=ttft_ms, response_length=record.num_output_tokens,
            exception=None if record.ok else RuntimeError(f"{record.status}: {record.error_class}"),
            context={"request_id": record.request_id})
