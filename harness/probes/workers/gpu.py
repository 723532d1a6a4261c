"""GPU probe through NVML (the ``gpu`` extra: nvidia-ml-py): per device its name, HBM use and ECC
error counters, driver and CUDA versions, for the report's environment and for evidence on GPU
machines; :func:`nvml_memory` is what the on-host HBM fill verifies with locally.

A machine without the library or without an NVIDIA driver is not an error: :func:`gpu_inventory`
then returns ``None`` and :func:`nvml_unavailable_reason` says why (and what would provide it).
Remote hosts are read with ``nvidia-smi -q -x`` over SSH (harness.probes.workers.nvsmi).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def nvml_unavailable_reason() -> str | None:
    """None when NVML answers; else why not, with the fix."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install 'harness[gpu]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"NVML is not available on this machine ({exc}): no NVIDIA driver"
    pynvml.nvmlShutdown()
    return None


def _ecc(pynvml: Any, handle: Any, error_type: int) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, pynvml.NVML_VOLATILE_ECC))
    except pynvml.NVMLError:  # ECC off or not supported on this board
        return None


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_memory(device: int, nvml: Any = None) -> dict[str, int]:
    """{total, used, free} bytes of ``device`` from NVML (``nvml``: a pynvml-like module, the
    real one by default)."""
    if nvml is None:
        import pynvml as nvml
    nvml.nvmlInit()
    try:
        mem = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(device))
        return {"total": int(mem.total), "used": int(mem.used), "free": int(mem.free)}
    finally:
        nvml.nvmlShutdown()


def nvsmi_inventory(run: Any = None) -> list[dict[str, Any]] | None:
    """The same inventory from ``nvidia-smi -q -x`` (a driver without a loadable NVML for this
    Python); None when nvidia-smi is not here or fails. ``run``: argv -> stdout, for tests."""
    import shutil
    import subprocess

    from harness.probes.workers.nvsmi import NVSMI_ARGV, parse_nvsmi_xml

    if run is None:
        if shutil.which("nvidia-smi") is None:
            return None
        proc = subprocess.run(NVSMI_ARGV, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            log.warning("nvidia-smi -q -x failed: %s", proc.stderr.strip()[:300])
            return None
        text = proc.stdout
    else:
        text = run(NVSMI_ARGV)
    return [{"index": g.index, "name": g.name, "driver": g.driver_version, "cuda": g.cuda_version,
             "memory_total_bytes": g.memory_total_bytes, "memory_used_bytes": g.memory_used_bytes,
             "ecc_uncorrected_volatile": g.ecc["uncorrected_volatile"],
             "ecc_corrected_volatile": g.ecc["corrected_volatile"]} for g in parse_nvsmi_xml(text)]


def _cuda_version(pynvml: Any) -> str | None:
    try:
        v = int(pynvml.nvmlSystemGetCudaDriverVersion())
    except (pynvml.NVMLError, AttributeError):
        return None
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_inventory() -> list[dict[str, Any]] | None:
    """One dict per GPU, or None when neither NVML nor ``nvidia-smi`` answers (see
    :func:`nvml_unavailable_reason`)."""
    if nvml_unavailable_reason() is not None:
        return nvsmi_inventory()
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = _str(pynvml.nvmlSystemGetDriverVersion())
        cuda = _cuda_version(pynvml)
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": _str(name), "driver": driver, "cuda": cuda,
                        "memory_total_bytes": int(mem.total), "memory_used_bytes": int(mem.used),
                        "ecc_uncorrected_volatile": _ecc(pynvml, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                        "ecc_corrected_volatile": _ecc(pynvml, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)})
        return out
    finally:
        pynvml.nvmlShutdown()
