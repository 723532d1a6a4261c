"""The soak leak sampler reads real /proc figures of real child processes (``sleep``, reaped by the
test: process 1 here does not reap orphans) and appends them to a JSON-lines file it streams back."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from harness.engine.admin.models import AdminWorker
from harness.errors import ProbeError
from harness.probes.workers.leaks import LeakSample, LeakSampler, ProcessReading, read_process, read_samples, take_sample
from harness.waiting import wait_until


@pytest.fixture
def sleeper():
    """A ``sleep`` child holding two extra descriptors (a pipe's ends) besides stdin/out/err."""
    r, w = os.pipe()
    proc = subprocess.Popen(["sleep", "60"], pass_fds=(r, w), stdin=subprocess.DEVNULL)
    os.close(r)
    os.close(w)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def statm_rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def row(worker_id: str, pid: int | None, kv: int = 0) -> AdminWorker:
    return AdminWorker.parse({"id": worker_id, "role": "decode", "health": "healthy", "pid": pid,
                              "kv_blocks_used": kv, "kv_blocks_total": 100, "num_running": 1,
                              "active_requests": 2}, "GET /admin/workers")


def settled(pid: int) -> None:
    """Wait until ``sleep`` sleeps (exec and the dynamic loader done: its memory no longer grows)."""
    wait_until(lambda: Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "S", 10, 0.01,
               what="the child to sleep")


def test_read_process_gives_the_real_figures_of_a_live_process(sleeper):
    settled(sleeper.pid)
    reading = read_process(sleeper.pid)
    assert reading is not None and reading.pid == sleeper.pid
    assert reading.fds == 5          # 0, 1, 2 and the two passed pipe ends
    assert reading.threads == 1      # sleep(1) is single-threaded
    assert abs(reading.rss_bytes - statm_rss_bytes(sleeper.pid)) <= 64 * 1024   # the kernel's own figure
    mine = read_process(os.getpid())
    assert mine is not None and mine.threads >= 1 and mine.rss_mb > 10    # this Python, torch and all


def test_read_process_is_none_for_a_zombie_and_for_a_reaped_process(sleeper):
    sleeper.kill()
    wait_until(lambda: "Z" in Path(f"/proc/{sleeper.pid}/stat").read_text().rpartition(")")[2][:3], 10, 0.01,
               what="the killed child to become a zombie")
    assert read_process(sleeper.pid) is None      # dead, not reaped yet: no VmRSS
    sleeper.wait()
    assert read_process(sleeper.pid) is None      # gone
    assert read_process(2 ** 22 + 1) is None      # above pid_max: never existed


def test_take_sample_reads_proc_only_for_local_workers_with_a_pid(sleeper):
    settled(sleeper.pid)  # before its exec the child may hold other descriptors (failed once under -n 2)
    local = take_sample([row("decode-0", sleeper.pid, kv=7), row("decode-1", None)], local=True)
    assert local.harness is not None and local.harness.pid == os.getpid()
    d0, d1 = local.workers
    assert (d0.id, d0.kv_blocks_used, d0.kv_blocks_total, d0.num_running, d0.active_requests) == \
        ("decode-0", 7, 100, 1, 2)
    assert d0.process is not None and d0.process.fds == 5 and d1.process is None
    remote = take_sample([row("decode-0", sleeper.pid)], local=False)
    assert remote.workers[0].process is None and remote.workers[0].pid == sleeper.pid
    assert LeakSample.from_dict(local.to_dict()) == local     # JSON-able both ways


def test_sampler_appends_real_readings_and_skips_ticks_whose_table_fails(sleeper, tmp_path, caplog):
    calls = {"n": 0}

    def workers() -> list[AdminWorker]:
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise ConnectionError("router restarting")
        return [row("decode-0", sleeper.pid, kv=calls["n"])]

    path = tmp_path / "out" / "leaks.jsonl"
    settled(sleeper.pid)
    with caplog.at_level(logging.WARNING, logger="harness.probes.workers.leaks"):
        with LeakSampler(workers, path, interval_s=0.02) as sampler:
            wait_until(lambda: sampler.count >= 4, 30, 0.01, what="4 leak samples")
        count = sampler.count
    assert sampler.skipped >= 2 and "router restarting" in sampler.last_error
    warnings = [r.getMessage() for r in caplog.records if "tick skipped" in r.getMessage()]
    assert len(warnings) == 1          # the same failure twice: one warning
    samples = list(read_samples(path))
    assert len(samples) == count == sum(1 for _ in path.open())   # stopped means stopped: nothing after
    assert [s.workers[0].kv_blocks_used for s in samples[:2]] == [1, 4]   # ticks 2 and 3 left no line
    assert all(s.workers[0].process == read_process(sleeper.pid) for s in samples)  # a sleeping child stays the same
    assert all(s.harness is not None and s.harness.pid == os.getpid() for s in samples)
    assert [s.t for s in samples] == sorted(s.t for s in samples)
    summary = sampler.summary()
    assert summary["samples"] == count
    assert summary["kv_blocks_used"] == {"decode-0": samples[-1].workers[0].kv_blocks_used}
    assert not hasattr(sampler, "samples")   # constant memory: the file holds them


def test_a_sampler_appends_to_an_existing_file_and_a_worker_that_died_reads_none(sleeper, tmp_path):
    path = tmp_path / "leaks.jsonl"
    path.write_text(take_sample([], local=True).to_json() + "\n")
    sampler = LeakSampler(lambda: [row("decode-0", sleeper.pid)], path, interval_s=3600).start()
    try:
        sleeper.kill()
        sleeper.wait()
        sample = sampler.sample_now()
    finally:
        sampler.stop()
        sampler.stop()    # twice is fine
    assert sample is not None and sample.workers[0].process is None and sample.workers[0].pid == sleeper.pid
    assert len(list(read_samples(path))) == 1 + sampler.count


def test_read_samples_skips_a_cut_last_line_and_refuses_a_bad_one_before_it(tmp_path, caplog):
    good = take_sample([], local=True).to_json()
    path = tmp_path / "leaks.jsonl"
    path.write_text(f"{good}\n{good}\n{good[:25]}")
    with caplog.at_level(logging.WARNING, logger="harness.probes.workers.leaks"):
        assert len(list(read_samples(path))) == 2
    assert "cut short" in caplog.text
    path.write_text(f"{good}\n{{\"harness\": null}}\n{good}\n")   # no time
    with pytest.raises(ProbeError, match=r"leaks.jsonl:2: not a leak sample"):
        list(read_samples(path))
    with pytest.raises(ProbeError, match="cannot read leak samples"):
        list(read_samples(tmp_path / "missing.jsonl"))


def test_sampler_refuses_a_bad_interval_and_a_second_start(tmp_path):
    with pytest.raises(ProbeError, match="out of range"):
        LeakSampler(list, tmp_path / "x.jsonl", interval_s=0)
    sampler = LeakSampler(list, tmp_path / "x.jsonl", interval_s=3600).start()
    try:
        with pytest.raises(ProbeError, match="already started"):
            sampler.start()
    finally:
        sampler.stop()
    assert ProcessReading(1, 3 << 20, 4, 2).rss_mb == 3.0


def test_a_sample_carries_the_harness_python_blocks_and_an_older_line_reads_without_them(tmp_path):
    held = [object() for _ in range(50_000)]
    sample = take_sample([], local=True)
    assert sample.harness_py_blocks is not None and sample.harness_py_blocks >= len(held)
    again = LeakSample.from_dict(sample.to_dict())
    assert again == sample
    old = sample.to_dict()
    del old["harness_py_blocks"]   # a file written before the field existed
    assert LeakSample.from_dict(old).harness_py_blocks is None
