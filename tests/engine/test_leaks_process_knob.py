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
from harness.probes.workers.leaks import read_process
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


@pytest.mark.parametrize("absurd", [10241, 10**9])
def test_an_absurd_setting_is_refused_naming_the_bound(absurd):
    """Catches a knob with no upper bound (10**9 KiB a request: the first finished request asks for a
    terabyte), and the cluster file accepting it without naming the field."""
    with pytest.raises(ConfigError, match="leak_kib_per_request must be an integer >= 0 and <= 10240"):
        EngineConfig(preset="tiny", leak_kib_per_request=absurd)
    EngineConfig(preset="tiny", leak_kib_per_request=10240)   # the bound itself is allowed


def test_what_one_process_keeps_is_capped(decode, monkeypatch, caplog):
    """Catches an unbounded leak (200 KiB x ~23 requests/s: 33 GB in a 2-hour soak) and fds leaked up
    to the fd limit (the worker could then open no socket: its requests would fail). Caps scaled down:
    2 requests' memory, 3 fds (half a soft limit of 6)."""
    import harness.engine.pd.worker_engine as we

    monkeypatch.setattr(we, "LEAK_MEMORY_CAP_BYTES", 2 * 200 * 1024)
    real = we.resource.getrlimit
    monkeypatch.setattr(we.resource, "getrlimit",
                        lambda which: (6, 6) if which == we.resource.RLIMIT_NOFILE else real(which))
    w = decode(200)
    with caplog.at_level(logging.WARNING, logger="harness.engine.pd.worker_engine"):
        for i in range(5):
            w.serve(f"r{i}", resume=[])
    assert len(w.engine.leaked_memory) == 2 and len(w.engine.leaked_fds) == 3
    capped = [r.getMessage() for r in caplog.records if "its cap" in r.getMessage()]
    assert capped == ["sabotage: leak_kib_per_request keeps 400 KiB, its cap: no more memory leaked"], capped
    w.stop()
    assert w.engine.leaked_memory == []
