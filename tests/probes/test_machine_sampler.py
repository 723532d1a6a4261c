"""The machine-health sampler reads real /proc data of real child processes. Assertions are about
directions (a busy process used CPU, a contended one waited), never timing thresholds: the
machine these tests run on is shared and loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.errors import ProbeError
from harness.probes.machine_health import procfs
from harness.probes.machine_health.machine import MachineMonitor, group_of, send_lateness
from harness.probes.client.records import RequestRecord, process_anchor
from harness.waiting import wait_until

BUSY = "import os, sys, time\n{pin}t = time.time()\nwhile time.time() - t < {s}: pass\n"
IDLE = "import time\ntime.sleep({s})\n"


def child(code: str, *argv_tail: str) -> subprocess.Popen:
    """A real Python child whose command line carries ``argv_tail`` (how the sampler groups it)."""
    return subprocess.Popen([sys.executable, "-c", code, *argv_tail], stdin=subprocess.DEVNULL)


def more_samples(monitor: MachineMonitor, n: int = 2) -> None:
    """Wait until the monitor has taken ``n`` more samples (however loaded the machine is)."""
    target = monitor.taken + n
    wait_until(lambda: monitor.taken >= target, 60, 0.02, what=f"{n} more machine samples")


def reap(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_psi_of_this_machine_parses_and_only_grows():
    if not procfs.PSI_CPU.exists():
        pytest.skip("this kernel has no /proc/pressure/cpu")
    first = procfs.read_psi()
    time.sleep(0.05)
    second = procfs.read_psi()
    assert first is not None and second is not None
    assert second.some_total_us >= first.some_total_us >= 0 and 0 <= first.some_avg10 <= 100


def test_steal_of_this_machine_reads_and_only_grows_and_every_window_has_its_share():
    first = procfs.read_steal_seconds()
    assert first is not None and first >= 0  # /proc/stat exists on every Linux; 0 on bare metal
    with MachineMonitor(interval_s=0.05) as monitor:
        time.sleep(0.4)
    second = procfs.read_steal_seconds()
    assert second >= first
    figures = monitor.window(0, time.time() + 1)
    assert figures["samples"] >= 2 and 0 <= figures["steal_pct"] <= 100
    total = sum(s.steal_s for s in monitor.samples())
    assert total <= second - first + 0.02  # the samples' steal is what /proc/stat counted meanwhile


def test_psi_text_with_and_without_a_full_line():
    some = "some avg10=1.50 avg60=0.80 avg300=0.20 total=123456\n"
    assert procfs.parse_psi(some) == procfs.Psi(123456, 1.5)
    full = some + "full avg10=0.00 avg60=0.00 avg300=0.00 total=42\n"
    assert procfs.parse_psi(full) == procfs.Psi(123456, 1.5, 42, 0.0)


@pytest.mark.parametrize("text", ["", "some avg10=1.0 avg60=0.5\n", "some avg10=x total=1\n", "some garbage\n",
                                  "full avg10=0.00 total=5\n"])
def test_a_malformed_psi_file_is_an_error_naming_the_file(text, tmp_path):
    path = tmp_path / "cpu"
    path.write_text(text)
    with pytest.raises(ProbeError, match=str(path)):
        procfs.read_psi(path)


def test_without_psi_the_monitor_says_so_and_still_samples(tmp_path):
    with MachineMonitor(interval_s=0.05, psi_path=tmp_path / "absent") as monitor:
        more_samples(monitor)
    w = monitor.window(0, time.time() + 1)
    assert monitor.psi_note == procfs.PSI_ABSENT and w["psi_note"] == procfs.PSI_ABSENT
    assert w["samples"] > 0 and w["psi_some_pct"] is None and w["timer_lag_p50_ms"] is not None


def test_a_malformed_psi_file_is_noted_not_fatal(tmp_path):
    bad = tmp_path / "cpu"
    bad.write_text("some nonsense\n")
    with MachineMonitor(interval_s=0.05, psi_path=bad) as monitor:
        more_samples(monitor)
    assert str(bad) in monitor.psi_note and monitor.window(0, time.time() + 1)["samples"] > 0


def test_a_busy_load_generator_shows_cpu_use_and_an_idle_engine_does_not():
    with MachineMonitor(interval_s=0.1, scan_every_s=0.1) as monitor:
        t0 = time.time()
        busy, idle = child(BUSY.format(pin="", s=1.5), "locust"), child(IDLE.format(s=1.5), "harness.engine.idle")
        try:
            busy.wait(30), idle.wait(30)
        finally:
            reap(busy, idle)
        more_samples(monitor)
    w = monitor.window(t0, time.time())
    assert w["load_generator_processes"] == 1 and w["engine_processes"] == 1
    assert w["load_generator_cpu_pct"] > w["engine_cpu_pct"] >= 0
    assert w["harness_processes"] == 1 and w["fabric_probe_cpu_pct"] is None  # no fabric probe ran


def test_a_load_generator_pinned_beside_busy_processes_waits_for_the_cpu():
    cpu = min(os.sched_getaffinity(0))
    pin = f"os.sched_setaffinity(0, {{{cpu}}})\n"
    with MachineMonitor(interval_s=0.1, scan_every_s=0.1) as monitor:
        t0 = time.time()
        rivals = [child(BUSY.format(pin=pin, s=2.0)) for _ in range(2)]
        victim = child(BUSY.format(pin=pin, s=1.5), "locust")
        try:
            victim.wait(30)
            for r in rivals:
                r.wait(30)
        finally:
            reap(victim, *rivals)
        more_samples(monitor)
    w = monitor.window(t0, time.time())
    assert w["load_generator_wait_pct"] > 0 and w["load_generator_wait_per_run_ms"] > 0
    assert 0 < w["load_generator_wait_share_pct"] < 100 and w["load_generator_cpu_pct"] > 0
    assert w["watched_wait_per_run_ms"] > 0


def test_processes_that_come_and_go_are_counted_from_birth_and_forgotten_after_exit():
    with MachineMonitor(interval_s=0.1, scan_every_s=0.1) as monitor:
        more_samples(monitor)  # the child is born after the baseline
        t0 = time.time()
        short = child(BUSY.format(pin="", s=0.6), "harness.fabric.ends")
        try:
            short.wait(30)
        finally:
            reap(short)
        more_samples(monitor)
        assert not monitor._procs.keys() - {os.getpid()}  # the exited child is not tracked any more
    w = monitor.window(t0, time.time())
    assert w["fabric_probe_processes"] == 1 and w["fabric_probe_cpu_pct"] > 0


def test_stop_joins_the_thread_and_the_ring_is_bounded():
    monitor = MachineMonitor(interval_s=0.05, max_samples=5).start()
    more_samples(monitor, 8)
    monitor.stop()
    monitor.stop()  # twice is fine
    assert not monitor._thread.is_alive() and len(monitor.samples()) == 5
    points = monitor.series(max_points=2)
    assert len(points) <= 3 and all("psi_some_pct" in p and "timer_lag_max_ms" in p for p in points)


def test_a_window_without_samples_has_no_figures():
    with MachineMonitor(interval_s=0.05) as monitor:
        more_samples(monitor)
    w = monitor.window(0, 1)  # 1970
    assert w["samples"] == 0 and w["psi_some_pct"] is None and w.get("watched_wait_per_run_ms") is None


def test_descendants_include_grandchildren():
    code = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(3)'])\n"
    parent = child(code)
    try:
        found = wait_until(lambda: procfs.descendants(os.getpid()), 20, 0.05, what="a child and a grandchild",
                           accept=lambda pids: len(pids) >= 2)
        assert parent.pid in found
    finally:
        for pid in procfs.descendants(parent.pid):
            os.kill(pid, 9)
        reap(parent)


def test_group_of_reads_the_command_line():
    assert group_of([sys.executable, "-m", "locust", "-f", "x.py"]) == "load generator"
    assert group_of(["/venv/bin/locust", "--headless"]) == "load generator"
    assert group_of([sys.executable, "-m", "harness.engine.pd.worker", "--id", "decode-0"]) == "engine"
    assert group_of([sys.executable, "-m", "harness.fabric.ends", "sink"]) == "fabric probes"
    assert group_of([sys.executable, "-m", "pytest", "tests/"]) is None


def test_send_lateness_counts_open_loop_requests_in_the_window_only():
    a = process_anchor()
    now = time.perf_counter_ns()

    def rec(i: int, late_ms: float, scheduled: bool = True) -> RequestRecord:
        at = now + i * 10**8
        return RequestRecord(request_id=str(i), scheduled_ns=at if scheduled else None, sent_ns=at + int(late_ms * 1e6),
                             anchor_wall_ns=a.wall_ns, anchor_mono_ns=a.mono_ns, anchor_perf_ns=a.perf_ns)

    records = [rec(i, late) for i, late in enumerate([1.0, 2.0, 3.0, 40.0])] + [rec(9, 500.0, scheduled=False)]
    start = a.perf_to_wall(now) / 1e9 - 0.01
    out = send_lateness(records, start, start + 1.0)
    assert out == {"send_lateness_n": 4, "send_lateness_p50_ms": 2.0, "send_lateness_p99_ms": 40.0}
    assert send_lateness(records, start + 100, start + 200)["send_lateness_n"] == 0


def test_an_out_of_range_interval_is_refused():
    with pytest.raises(ProbeError, match="interval"):
        MachineMonitor(interval_s=0.0)


def test_a_gone_process_reads_as_none():
    p = child("pass")
    reap(p)
    assert procfs.cpu_and_start_seconds(p.pid) is None and procfs.schedstat(p.pid) is None
    assert procfs.cmdline(p.pid) == [] and Path("/proc/self").exists()


def sample(t: float, steal_s: float):
    """A 0.5 s machine sample ending at ``t`` in which the hypervisor took ``steal_s`` CPU seconds."""
    from harness.probes.machine_health.machine import GROUPS, Sample

    zero = {g: 0.0 for g in GROUPS}
    return Sample(t=t, dt=0.5, lag_ms=0.1, load1=1.0, runnable=1, psi_some_us=0.0, psi_full_us=0.0,
                  psi_some_avg10=0.0, steal_s=steal_s, cpu_s=zero, ran_s=zero, wait_s=zero,
                  runs={g: 0 for g in GROUPS}, processes={}, engine_wait=())


def test_a_steal_burst_is_the_worst_5_s_of_the_window_not_its_mean():
    """100 samples of 0.5 s on 2 CPUs, the hypervisor taking 40 % of them for 6 s from t=20 s: the
    window's steal is 4.8 %, its burst 40 % from 20 s. Fails if the burst is the window's mean, if its span
    is shorter than 5 s (one noisy sample would be a burst), or if it is placed at the wrong time."""
    from harness.probes.machine_health.machine import steal_burst, summarise

    samples = [sample(0.5 * (i + 1), 0.4 if 40 <= i < 52 else 0.0) for i in range(100)]
    whole = summarise(samples, 2)
    assert whole["steal_pct"] == pytest.approx(4.8, abs=0.01)
    assert whole["steal_burst_pct"] == pytest.approx(40.0, abs=0.01) and whole["steal_burst_start"] == pytest.approx(20.0)
    one = [sample(0.5 * (i + 1), 0.9 if i == 10 else 0.0) for i in range(100)]   # 90 % for half a second
    assert steal_burst(one, 2)["steal_burst_pct"] == pytest.approx(9.0, abs=0.01)   # diluted over 5 s
    assert steal_burst(samples[:9], 2) == {"steal_burst_pct": None, "steal_burst_start": None}   # under 5 s


def test_steal_spans_are_the_times_some_5_s_held_a_burst_merged_and_a_noisy_sample_is_none():
    """The same 40 % burst for 6 s from t=20 s: every 5 s of samples over 20 % (a majority of them in
    the burst) lies in 18-28 s, one merged span; a half-second at 90 % is no span. Fails if spans are
    not merged (many overlapping spans), if one sample's steal makes a span, or if the span misses the
    burst's seconds (requests timed then would stay in 6.2's percentiles)."""
    from harness.probes.machine_health.machine import steal_spans

    samples = [sample(0.5 * (i + 1), 0.4 if 40 <= i < 52 else 0.0) for i in range(100)]
    assert steal_spans(samples, 2, 20.0) == [pytest.approx((18.0, 28.0))]
    assert steal_spans(samples, 2, 45.0) == []   # the burst's 40 % is under this limit
    two = [sample(0.5 * (i + 1), 0.4 if 40 <= i < 52 or 80 <= i < 92 else 0.0) for i in range(120)]
    assert steal_spans(two, 2, 20.0) == [pytest.approx((18.0, 28.0)), pytest.approx((38.0, 48.0))]
    one = [sample(0.5 * (i + 1), 0.9 if i == 10 else 0.0) for i in range(100)]
    assert steal_spans(one, 2, 20.0) == []
