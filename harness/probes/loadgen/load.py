"""Drive a load profile with Locust in its own process and collect the request records.

    with LoadRunner("http://127.0.0.1:8000", LoadProfile(mode="poisson", rate=4, duration_s=10)) as run:
        ...                      # inject faults while the load runs
    records = run.records()

The Locust process is a child of this one: ``stop()`` asks it to finish (SIGTERM, so
Locust stops its users and flushes), kills it if it does not, and always reaps it. If this process
dies without stopping it (SIGKILL), Locust notices within a second and stops by itself; its
environment carries the run's ``HARNESS_RUN_ID``, so the next run's recovery ends it too.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from harness.errors import ProbeError
from harness.probes.client.records import RequestRecord, iter_records
from harness.urls import http_url
from harness.probes.loadgen.workload import LoadProfile, worker_records_path

log = logging.getLogger(__name__)

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
API_KEY_ENV = "HARNESS_LOAD_API_KEY"  # the cluster's API key, read by the Locust users
_STARTUP_ALLOWANCE_S = 30.0  # Locust import + spawning on a loaded 2-core machine


class LoadRunner:
    """One Locust run of ``profile`` against ``api_url``; records go to ``output_dir/requests.jsonl``
    (``requests.w<k>.jsonl`` per worker process when ``profile.processes > 1``)."""

    def __init__(self, api_url: str, profile: LoadProfile, *, output_dir: str | os.PathLike | None = None,
                 api_key: str | None = None) -> None:
        self.api_url = http_url(api_url, "API URL")
        self._api_key = api_key  # to Locust by environment only: never in the profile JSON or the log
        self.profile = profile
        self.output_dir = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="harness-load-"))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.records_path = self.output_dir / "requests.jsonl"
        self.log_path = self.output_dir / "locust.log"
        self._proc: subprocess.Popen | None = None
        self._log_fh = None
        self.returncode: int | None = None
        self._finish_sent = False  # finish() signalled the process group

    def command(self) -> list[str]:
        users = self.profile.users
        return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", self.api_url,
                "-u", str(users), "-r", str(max(users * 10, 10)), "--only-summary", "--loglevel", "WARNING",
                "--stop-timeout", str(math.ceil(self.profile.stop_timeout_s)),
                *(["--processes", str(self.profile.processes)] if self.profile.processes > 1 else [])]

    def start(self) -> None:
        if self._proc is not None:
            raise ProbeError("this load run was already started", fix="create a new LoadRunner per run")
        for old in self._record_files():
            old.unlink()  # writers append; a rerun must not mix in old records
        if self.profile.sized_in_tokens:
            from harness.probes.loadgen.calibrate import calibrated

            self.profile = calibrated(self.profile, self.api_url, api_key=self._api_key)
        env = dict(os.environ, HARNESS_LOAD_PROFILE=self.profile.to_json(),
                   HARNESS_LOAD_OUTPUT=str(self.records_path), HARNESS_LOAD_PARENT_PID=str(os.getpid()))
        env.pop(API_KEY_ENV, None)
        if self._api_key:
            env[API_KEY_ENV] = self._api_key
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(self._extra_env())
        self._log_fh = open(self.log_path, "wb")
        log.info("starting Locust: %s (log %s)", " ".join(self.command()), self.log_path)
        # own process group: a multi-process run's forked workers can be killed with the master
        self._proc = subprocess.Popen(self.command(), env=env, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def _extra_env(self) -> dict[str, str]:
        """More environment for the Locust process (a subclass's; the distributed runner's master)."""
        return {}

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def expected_duration_s(self) -> float:
        return self.profile.duration_s + self.profile.stop_timeout_s + _STARTUP_ALLOWANCE_S

    def wait(self, timeout_s: float | None = None, *, read: bool = True) -> list[RequestRecord]:
        """Wait for the run to end by itself (duration_s plus draining); then the records (none
        when not ``read``: a long run's caller streams them with :meth:`iter_records`)."""
        proc = self._require_started()
        timeout_s = self.expected_duration_s() if timeout_s is None else timeout_s
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ProbeError(f"Locust did not finish within {timeout_s:.0f} s; stopped it (log: {self.log_path})",
                             fix="check the server answers, or raise timeout_s / stop_timeout_s") from None
        self._reaped()
        return self.records() if read else []

    def finish(self, timeout_s: float | None = None, *, read: bool = True) -> list[RequestRecord]:
        """End the run early but cleanly: no new request is sent, the ones in flight finish (within
        the profile's ``stop_timeout_s``), then the records. For a suite whose faults are done
        before the planned duration: nothing in flight is cut, so nothing-lost stays meaningful."""
        proc = self._require_started()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGUSR1)  # the master and any forked workers
                self._finish_sent = True
            except ProcessLookupError:
                pass
        timeout_s = self.profile.stop_timeout_s + _STARTUP_ALLOWANCE_S if timeout_s is None else timeout_s
        return self.wait(timeout_s, read=read)

    def stop(self, grace_s: float = 15.0) -> list[RequestRecord]:
        """End the run now: SIGTERM (Locust stops users, flushes records), SIGKILL after
        ``grace_s``; always reaped. Safe to call twice."""
        proc = self._proc
        if proc is None:
            return []
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("Locust (pid %s) ignored SIGTERM for %.0f s; killing its process group", proc.pid, grace_s)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self._reaped(check=False)
        return self.records() if self._record_files() else []

    def run(self) -> list[RequestRecord]:
        """start() + wait(), stopping the child on any error."""
        with self:
            return self.wait()

    def _record_files(self) -> list[Path]:
        if self.profile.processes == 1:
            return [self.records_path] if self.records_path.exists() else []
        paths = (worker_records_path(self.records_path, i) for i in range(self.profile.processes))
        return [p for p in paths if p.exists()]

    def records(self) -> list[RequestRecord]:
        """Every request of the run (of all Locust worker processes), in scheduled-send order."""
        return sorted(self.iter_records(), key=lambda r: r.start_wall_ns())

    def iter_records(self) -> Iterator[RequestRecord]:
        """Every request of the run, one at a time from its files (file by file, not in send order):
        what a run of hours reads instead of :meth:`records`."""
        files = self._record_files()
        if not files and not (self.returncode == -signal.SIGUSR1 and self._finish_sent):
            raise ProbeError(f"the load run wrote no records ({self.records_path}); log tail:\n{self.log_tail()}",
                             fix="see the Locust log for why no request was sent")
        for f in files:
            yield from iter_records(f)

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def _require_started(self) -> subprocess.Popen:
        if self._proc is None:
            raise ProbeError("the load run was not started", fix="call start() first (or use it as a context manager)")
        return self._proc

    def _reaped(self, check: bool = True) -> None:
        assert self._proc is not None
        self.returncode = self._proc.returncode
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        if self.returncode == -signal.SIGUSR1 and self._finish_sent:
            # still starting: the locustfile (which handles the finish signal) was not imported yet,
            # so no user had sent anything; seen beside a CPU burner, where start-up takes seconds
            log.warning("Locust (pid %s) was still starting when the run was finished early: it sent nothing",
                        self._proc.pid)
            return
        # Locust exits 1 when any request failed: that is a measurement, not a harness failure
        if check and self.returncode not in (0, 1):
            raise ProbeError(f"Locust exited with code {self.returncode}; log tail:\n{self.log_tail()}",
                             fix="fix the error shown in the Locust log")

    def __enter__(self) -> LoadRunner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
