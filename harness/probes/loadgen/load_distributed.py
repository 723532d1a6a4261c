"""Load from several hosts with Locust's own master/worker mode (the cluster file's ``load_hosts:``).

    runner = DistributedLoadRunner(api_url, profile, load_host_targets(spec), master_bind="10.0.0.5")
    with runner:                 # master here, one Locust worker per load host over SSH, all joined
        ...                      # inject faults while the load runs
    records = runner.records()   # every host's requests, each naming its load_host

The master runs on this machine (a child process, as :class:`LoadRunner`'s Locust does) with
``--master --expect-workers N``; each load host runs ``python -m locust --worker`` with the harness's
own locustfile over SSH (paramiko, strict host keys, every command audited). The SSH session holds
the worker process (no daemon, nothing detached), so the host's sshd reaps it.

Open loop without coordinated omission across hosts: every worker builds the same seeded schedule
and sends arrivals k, k+N, k+2N, ... (k: its index at the master), each measured from its own
scheduled send time, exactly as the forked processes of a ``--processes`` run do.

Records are streamed, not gathered at the end: each worker appends one JSON line per request to
a file under its host's ``work_dir`` (flushed per record); a thread here reads the new complete
lines of every host over SFTP each second and appends them, with ``load_host`` set, to the run's
``requests.jsonl``. Nothing relies on a shared filesystem. At the end the worker logs are copied
next to it (``locust.<host>.log``) and the host's run folder is removed.

Stopping is verified on every exit path: the master's quit ends the workers; one that is still
running after that is sent SIGTERM, then SIGKILL, through the pid file its SSH session wrote, and the
host is asked again until no process of the run is left (an error names a host where one is).

What concerns one load host alone (how it is reached, the scripts run there, its worker's signals, log
and folder, its record stream) is in harness.probes.loadgen.load_hosts; this module runs them together.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from harness.errors import ConfigError, ExecutorError, ProbeError
from harness.hosts import AuditLog, SSHExecutor
from harness.probes.loadgen.load import LOCUSTFILE, LoadRunner
from harness.probes.loadgen.load_hosts import (KILL_GRACE_S, PREFLIGHT, WORKER_SCRIPT, LoadHostTarget, LoadWorker,
                                       RecordStream, load_host_targets, master_bind_address)
from harness.probes.client.records import RecordWriter, RequestRecord
from harness.probes.loadgen.workload import JOINED_ENV, LOAD_HOST_ENV, LoadProfile

log = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 5557
PULL_INTERVAL_S = 1.0
# after the master quit: a worker that got the master's stop sleeps --stop-timeout before it reads the
# quit (Locust 2.x); its users are stopped and its records written, so it is ended as Locust ends the
# forked workers of --processes (after 3 s), gracefully (SIGTERM: Locust's own shutdown) then SIGKILL
WORKER_EXIT_GRACE_S = 3.0
PREFLIGHT_TIMEOUT_S = 60.0   # importing Locust on a busy host
FANOUT = 16                  # hosts served at once by the preflight and the stop

T = TypeVar("T")


def runner_for(spec: Any, api_url: str, profile: LoadProfile, **kwargs: Any) -> LoadRunner:
    """A :class:`DistributedLoadRunner` when the cluster file names load hosts, else the local
    :class:`LoadRunner` (``kwargs``: output_dir, api_key; audit for the distributed one)."""
    audit = kwargs.pop("audit", None)
    if spec is None or not getattr(spec, "load_hosts", ()):
        return LoadRunner(api_url, profile, **kwargs)
    m = spec.load_master
    return DistributedLoadRunner(api_url, profile, load_host_targets(spec), master_bind=m.bind, master_port=m.port,
                                 join_timeout_s=m.join_timeout_s, audit=audit, **kwargs)


class DistributedLoadRunner(LoadRunner):
    """One Locust run of ``profile`` from the load ``hosts``, a Locust worker on each (``users`` in
    all, split among them by the master); the records of all go to ``output_dir/requests.jsonl``."""

    def __init__(self, api_url: str, profile: LoadProfile, hosts: Sequence[LoadHostTarget], *,
                 output_dir: str | os.PathLike | None = None, api_key: str | None = None,
                 master_bind: str | None = None, master_port: int = DEFAULT_MASTER_PORT,
                 join_timeout_s: float = 60.0, audit: AuditLog | None = None,
                 pull_interval_s: float = PULL_INTERVAL_S) -> None:
        hosts = list(hosts)
        if not hosts:
            raise ConfigError("a distributed load run needs at least one load host",
                              fix="list load hosts under `load_hosts:` in the cluster file, or use LoadRunner")
        names = [h.name for h in hosts]
        if len(set(names)) != len(names):
            raise ConfigError(f"load hosts are named twice: {names}", fix="give each load host its own name")
        n = len(hosts)
        if profile.processes not in (1, n):
            raise ConfigError(f"the profile asks for {profile.processes} Locust processes, but {n} load hosts run "
                              f"one worker each", fix="leave processes at 1 with load hosts (one worker per host)")
        if profile.users < n:
            raise ConfigError(f"{profile.users} users cannot be spread over {n} load hosts",
                              fix=f"give at least one user per load host (users >= {n})")
        if join_timeout_s <= 0:
            raise ConfigError(f"join_timeout_s must be > 0, got {join_timeout_s}", fix="give e.g. 60 seconds")
        # processes = N: each worker takes every N-th arrival of the schedule (LoadController)
        super().__init__(api_url, dataclasses.replace(profile, processes=n), output_dir=output_dir, api_key=api_key)
        self.hosts = hosts
        self.master_bind = master_bind or master_bind_address(hosts)
        self.master_port = master_port
        self.join_timeout_s = join_timeout_s
        self.pull_interval_s = pull_interval_s
        self.audit = audit
        self.joined_path = self.output_dir / "joined.jsonl"
        self.run_tag = f"{self.output_dir.name}-{uuid.uuid4().hex[:8]}"
        self._workers: list[LoadWorker] = []
        self._writer: RecordWriter | None = None
        self._pull_stop = threading.Event()
        self._pull_thread: threading.Thread | None = None
        self._ended = False
        self._started_any = False

    # -- the master ------------------------------------------------------------------------------

    def command(self) -> list[str]:
        p = self.profile
        return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--master",
                "--expect-workers", str(len(self.hosts)),
                "--expect-workers-max-wait", str(math.ceil(self.join_timeout_s + 10)),  # the harness gives up first
                "--master-bind-host", self.master_bind, "--master-bind-port", str(self.master_port),
                "--host", self.api_url, "-u", str(p.users), "-r", str(max(p.users * 10, 10)), "--only-summary",
                "--loglevel", "WARNING", "--stop-timeout", str(math.ceil(p.stop_timeout_s))]

    def _extra_env(self) -> dict[str, str]:
        return {JOINED_ENV: str(self.joined_path)}

    def expected_duration_s(self) -> float:
        return super().expected_duration_s() + self.join_timeout_s

    # -- the workers -----------------------------------------------------------------------------

    def worker_command(self, w: LoadWorker) -> list[str]:
        """The argv run over SSH on ``w``'s host (no secret in it: it is audited)."""
        d = w.remote_dir
        return ["sh", "-c", WORKER_SCRIPT, "sh", d,
                "env", f"HARNESS_LOAD_PROFILE={self.profile.to_json()}", f"HARNESS_LOAD_OUTPUT={d}/requests.jsonl",
                f"{LOAD_HOST_ENV}={w.name}", w.target.python, "-m", "locust", "-f", w.locustfile, "--worker",
                "--master-host", self.master_bind, "--master-port", str(self.master_port),
                "--loglevel", "WARNING", "--logfile", f"{d}/locust.log"]

    def start(self) -> None:
        if self._proc is not None or self._started_any:
            raise ProbeError("this load run was already started", fix="create a new DistributedLoadRunner per run")
        self._started_any = True
        try:
            self._workers = [self._new_worker(h) for h in self.hosts]
            self._fan_out(self._preflight, what="prepare the load hosts")
            super().start()  # the master (it calibrates the profile first when prompts are sized in tokens)
            self._wait_master_listening()
            for w in self._workers:
                w.thread = threading.Thread(target=self._hold_worker, args=(w,), name=f"locust-worker-{w.name}",
                                            daemon=True)
                w.thread.start()
            self._pull_thread = threading.Thread(target=self._pull_loop, name="load-records", daemon=True)
            self._pull_thread.start()
            self._wait_joined()
        except BaseException:
            self.stop()
            raise

    def _new_worker(self, h: LoadHostTarget) -> LoadWorker:
        return LoadWorker(h, remote_dir=f"{h.work_dir.rstrip('/')}/{self.run_tag}-{h.name}",
                       control=SSHExecutor(h.ssh, audit=self.audit), session=SSHExecutor(h.ssh, audit=self.audit))

    def _preflight(self, w: LoadWorker) -> None:
        """The host runs the harness's locustfile with a Locust like ours; its run folder is made."""
        try:
            out = w.control.run([w.target.python, "-c", PREFLIGHT, w.remote_dir], timeout=PREFLIGHT_TIMEOUT_S)
            w.made = True
            found = json.loads(out.stdout.strip().splitlines()[-1])
        except (ExecutorError, ValueError, IndexError) as exc:
            raise ProbeError(f"load host {w.name} ({w.target.ssh.host}) cannot run the harness's Locust worker with "
                             f"{w.target.python}: {exc}",
                             fix=f"install the harness with Locust for that interpreter on {w.name}, or set "
                                 "load_hosts[].python to one that has them") from exc
        ours = importlib.metadata.version("locust")  # never `import locust` here: it monkey-patches this process
        if found["locust"] != ours:
            raise ProbeError(f"load host {w.name} has Locust {found['locust']}, this machine {ours}",
                             fix="install the same Locust version on every load host and here")
        w.locustfile = found["locustfile"]
        try:
            w.sftp = w.control.sftp()
        except Exception as exc:  # paramiko: "Channel closed." when sshd has no sftp subsystem
            raise ProbeError(f"load host {w.name} ({w.target.ssh.host}) refuses SFTP ({exc}): the records are read "
                             "back through it", fix="enable sshd's SFTP subsystem there (`Subsystem sftp "
                             "internal-sftp` in sshd_config; it is on in a stock OpenSSH)") from exc
        if self._api_key:
            with w.sftp.open(f"{w.remote_dir}/api_key", "w") as fh:  # in the run's 0700 folder
                fh.chmod(0o600)
                fh.write(self._api_key)

    def _wait_master_listening(self) -> None:
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            if not self.running:
                self._reaped(check=False)
                raise ProbeError(f"the Locust master exited with code {self.returncode} before listening on "
                                 f"{self.master_bind}:{self.master_port}; log tail:\n{self.log_tail()}",
                                 fix="see the master's log (a port in use: set load_master.port)")
            try:
                socket.create_connection((self.master_bind, self.master_port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise ProbeError(f"the Locust master does not listen on {self.master_bind}:{self.master_port} "
                                     f"after {self.join_timeout_s:.0f} s; log tail:\n{self.log_tail()}",
                                     fix="check load_master.bind is an address of this machine") from None
                time.sleep(0.1)  # Locust is still importing

    def _hold_worker(self, w: LoadWorker) -> None:
        """The worker's SSH session, for as long as the worker runs (a thread per host)."""
        try:
            w.result = w.session.run(self.worker_command(w), timeout=self.expected_duration_s() + KILL_GRACE_S * 3,
                                     check=False)
        except ExecutorError as exc:
            w.error = str(exc)

    def joined_hosts(self) -> set[str]:
        """The load hosts whose workers told the master they joined."""
        try:
            lines = self.joined_path.read_text().splitlines()
        except FileNotFoundError:
            return set()
        return {json.loads(line)["host"] for line in lines if line.strip()}

    def _wait_joined(self) -> None:
        names = {w.name for w in self._workers}
        deadline = time.monotonic() + self.join_timeout_s
        while not names <= self.joined_hosts():
            ended = [w for w in self._workers if w.thread is not None and not w.thread.is_alive()]
            if ended or not self.running or time.monotonic() > deadline:
                missing = sorted(names - self.joined_hosts())
                why = "".join(f"\n  {w.name}: its worker exited ({w.tail() or 'no output'})" for w in ended)
                if not self.running:
                    why += f"\n  the master exited; log tail:\n{self.log_tail()}"
                raise ProbeError(
                    f"load host(s) {', '.join(missing) or '(none)'} never joined the Locust master at "
                    f"{self.master_bind}:{self.master_port} within {self.join_timeout_s:.0f} s{why}",
                    fix=f"check that {', '.join(missing) or 'every load host'} reach {self.master_bind}:"
                        f"{self.master_port} (firewall; load_master.bind) and see locust.<host>.log in {self.output_dir}")
            time.sleep(0.2)

    def finish(self, timeout_s: float | None = None, *, read: bool = True) -> list[RequestRecord]:
        """As :meth:`LoadRunner.finish`, the workers told too: no new request, in-flight ones end."""
        self._require_started()
        self._fan_out(lambda w: w.signal("USR1"), what="tell the load hosts to finish",
                      workers=[w for w in self._workers if w.thread is not None and w.thread.is_alive()])
        return super().finish(timeout_s, read=read)

    # -- records -----------------------------------------------------------------------------------

    def _pull_loop(self) -> None:
        while not self._pull_stop.wait(self.pull_interval_s):
            for w in self._workers:
                try:
                    self._pull(w)
                except Exception as exc:  # retried next time; the last pull, after the run, raises
                    log.debug("pulling the records of load host %s failed: %s", w.name, exc)

    def _pull(self, w: LoadWorker, final: bool = False) -> int:
        if w.sftp is None:
            return 0
        if self._writer is None:
            self._writer = RecordWriter(self.records_path)
        if w.stream is None:
            w.stream = RecordStream(w.name, self._writer)
        names = [n for n in w.sftp.listdir(w.remote_dir) if n.startswith("requests") and n.endswith(".jsonl")]
        return w.stream.pull(names, lambda n: w.sftp.open(f"{w.remote_dir}/{n}", "rb"), final=final)

    def _record_files(self) -> list[Path]:
        return [self.records_path] if self.records_path.exists() else []

    def records_by_host(self) -> dict[str, int]:
        """Records merged so far, per load host."""
        return {w.name: (w.stream.count if w.stream else 0) for w in self._workers}

    # -- the end -----------------------------------------------------------------------------------

    def stop(self, grace_s: float = 15.0) -> list[RequestRecord]:
        try:
            return super().stop(grace_s)
        finally:
            problem = self._end_workers()  # when the master never started; else done already
            if problem is not None:
                log.error("%s", problem)

    def _reaped(self, check: bool = True) -> None:
        problem = self._end_workers()
        super()._reaped(check)
        if check and problem is not None:
            raise problem

    def _end_workers(self) -> ProbeError | None:
        """After the master: every worker gone (verified on its host), the last records read, the
        logs copied, the hosts' run folders removed. Once; returns what went wrong, if anything."""
        if self._ended:
            return None
        self._ended = True
        problems: list[str] = []
        started = [w for w in self._workers if w.thread is not None]
        deadline = time.monotonic() + WORKER_EXIT_GRACE_S
        for w in started:  # the master's quit ends them
            w.thread.join(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
        problems += self._fan_out(lambda w: self._stop_worker(w), what="stop the load hosts' workers",
                                  workers=self._workers, collect=True)
        self._pull_stop.set()
        if self._pull_thread is not None:
            self._pull_thread.join()
        for w in self._workers:
            try:
                self._pull(w, final=True)
            except Exception as exc:
                problems.append(f"{w.name}: its records could not be read: {exc}")
            w.copy_log(self.output_dir / f"locust.{w.name}.log")
        if self._writer is not None:
            self._writer.close()
        for w in started:
            if w.error and not w.signalled:
                problems.append(f"{w.name}: {w.error}")
            elif w.result is not None and w.result.rc not in (0, 1) and not w.signalled:
                problems.append(f"{w.name}: its worker exited with code {w.result.rc}: {w.tail()}")
        problems += self._fan_out(LoadWorker.remove_folder, what="remove the run folders", workers=self._workers,
                                  collect=True)
        for w in self._workers:
            if w.sftp is not None:
                w.sftp.close()
            w.control.close()
            w.session.close()
        if not problems:
            return None
        return ProbeError("distributed load: " + "; ".join(problems),
                          fix=f"see locust.<host>.log in {self.output_dir} and the audit log")

    def _stop_worker(self, w: LoadWorker) -> None:
        """Nothing of this run left on the host: asked even when its session ended by itself."""
        if not w.locustfile:
            return  # preflight never finished: no worker was started there
        alive = w.thread is not None and w.thread.is_alive()
        outcome = w.signal("TERM")
        if alive:
            log.info("load host %s: the worker outlived the master by %.0f s; it was %s", w.name,
                     WORKER_EXIT_GRACE_S, outcome)
            w.notes.append(f"the worker outlived the master by {WORKER_EXIT_GRACE_S:.0f} s; {outcome}")
        if w.thread is not None:
            w.thread.join(KILL_GRACE_S + 10)
            if w.thread.is_alive():  # the process is gone: only the SSH channel lingers
                w.session.close()
                w.thread.join(5)

    def _fan_out(self, action: Callable[[LoadWorker], T], *, what: str, workers: Sequence[LoadWorker] | None = None,
                 collect: bool = False) -> list[str]:
        """``action`` on every worker's host, at most FANOUT at once. Errors name their host: raised
        together as one ProbeError, or returned (``collect``) by a clean-up that must go on."""
        workers = self._workers if workers is None else workers
        errors: list[Exception] = []
        problems: list[str] = []
        if workers:
            with ThreadPoolExecutor(max_workers=min(FANOUT, len(workers)), thread_name_prefix="load-host") as pool:
                futures = [(w, pool.submit(action, w)) for w in workers]
                for w, fut in futures:
                    try:
                        fut.result()
                    except Exception as exc:
                        errors.append(exc)
                        problems.append(str(exc) if w.name in str(exc) else f"{w.name}: {exc}")
        if errors and not collect:
            if len(errors) == 1:
                raise errors[0]
            raise ProbeError(f"could not {what} on {len(errors)} hosts: " + "; ".join(problems),
                             fix="fix each host as its error says")
        return problems
