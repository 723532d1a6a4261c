"""HBM fill on a GPU host: another tenant's allocation beside the engine, started over SSH.

``HostHbmFill`` runs the stand-alone filler (``python -m harness gpu-fill``, harness.faults.gpu_fill)
in the background on the fault's host, verifies that the device's free memory dropped by the
amount asked (NVML on this machine, ``nvidia-smi -q -x`` on a remote one), and reverts by ending
the filler and checking the memory came back. Unlike ``HbmFill`` (the bundled engine's admin
hook), it needs nothing from the engine: it is what a user's cluster can be given. Real engines
preallocate their KV pool, so the fill squeezes what they allocate next (a restart, CUDA graphs,
activations), not the pool they hold; the report says what was measured, not more.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from harness.errors import ConfigError, FaultError
from harness.faults.base import Fault, no_ledger
from harness.ids import new_fault_id
from harness.hosts import Executor, LocalExecutor

STATE_DIR = "/tmp/pdh-faults"
COMMAND_TIMEOUT_S = 15.0
POLL_S = 0.5          # polling GPU memory while the filler allocates or frees
GIB = 1 << 30

MemoryReader = Callable[[Executor, int], dict[str, int]]   # (executor, device) -> {total, used, free} bytes


def nvsmi_memory(ex: Executor, device: int) -> dict[str, int]:
    """Memory of ``device`` from ``nvidia-smi -q -x -i DEVICE`` on the executor's host."""
    from harness.probes.workers.nvsmi import read_gpus

    (gpu,) = read_gpus(ex, device)
    if gpu.memory_free_bytes is None or gpu.memory_total_bytes is None:
        raise FaultError(f"nvidia-smi on {ex.host} reports no memory figures for GPU {device}",
                         fix="check the driver; the fill cannot be verified without them")
    return {"total": gpu.memory_total_bytes, "used": gpu.memory_used_bytes or 0, "free": gpu.memory_free_bytes}


def default_reader(ex: Executor, device: int) -> dict[str, int]:
    """NVML when the host is this machine and NVML answers, else nvidia-smi through the executor."""
    if isinstance(ex, LocalExecutor):
        from harness.probes.workers.gpu import nvml_memory, nvml_unavailable_reason

        if nvml_unavailable_reason() is None:
            return nvml_memory(device)
    return nvsmi_memory(ex, device)


@dataclass
class HostHbmFill(Fault):
    """Hold ``gib`` GiB (or ``fraction`` of the free memory) of GPU ``device`` on ``host``."""

    kind: ClassVar[str] = "hbm_fill_host"

    host: str = "localhost"
    device: int = 0
    gib: float | None = None
    fraction: float | None = None
    filler: list[str] = field(default_factory=lambda: ["python3", "-m", "harness", "gpu-fill"])
    tolerance_bytes: int = 256 << 20      # other processes' churn on the device meanwhile
    timeout_s: float = 120.0
    free_before: int | None = None        # set by prepare (kept in the ledger for a later revert)
    expected_drop: int | None = None
    fault_id: str = field(default_factory=new_fault_id)
    memory: MemoryReader = no_ledger(default=default_reader, repr=False)

    def __post_init__(self) -> None:
        if (self.gib is None) == (self.fraction is None):
            raise ConfigError("hbm_fill_host needs exactly one of gib and fraction", fix="pass gib=10 or fraction=0.9")
        if self.gib is not None and not self.gib > 0 or self.fraction is not None and not 0 < self.fraction < 1:
            raise ConfigError(f"hbm_fill_host: gib {self.gib} / fraction {self.fraction} out of range",
                              fix="gib > 0, fraction in (0, 1)")
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0:
            raise ConfigError(f"hbm_fill_host: device must be a GPU index, got {self.device!r}", fix="pass device=0")
        if not self.filler:
            raise ConfigError("hbm_fill_host: filler command is empty", fix="leave the default (python3 -m harness gpu-fill)")

    @property
    def target(self) -> str:
        amount = f"{self.gib:g} GiB" if self.gib is not None else f"{self.fraction:.0%} of free"
        return f"GPU {self.device} ({amount}) @ {self.host}"

    @property
    def pid_file(self) -> str:
        return f"{STATE_DIR}/{self.fault_id}.gpufill.pid"

    @property
    def log_file(self) -> str:
        return f"{STATE_DIR}/{self.fault_id}.gpufill.log"

    def filler_argv(self) -> list[str]:
        amount = ["--gib", f"{self.gib:g}"] if self.gib is not None else ["--fraction", f"{self.fraction:g}"]
        return [*self.filler, "--device", str(self.device), *amount]

    def _start_argv(self) -> list[str]:
        return ["sh", "-c", f"mkdir -p {STATE_DIR} && nohup {shlex.join(self.filler_argv())} > {self.log_file} 2>&1 "
                            f"< /dev/null & echo $! > {self.pid_file}"]

    def _alive_argv(self) -> list[str]:
        # a zombie (exited, not yet reaped) holds no memory: it does not count as alive
        return ["sh", "-c", f'p=$(cat {self.pid_file} 2>/dev/null) && s=$(ps -o stat= -p "$p") && '
                            f'[ "${{s#Z}}" = "$s" ]']

    def _alive(self, ex: Executor) -> bool:
        return ex.run(self._alive_argv(), timeout=COMMAND_TIMEOUT_S, check=False).rc == 0

    def _log_tail(self, ex: Executor) -> str:
        return ex.run(["tail", "-c", "800", self.log_file], timeout=COMMAND_TIMEOUT_S, check=False).stdout.strip()

    def prepare(self, ex: Executor) -> str:
        mem = self.memory(ex, self.device)
        self.free_before = int(mem["free"])
        self.expected_drop = int(self.gib * GIB) if self.gib is not None else int(self.free_before * self.fraction)
        if self.expected_drop > self.free_before:
            raise FaultError(f"hbm_fill_host: {self.expected_drop / GIB:.2f} GiB asked, GPU {self.device} on "
                             f"{self.host} has {self.free_before / GIB:.2f} GiB free", fix="ask for less")
        return f"GPU {self.device}: {self.free_before / GIB:.2f} of {mem['total'] / GIB:.2f} GiB free before the fill"

    def inject(self, ex: Executor) -> str:
        ex.run(self._start_argv(), timeout=COMMAND_TIMEOUT_S)
        return f"filler started on {self.host}: {shlex.join(self.filler_argv())} (pid in {self.pid_file})"

    def verify(self, ex: Executor) -> str:
        assert self.free_before is not None and self.expected_drop is not None
        want = self.free_before - self.expected_drop + self.tolerance_bytes
        deadline = time.monotonic() + self.timeout_s
        while True:
            free = int(self.memory(ex, self.device)["free"])
            if free <= want:
                return (f"GPU {self.device} free {free / GIB:.2f} GiB (was {self.free_before / GIB:.2f}): "
                        f"{(self.free_before - free) / GIB:.2f} GiB held by the filler")
            if not self._alive(ex):
                raise FaultError(f"hbm_fill_host: the filler on {self.host} exited before the memory dropped: "
                                 f"{self._log_tail(ex) or '(no output)'}",
                                 fix="read the filler's error; it needs a CUDA build of torch and the harness there")
            if time.monotonic() > deadline:
                raise FaultError(f"hbm_fill_host: GPU {self.device} free memory is {free / GIB:.2f} GiB after "
                                 f"{self.timeout_s:.0f} s, expected <= {want / GIB:.2f}", fix="see the filler's log")
            time.sleep(POLL_S)

    def revert(self, ex: Executor) -> str:
        if not self._alive(ex):
            ex.run(["rm", "-f", self.pid_file, self.log_file], timeout=COMMAND_TIMEOUT_S, check=False)
            return "the filler is not running: nothing held"
        stop = (f'p=$(cat {self.pid_file}); kill -TERM "$p"; i=0; while [ $i -lt 100 ]; do '
                f's=$(ps -o stat= -p "$p") || break; [ "${{s#Z}}" = "$s" ] || break; sleep 0.1; i=$((i+1)); done; '
                f'kill -KILL "$p" 2>/dev/null; rm -f {self.pid_file} {self.log_file}')
        ex.run(["sh", "-c", stop], timeout=COMMAND_TIMEOUT_S + 10)
        return f"filler on {self.host} ended"

    def verify_reverted(self, ex: Executor) -> str:
        if self.free_before is None:
            return "nothing was measured before: the fill never started"
        deadline = time.monotonic() + self.timeout_s
        while True:
            free = int(self.memory(ex, self.device)["free"])
            if free >= self.free_before - self.tolerance_bytes:
                return f"GPU {self.device} free {free / GIB:.2f} GiB again (was {self.free_before / GIB:.2f})"
            if time.monotonic() > deadline:
                raise FaultError(f"hbm_fill_host: GPU {self.device} on {self.host} has {free / GIB:.2f} GiB free "
                                 f"{self.timeout_s:.0f} s after the revert, {self.free_before / GIB:.2f} before",
                                 fix=f"look for a leftover filler (`nvidia-smi`, {self.pid_file}) on {self.host}")
            time.sleep(POLL_S)

    def plan(self) -> list[str]:
        read = f"{self.host}$ nvidia-smi -q -x -i {self.device}  # or NVML on this machine"
        return [f"prepare: {read}  # free memory before",
                f"inject: {self.host}$ {shlex.join(self._start_argv())}",
                f"verify: {read}  # poll until free dropped by the amount, or the filler died",
                f"revert: {self.host}$ kill -TERM $(cat {self.pid_file}); wait until it is gone (KILL after 10 s)",
                f"verify_reverted: {read}  # free memory back within {self.tolerance_bytes >> 20} MiB"]


__all__ = ["HostHbmFill", "nvsmi_memory"]
