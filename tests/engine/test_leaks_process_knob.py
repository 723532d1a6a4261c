"""The planted process leak (EngineConfig.leak_kib_per_request, clusters/local-leaky-process.yaml):
a decode worker keeps N KiB of memory and one open fd per finished request, so soak.leaks has a
process leak it must fail. Driven through a WorkerEngine's public side (tests/engine/test_leak_knob.py's
Worker: its engine thread runs; no processes, no sockets); the fds are read from this process's
/proc by the leak probe's own reader."""

from __future__ import annotations

import logging
import os

import pytest

from harness.clusterfile import load_cluster
from harness.engine.core.config import EngineConfig
from harness.engine.pd.worker_engine import WorkerEngine
from harness.errors import ConfigError
from harness.probes.leaks import read_process
from tests.engine.test_leak_knob import Worker


@pytest.fixture
def decode():
    made: list[Worker] = []

    def make(kib: int) -> Worker:
        made.append(Worker(0, leak_kib_per_request=kib))
        return made[-1]
    yield make
    for w in made:
        w.stop()


def test_each_finished_request_keeps_its_kib_and_one_open_fd(decode, caplog):
    """Catches a knob that does nothing (the issue-33 leak never planted), leaks only on recovered
    streams, or allocates memory it never touches (calloc'd pages are not resident: no RSS rise)."""
    w = decode(200)
    fds_before = read_process(os.getpid()).fds
    with caplog.at_level(logging.WARNING, logger="harness.engine.pd.worker_engine"):
        for i in range(3):
            w.serve(f"r{i}", resume=[] if i else [65])
    assert [len(m) for m in w.engine.leaked_memory] == [200 * 1024] * 3
    assert all(m[:1] == b"\x5a" and m[-1:] == b"\x5a" for m in w.engine.leaked_memory)   # written: resident
    assert len(w.engine.leaked_fds) == 3 and read_process(os.getpid()).fds >= fds_before + 3
    assert [r.getMessage() for r in caplog.records if "leak_kib_per_request" in r.getMessage()] == [
        "sabotage: leaking 200 KiB and an fd per finished request (leak_kib_per_request); 1 requests, 1 fds so far"]
    w.stop()   # the worker's end closes them: the leak lasts while it runs
    assert w.engine.leaked_fds == [] and read_process(os.getpid()).fds <= fds_before + 1


def test_off_by_default_and_never_on_a_prefill_worker(decode):
    """Catches a leak planted in every cluster (default not 0) or in the prefill role too."""
    assert EngineConfig(preset="tiny").leak_kib_per_request == 0
    w = decode(0)
    w.serve("r", resume=[])
    assert w.engine.leaked_memory == [] and w.engine.leaked_fds == []
    prefill = WorkerEngine("prefill-0", "prefill", EngineConfig(preset="tiny", leak_kib_per_request=200),
                           publish=lambda m: None, on_failure=lambda: None)   # never started: no thread
    prefill._leak_on_finish("x")   # what a finished request calls; only the decode role leaks
    assert prefill.leaked_memory == [] and prefill.leaked_fds == []


@pytest.mark.parametrize("bad", [-1, 1.5, True, "200"])
def test_the_knob_must_be_a_whole_number_of_kib(bad):
    """Catches a bad setting accepted silently (a string that never leaks)."""
    with pytest.raises(ConfigError, match="leak_kib_per_request must be an integer >= 0"):
        EngineConfig(preset="tiny", leak_kib_per_request=bad)


def test_the_planted_cluster_file_sets_it_on_the_default_cluster():
    """Catches clusters/local-leaky-process.yaml not planting the leak (or planting another one)."""
    spec = load_cluster("local-leaky-process")
    assert spec.bundled.engine.model_dump(exclude_unset=True) == {"leak_kib_per_request": 200}
    assert (spec.bundled.prefill, spec.bundled.decode) == (2, 2)
