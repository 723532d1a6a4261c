"""On a GPU machine only (skipped elsewhere): the filler and the probes for real. The HBM fill
holds 2 GiB of device 0 with `python -m harness gpu-fill`, verified and reverted with this
machine's NVML (or nvidia-smi), and nvidia-smi's document parses.

    PYTHONPATH=$PWD python -m pytest -q tests/faults/test_gpu_real.py   # needs a CUDA build of torch
"""

from __future__ import annotations

import shutil
import sys

import pytest

from harness.faults import FaultRunner, HostHbmFill, Ledger
from harness.hosts import ExecutorPool, LocalExecutor
from harness.probes.workers.nvsmi import read_gpus

from tests.faults.test_gpu_fill_host import adopt  # noqa: F401  (the fixture: fillers are reaped)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nvidia-smi") is None or not _cuda(),
                                 reason="needs an NVIDIA GPU, nvidia-smi and a CUDA build of torch")]


def test_nvidia_smi_document_of_this_machine_parses():
    gpus = read_gpus(LocalExecutor())
    assert gpus and all(g.memory_total_bytes and g.driver_version and g.name for g in gpus)
    assert gpus[0].memory_free_bytes is not None and gpus[0].temperature_c is not None


def test_hbm_fill_holds_real_device_memory_and_gives_it_back(tmp_path, adopt):  # noqa: F811
    fault = HostHbmFill(device=0, gib=2, filler=[sys.executable, "-m", "harness", "gpu-fill"], timeout_s=120)
    with FaultRunner(Ledger.for_cluster("gpu", tmp_path), ExecutorPool(), handle_signals=False) as runner:
        runner.inject(fault)
        free = read_gpus(LocalExecutor(), 0)[0].memory_free_bytes
        assert free <= fault.free_before - 2 * (1 << 30) + fault.tolerance_bytes
    assert [(r.action.value, r.status.value) for r in runner.records][-1] == ("verify_reverted", "succeeded")
