"""ECC and XID errors as a GPU's monitoring reports them, injected through DCGM on a real host.

``dcgmi test --inject --gpuid G -f FIELD -v VALUE`` writes a synthetic sample into the DCGM host
engine's cache (DCGM's error-injection framework): health watches, policies and every client of
that host engine (dcgm-exporter, the cluster's node agent) then see, say, a double-bit ECC error
on GPU G. **What this exercises, honestly: the cluster's monitoring and health path (does it drain
the worker on that GPU?), not the memory.** No byte of HBM changes, so no wrong token can follow
from it; the GPU keeps computing correctly.

An injected sample ages out of DCGM's cache, so the fault re-injects every ``interval_s`` for
``hold_s`` from a loop on the host (the pattern of the fabric faults: pid and stop files under
/tmp/pdh-faults, transitions to a log on the host, never to our pipe). The loop ends by itself after
``hold_s`` and then injects the healthy value (0), so a harness that dies mid-fault leaves nothing
injected for longer than ``hold_s``. Verified by the loop's first injection succeeding (``dcgmi``'s
exit status, in its log); reverted by stopping the loop and injecting the healthy value, which must
succeed.
"""

from __future__ import annotations

import shlex
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from harness.errors import ConfigError, ExecutorError, FaultError
from harness.faults.base import Fault, no_ledger
from harness.ids import new_fault_id
from harness.hosts import Executor, describe_command

STATE_DIR = "/tmp/pdh-faults"
COMMAND_TIMEOUT_S = 15.0

# name -> DCGM field id (dcgm_fields.h) of the fields this fault injects
FIELDS: dict[str, int] = {
    "ecc_dbe_volatile": 311,   # DCGM_FI_DEV_ECC_DBE_VOL_TOTAL: double-bit (uncorrectable) volatile ECC errors
    "ecc_sbe_volatile": 310,   # DCGM_FI_DEV_ECC_SBE_VOL_TOTAL: single-bit (corrected) volatile ECC errors
    "xid": 230,                # DCGM_FI_DEV_XID_ERRORS: the last XID error (e.g. 48: double-bit ECC)
}
HEALTHY_VALUE = 0


@dataclass
class DcgmInject(Fault):
    """Inject ``value`` into DCGM field ``field_name`` of GPU ``gpu`` on ``host`` for ``hold_s``."""

    kind: ClassVar[str] = "dcgm_inject"

    host: str = "localhost"
    gpu: int = 0
    field_name: str = "ecc_dbe_volatile"
    value: int = 1
    hold_s: float = 30.0
    interval_s: float = 1.0
    dcgmi: str = "dcgmi"            # the dcgmi binary on the host (cluster file hosts[].dcgm.dcgmi)
    worker: str = ""                # the worker on that GPU, for the report
    fault_id: str = field(default_factory=new_fault_id)
    _thread: Any = no_ledger(default=None, init=False, repr=False)
    _result: Any = no_ledger(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.field_name not in FIELDS:
            raise ConfigError(f"dcgm_inject: unknown field {self.field_name!r}",
                              fix=f"use one of {', '.join(FIELDS)}")
        if isinstance(self.gpu, bool) or not isinstance(self.gpu, int) or self.gpu < 0:
            raise ConfigError(f"dcgm_inject: gpu must be a DCGM GPU id (0, 1, ...), got {self.gpu!r}",
                              fix="name the GPU as `workers[].gpus` does")
        if not 1 <= self.hold_s <= 3600 or not 0.2 <= self.interval_s <= 10:
            raise ConfigError(f"dcgm_inject: hold_s {self.hold_s} / interval_s {self.interval_s} out of range",
                              fix="use hold_s in 1..3600 and interval_s in 0.2..10")

    @property
    def target(self) -> str:
        who = f" ({self.worker})" if self.worker else ""
        return f"GPU {self.gpu}{who} {self.field_name}={self.value} @ {self.host}"

    # -- the commands ------------------------------------------------------------------------------
    def _inject_argv(self, value: int) -> list[str]:
        return [self.dcgmi, "test", "--inject", "--gpuid", str(self.gpu), "-f", str(FIELDS[self.field_name]),
                "-v", str(value)]

    @property
    def _files(self) -> tuple[str, str, str]:
        base = f"{STATE_DIR}/{self.fault_id}"
        return f"{base}.pid", f"{base}.stop", f"{base}.log"

    def _loop_argv(self) -> list[str]:
        pid, stop, log = self._files
        inject, healthy = shlex.join(self._inject_argv(self.value)), shlex.join(self._inject_argv(HEALTHY_VALUE))
        return ["sh", "-c",
                f"mkdir -p {STATE_DIR}; echo $$ > {pid}; : > {log}; trap '' PIPE HUP; "
                f"trap '{healthy} >> {log} 2>&1; rm -f {pid}; exit 0' TERM INT; "
                f"end=$(( $(date +%s) + {int(round(self.hold_s))} )); "
                f"while [ $(date +%s) -lt $end ] && [ ! -e {stop} ]; do "
                f"{inject} >> {log} 2>&1; echo \"rc $? $(date +%s.%N)\" >> {log}; sleep {self.interval_s:g}; done; "
                f"{healthy} >> {log} 2>&1; echo \"healthy $? $(date +%s.%N)\" >> {log}; rm -f {pid}"]

    def _alive(self, ex: Executor) -> bool:
        pid = self._files[0]
        return ex.run(["sh", "-c", f'test -e {pid} && kill -0 "$(cat {pid})" 2>/dev/null'],
                      timeout=COMMAND_TIMEOUT_S, check=False).rc == 0

    def _log(self, ex: Executor) -> str:
        return ex.run(["cat", self._files[2]], timeout=COMMAND_TIMEOUT_S, check=False).stdout or ""

    # -- the cycle ---------------------------------------------------------------------------------
    def prepare(self, ex: Executor) -> str:
        try:
            res = ex.run([self.dcgmi, "discovery", "-l"], timeout=COMMAND_TIMEOUT_S, check=False)
            rc, said = res.rc, (res.stderr or res.stdout).strip()[:300]
        except ExecutorError as exc:  # the command is not there at all
            rc, said = 127, str(exc)
        if rc != 0:
            raise FaultError(f"dcgm_inject: `{self.dcgmi} discovery -l` failed on {self.host} (rc={rc}): {said}",
                             fix="install DCGM on the host and start its host engine (nv-hostengine, or the "
                                 "nvidia-dcgm service), or set hosts[].dcgm.dcgmi to its path")
        return f"DCGM answers on {self.host}"

    def inject(self, ex: Executor) -> str:
        ex.run(["rm", "-f", self._files[1]], timeout=COMMAND_TIMEOUT_S, check=False)

        def run() -> None:
            self._result = ex.run(self._loop_argv(), timeout=self.hold_s + 60, check=False)

        self._thread = threading.Thread(target=run, name=f"dcgm-inject-{self.fault_id}", daemon=True)
        self._thread.start()
        return (f"injecting {self.field_name} (field {FIELDS[self.field_name]}) = {self.value} into GPU {self.gpu} "
                f"every {self.interval_s:g} s for up to {self.hold_s:g} s (the monitoring path, not the memory)")

    def verify(self, ex: Executor) -> str:
        deadline = time.monotonic() + 10 + self.interval_s
        while time.monotonic() < deadline:
            for line in self._log(ex).splitlines():
                if line.startswith("rc "):
                    rc = int(line.split()[1])
                    if rc == 0:
                        return f"dcgmi accepted the injection on {self.host} (GPU {self.gpu})"
                    raise FaultError(f"dcgm_inject: dcgmi refused the injection on {self.host} (rc={rc}): "
                                     f"{self._log(ex).strip()[-300:]}",
                                     fix="check the GPU id and that the host engine runs in a mode that accepts "
                                         "injection (DCGM's error-injection framework)")
            time.sleep(0.1)  # the loop's first injection
        raise FaultError(f"dcgm_inject: no injection ran on {self.host} within {10 + self.interval_s:.0f} s",
                         fix="check the host's load and the fault loop's log in " + STATE_DIR)

    def revert(self, ex: Executor) -> str:
        pid, stop, log = self._files
        ex.run(["sh", "-c", f"mkdir -p {STATE_DIR} && touch {stop}"], timeout=COMMAND_TIMEOUT_S)
        limit = self.interval_s + 15
        deadline = time.monotonic() + limit
        if self._thread is not None:
            self._thread.join(limit)
        while self._alive(ex):
            if time.monotonic() > deadline:
                raise FaultError(f"dcgm_inject: the injection loop ({pid}) did not stop within {limit:.0f} s",
                                 fix=f"kill the process in {pid} on {self.host}, then revert again")
            time.sleep(0.1)  # the loop finishes its current sleep, then sees the stop file
        res = ex.run(self._inject_argv(HEALTHY_VALUE), timeout=COMMAND_TIMEOUT_S, check=False)
        if res.rc != 0:
            raise FaultError(f"dcgm_inject: injecting the healthy value back failed on {self.host} (rc={res.rc}): "
                             f"{(res.stderr or res.stdout).strip()[:300]}",
                             fix=f"run `{shlex.join(self._inject_argv(HEALTHY_VALUE))}` on {self.host}")
        ex.run(["rm", "-f", pid, stop, log], timeout=COMMAND_TIMEOUT_S, check=False)
        return f"loop stopped; {self.field_name} of GPU {self.gpu} set back to {HEALTHY_VALUE}"

    def verify_reverted(self, ex: Executor) -> str:
        if self._alive(ex):
            raise FaultError(f"dcgm_inject: the injection loop still runs on {self.host}",
                             fix=f"kill the process in {self._files[0]} on {self.host}")
        return f"no injection loop on {self.host}; the healthy value was accepted"

    def plan(self) -> list[str]:
        pid, stop, _ = self._files
        return [
            f"prepare: {self.host}$ {self.dcgmi} discovery -l  # DCGM must answer",
            f"inject: {describe_command(self.host, self._loop_argv())}",
            f"verify: {self.host}$ cat {self._files[2]}  # the first `dcgmi test --inject` exited 0",
            f"revert: {self.host}$ touch {stop}; wait for {pid} to vanish; "
            f"{shlex.join(self._inject_argv(HEALTHY_VALUE))}",
            f"verify_reverted: {self.host}$ no live process in {pid}",
            "note: this exercises the cluster's GPU monitoring and health path, not the memory",
        ]


__all__ = ["DcgmInject", "FIELDS", "HEALTHY_VALUE"]
