"""GPU probe through NVML (the ``gpu`` extra: nvidia-ml-py): per device its name, HBM use and ECC
error counters, for the report's environment and for evidence on GPU machines.

A machine without the library or without an NVIDIA driver is not an error: :func:`gpu_inventory`
then returns ``None`` and :func:`nvml_unavailable_reason` says why (and what would provide it).
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


def gpu_inventory() -> list[dict[str, Any]] | None:
    """One dict per GPU, or None when NVML is unavailable (see :func:`nvml_unavailable_reason`)."""
    if nvml_unavailable_reason() is not None:
        return None
    import pynvml

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append({"index": i, "name": name.decode() if isinstance(name, bytes) else str(name),
                        "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
                        "memory_total_bytes": int(mem.total), "memory_used_bytes": int(mem.used),
                        "ecc_uncorrected_volatile": _ecc(pynvml, h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
                        "ecc_corrected_volatile": _ecc(pynvml, h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)})
        return out
    finally:
        pynvml.nvmlShutdown()
