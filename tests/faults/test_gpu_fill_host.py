"""The HBM fill on a GPU host, without a GPU: its verify and revert read an NVML stand-in the
test builds (free memory = total minus what live stand-in fillers hold, as NVML would report a
real filler's cudaMalloc), and its filler is a real background process started, found and
ended through the executor exactly as `python -m harness gpu-fill` would be on a GPU host."""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.errors import ConfigError, FaultError, RevertError
from harness.fabric.sshdtest import _children, _kill_and_reap
from harness.faults import FaultRunner, HostHbmFill, Ledger
from harness.hosts import ExecutorPool
from harness.faults.gpu_fill import amount_bytes
from harness.probes.workers.gpu import nvml_memory

GIB = 1 << 30
TOTAL = 80 * GIB

# a stand-in filler: records what it holds (pid + bytes) where the NVML stand-in reads it, holds
# until SIGTERM, then releases (removes the record); argv as gpu-fill's: --device N --gib G
STANDIN_FILLER = r"""
import json, os, signal, sys, time
held_dir, args = sys.argv[1], sys.argv[2:]
gib = float(args[args.index("--gib") + 1])
path = os.path.join(held_dir, str(os.getpid()))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
with open(path, "w") as fh:
    json.dump({"device": int(args[args.index("--device") + 1]), "bytes": int(gib * (1 << 30))}, fh)
print("holding", flush=True)
while not stop:
    time.sleep(0.05)
os.unlink(path)
"""


class NvmlStandIn:
    """The few pynvml calls nvml_memory makes, answered from the stand-in fillers' records."""

    class NVMLError(Exception):
        pass

    def __init__(self, held_dir: Path, leaked: int = 0) -> None:
        self.held_dir, self.leaked, self.inits = held_dir, leaked, 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        used = self.leaked + sum(json.loads(p.read_text())["bytes"] for p in self.held_dir.iterdir()
                                 if _live(int(p.name)))
        return SimpleNamespace(total=TOTAL, used=used, free=TOTAL - used)


def _live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def adopted():
    """Make this test process the reaper of the fillers the executor's shell leaves behind
    (this machine's pid 1 reaps nothing), and end and reap any that remain. Only children that
    appeared during the block: a session fixture's process (the loopback sshd of conftest.py) is
    a child of this process too, and ending it broke every SSH test after this file."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = _children()
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        for pid in _children() - before:
            if pid not in _ours():
                _kill_and_reap(pid)
        libc.prctl(36, 0, 0, 0, 0)


@pytest.fixture
def adopt():
    with adopted():
        yield


def test_the_reaper_ends_what_the_block_left_and_spares_the_session_sshd(sshd):
    import socket
    with adopted():
        orphan = subprocess.Popen(["sleep", "300"])
        pid = orphan.pid
        orphan.returncode = 0   # forget it as a Popen: it stands for a filler the shell left behind
        subprocess._active = [p for p in getattr(subprocess, "_active", []) if p.pid != pid]
    assert not _live(pid)
    socket.create_connection(("127.0.0.1", sshd.port), timeout=2).close()   # the session's sshd still listens


def _ours() -> set[int]:
    return {p.pid for p in getattr(subprocess, "_active", []) or []}


def _fault(tmp_path: Path, nvml: NvmlStandIn, **kwargs) -> HostHbmFill:
    held = tmp_path / "held"
    held.mkdir(exist_ok=True)
    return HostHbmFill(device=0, gib=kwargs.pop("gib", 30), timeout_s=kwargs.pop("timeout_s", 20),
                       filler=kwargs.pop("filler", [sys.executable, "-c", STANDIN_FILLER, str(held)]),
                       memory=lambda ex, device: nvml_memory(device, nvml), **kwargs)


def test_fill_is_verified_by_the_free_memory_drop_and_reverted_until_it_is_back(tmp_path, adopt):
    nvml = NvmlStandIn(tmp_path / "held")
    fault = _fault(tmp_path, nvml)
    with FaultRunner(Ledger.for_cluster("gpu", tmp_path), ExecutorPool(), handle_signals=False) as runner:
        runner.inject(fault)
        assert nvml_memory(0, nvml)["free"] == TOTAL - 30 * GIB  # the stand-in filler holds its 30 GiB
        pid = int(Path(fault.pid_file).read_text())
        assert _live(pid)
    assert not _live(pid) and nvml_memory(0, nvml)["free"] == TOTAL
    assert [(r.action.value, r.status.value) for r in runner.records] == [
        ("inject", "succeeded"), ("verify", "succeeded"), ("revert", "succeeded"), ("verify_reverted", "succeeded")]
    assert "30.00 GiB held by the filler" in runner.records[1].output
    assert [e["status"] for e in Ledger.for_cluster("gpu", tmp_path).entries()] == ["reverted"]
    assert nvml.inits == 0  # every nvmlInit was shut down
    assert not Path(fault.pid_file).exists() and not Path(fault.log_file).exists()  # nothing left on the host


def test_a_filler_that_cannot_allocate_fails_the_injection_with_its_own_error(tmp_path, adopt):
    nvml = NvmlStandIn(tmp_path / "held")
    no_cuda = [sys.executable, "-c", "import sys; print('gpu-fill: no CUDA device here'); sys.exit(3)"]
    with FaultRunner(Ledger.for_cluster("gpu", tmp_path), ExecutorPool(), handle_signals=False) as runner:
        with pytest.raises(FaultError, match="exited before the memory dropped: gpu-fill: no CUDA device here"):
            runner.inject(_fault(tmp_path, nvml, filler=no_cuda))
    assert [e["status"] for e in Ledger.for_cluster("gpu", tmp_path).entries()] == ["reverted"]


def test_memory_that_does_not_come_back_fails_the_revert_check(tmp_path, adopt):
    nvml = NvmlStandIn(tmp_path / "held")
    fault = _fault(tmp_path, nvml, timeout_s=1)
    runner = FaultRunner(Ledger.for_cluster("gpu", tmp_path), ExecutorPool(), handle_signals=False)
    runner.inject(fault)
    nvml.leaked = 5 * GIB  # e.g. a filler's context that the driver did not release
    with pytest.raises(RevertError, match="GiB free .* after the revert"):
        runner.revert(fault)


def test_asking_more_than_is_free_is_refused_before_anything_starts(tmp_path, adopt):
    nvml = NvmlStandIn(tmp_path / "held", leaked=70 * GIB)
    with FaultRunner(Ledger.for_cluster("gpu", tmp_path), ExecutorPool(), handle_signals=False) as runner:
        with pytest.raises(FaultError, match="30.00 GiB asked"):
            runner.inject(_fault(tmp_path, nvml))
    assert Ledger.for_cluster("gpu", tmp_path).entries() == []


def test_fault_settings_and_plan():
    with pytest.raises(ConfigError, match="exactly one of gib and fraction"):
        HostHbmFill(gib=1, fraction=0.5)
    with pytest.raises(ConfigError, match="out of range"):
        HostHbmFill(fraction=1.5)
    plan = HostHbmFill(host="gpu-node-0", device=3, fraction=0.9).plan()
    assert "python3 -m harness gpu-fill --device 3 --fraction 0.9" in plan[1]
    assert plan[0].startswith("prepare: gpu-node-0$ nvidia-smi -q -x -i 3")


def test_gpu_fill_amounts_are_checked_against_free_memory():
    assert amount_bytes(80 * GIB, 10, None) == 10 * GIB
    assert amount_bytes(80 * GIB, None, 0.5) == 40 * GIB
    with pytest.raises(ConfigError, match="GiB free"):
        amount_bytes(8 * GIB, 10, None)
    with pytest.raises(ConfigError, match="--fraction"):
        amount_bytes(8 * GIB, None, 1.0)


def test_gpu_fill_without_cuda_exits_3_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "harness", "gpu-fill", "--device", "0", "--gib", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 3, proc.stderr
    assert "no CUDA device here" in proc.stderr and "GPU host" in proc.stderr
