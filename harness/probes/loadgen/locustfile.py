"""Locust entry point for harness load runs: ``locust -f harness/probes/loadgen/locustfile.py``.

Started by ``harness.probes.loadgen.load.LoadRunner``, which passes the profile as JSON in
``HARNESS_LOAD_PROFILE`` and the JSONL output path in ``HARNESS_LOAD_OUTPUT``.
"""

from __future__ import annotations

import os
import signal

from locust import events
from locust.env import Environment

from harness.errors import ConfigError
from harness.probes.loadgen.locust_user import LLMUser, LoadController
from harness.probes.loadgen.workload import JOINED_ENV, JOINED_MESSAGE, LOAD_HOST_ENV, LoadProfile

try:
    _profile = LoadProfile.from_json(os.environ["HARNESS_LOAD_PROFILE"])
    _output = os.environ["HARNESS_LOAD_OUTPUT"]
except KeyError as exc:
    raise ConfigError(f"environment variable {exc} is not set",
                      fix="start load through harness.probes.loadgen.load.LoadRunner") from exc

_controller = LoadController(_profile, _output)
# LoadRunner.finish(): end the run early without cutting requests in flight (inherited by the
# forked worker processes of a multi-process run; the runner signals the whole process group)
signal.signal(signal.SIGUSR1, _controller.request_finish)


class LLMLoadUser(LLMUser):
    controller = _controller


PARENT_ENV = "HARNESS_LOAD_PARENT_PID"  # set by LoadRunner: the harness process that started this Locust


def _joined(environment: Environment, msg: object, **_kwargs: object) -> None:
    """The master heard a worker name its load host: note it for the harness (distributed load)."""
    import json

    data = dict(getattr(msg, "data", None) or {})
    with open(os.environ[JOINED_ENV], "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"host": data.get("host"), "index": data.get("index"),
                             "client_id": getattr(msg, "node_id", None)}) + "\n")


def _watch_parent(parent: int) -> None:
    """A harness that dies (SIGKILL) cannot stop its Locust: stop sending to its dead cluster at once."""
    import gevent

    while os.getppid() == parent:
        gevent.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)  # Locust's own graceful stop: users stop, records are flushed


@events.init.add_listener
def _on_init(environment: Environment, **_kwargs: object) -> None:
    _controller.attach(environment)
    from locust.runners import MasterRunner, WorkerRunner

    if isinstance(environment.runner, MasterRunner) and os.environ.get(JOINED_ENV):
        environment.runner.register_message(JOINED_MESSAGE, _joined)
    elif isinstance(environment.runner, WorkerRunner) and os.environ.get(LOAD_HOST_ENV):
        # connected already (the runner waits for the master's ack), so its index is known
        environment.runner.send_message(JOINED_MESSAGE, {"host": os.environ[LOAD_HOST_ENV],
                                                         "index": environment.runner.worker_index})
    parent = int(os.environ.get(PARENT_ENV) or 0)
    if parent and os.getppid() == parent:  # the master only: forked workers have the master as parent
        import gevent

        gevent.spawn(_watch_parent, parent)


@events.spawning_complete.add_listener
def _on_spawning_complete(user_count: int, **_kwargs: object) -> None:
    _controller.start()


@events.quitting.add_listener
def _on_quitting(**_kwargs: object) -> None:
    _controller.close()
